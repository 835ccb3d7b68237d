"""The shims of fxflops.capture.torch_versions: each answers alike through torch's newer name and through the
older fallback (the torch 2.11 of lent GPUs' images has only the older ones; CI pins a newer torch)."""

from __future__ import annotations

import pytest
import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.utils._python_dispatch import TorchDispatchMode

import fxflops
from fxflops.capture import torch_versions
from fxflops.sweeps import sweep

aten = torch.ops.aten


def test_a_device_mismatch_as_older_torch_raises_it_is_recognised():
    # before FakeTensorDeviceMismatchError (torch 2.11): a RuntimeError with the mode's message
    older = RuntimeError(f"{torch_versions.DEVICE_MISMATCH_MESSAGE} for aten.add.Tensor: cpu, meta")
    assert torch_versions.is_device_mismatch(older)
    assert not torch_versions.is_device_mismatch(RuntimeError("shape mismatch"))
    assert not torch_versions.is_device_mismatch(ValueError(torch_versions.DEVICE_MISMATCH_MESSAGE))


def test_a_device_mismatch_of_the_fake_mode_is_recognised():
    with FakeTensorMode():
        a, b = torch.empty(2, device="cpu"), torch.empty(2, device="meta")
        with pytest.raises(Exception) as raised:
            torch.add(a, b)
    assert torch_versions.is_device_mismatch(raised.value)


@pytest.mark.parametrize("op, expected", [
    (aten.add_.Tensor, True), (aten.mul_.Scalar, True), (aten.relu_.default, True), (aten.copy_.default, True),
    (aten.__iand__.Tensor, True), (aten.add.Tensor, False), (aten.add.out, False), (aten.view.default, False),
    (aten.__and__.Tensor, False), (aten.set_.source_Tensor, True)])
def test_inplace_from_the_schema_by_hand(op, expected):
    assert torch_versions.inplace_by_schema(op) is expected


def test_inplace_from_the_schema_equals_the_tag_where_torch_has_it():
    tag = getattr(torch.Tag, "inplace", None)
    if tag is None:
        pytest.skip(f"torch {torch.__version__} has no torch.Tag.inplace to compare with")
    ops = [getattr(aten, name) for name in ("add_", "mul_", "sub_", "div_", "relu_", "copy_", "fill_", "zero_",
                                            "clamp_", "add", "mul", "view", "index_put_", "masked_fill_")]
    # (TorchScript's extra overloads, copy_.Tensor and index_put_.hacked_twin, carry no inplace tag though their
    # schemas write `self`: the native ones are compared)
    overloads = [getattr(packet, name) for packet in ops for name in packet.overloads()
                 if name not in ("Tensor", "int", "float", "hacked_twin") or packet is not aten.copy_
                 and packet is not aten.index_put_]
    assert [torch_versions.inplace_by_schema(op) for op in overloads] == [tag in op.tags for op in overloads]


def test_inplace_from_the_schema_differs_from_the_tag_only_where_torch_leaves_it_off():
    if not hasattr(torch.Tag, "inplace"):
        pytest.skip(f"torch {torch.__version__} has no torch.Tag.inplace to compare with")
    inplace_by_schema = torch_versions.inplace_by_schema
    # over every aten overload: the few that differ take lists first
    overloads = [getattr(packet, name) for packet in map(lambda n: getattr(aten, n), dir(aten))
                 if hasattr(packet, "overloads") for name in packet.overloads()]
    differ = [op for op in overloads if (torch.Tag.inplace in op.tags) != inplace_by_schema(op)]
    assert len(differ) <= len(overloads) // 100
    # torch leaves these untagged: a list copy (copy_.Tensor takes a list first), internal twins
    assert all("hacked_twin" in str(op) or "copy_" in str(op) for op in differ), differ


def test_a_guarding_hint_of_a_plain_int_and_of_a_symbolic_size():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = mode.from_tensor(torch.zeros(2, 3), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    assert isinstance(x.shape[0], torch.SymInt)
    assert torch_versions.has_guarding_hint(x.shape[0]) and torch_versions.has_guarding_hint(3)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_the_python_dispatcher_folds_a_symbolic_linear_as_the_kernel_does():
    # what symbolic_composites gives linear and matmul: torch's Python decomposition of the fold, the same
    # ops as C++ (view, mm, _unsafe_view) and the sizes kept symbolic, no guard added
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    x = mode.from_tensor(torch.zeros(2, 5, 8), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    w = mode.from_tensor(torch.zeros(4, 8))
    recorded = _Ops()
    with mode, recorded, torch_versions.symbolic_composites(aten.linear.default):
        out = torch.nn.functional.linear(x, w)
    assert [str(s) for s in out.shape[:2]] == [str(s) for s in x.shape[:2]] and out.shape[2] == 4
    named = {*x.shape[0].node.expr.free_symbols, *x.shape[1].node.expr.free_symbols}
    assert not [guard for guard in env.guards if guard.expr.free_symbols & named]  # (mm checks the inner 8s)
    assert [op for op in recorded.ops if op in (aten.mm.default, aten.bmm.default)] == [aten.mm.default]


def test_only_the_folding_composites_run_under_the_python_dispatcher():
    assert torch_versions.folding_composite(aten.linear.default)
    assert torch_versions.folding_composite(aten.matmul.default)
    # dropout's Python decomposition would record another backward (native_dropout_backward for mul)
    assert not torch_versions.folding_composite(aten.dropout.default)
    # and only on a torch whose C++ fold pins sizes (before 2.14): elsewhere the capture keeps its own path
    dispatcher = type(torch_versions.symbolic_composites(aten.linear.default)) is type(enable_python_dispatcher())
    assert dispatcher == torch_versions._cpp_matmul_pins_sizes()
    assert torch_versions._cpp_matmul_pins_sizes() == (tuple(map(int, torch.__version__.split(".")[:2])) < (2, 14))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_sweep_over_a_linear_without_bias_on_tokens_keeps_its_sizes(device):
    # torch 2.11's C++ matmul fold pinned both sizes to the example's (formula 1024, holds 'batch = 2, seq = 16')
    model = torch.nn.Linear(8, 4, bias=False).to(device)
    swept = sweep(model, torch.zeros(2, 16, 8, device=device), dims={"batch": 0, "seq": 1})
    assert str(swept.formula()) == "32*batch*seq"
    assert swept.holds_for == "batch >= 1, seq >= 2"
    assert swept.at(batch=3, seq=7).total_macs == 3 * 7 * 8 * 4 == \
        fxflops.estimate(model, torch.zeros(3, 7, 8, device=device)).total_macs


def test_a_sweep_over_a_matmul_of_a_3d_input_keeps_its_sizes():
    class Project(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8, 4))

        def forward(self, x):
            return x @ self.weight

    swept = sweep(Project(), torch.zeros(2, 16, 8), dims={"batch": 0, "seq": 1})
    assert str(swept.formula()) == "32*batch*seq"
    assert swept.holds_for == "batch >= 1, seq >= 2"


@pytest.mark.parametrize("message", [
    "Expected mat_a to be BFloat16 or supported Float16 matrix, got torch.float32.",  # torch 2.14's _grouped_mm
    "Expected inputs of BF16 type but got mat_a.dtype=torch.float32 and mat_b.dtype=torch.float32."])  # 2.11's
def test_a_meta_kernel_asking_for_bfloat16_in_either_wording_is_shaped_in_bfloat16(message):
    from fxflops.capture.eager import run_relaxing_dtype

    def kernel(a, b):  # a meta kernel stricter than the CPU one, as aten._grouped_mm's
        if a.dtype != torch.bfloat16:
            raise RuntimeError(message)
        return torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device="meta")

    out = run_relaxing_dtype(kernel, (torch.empty(4, 8, device="meta"), torch.empty(8, 3, device="meta")), {})
    assert (out.shape, out.dtype) == ((4, 3), torch.float32)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_relaxing_dtype(lambda a: (_ for _ in ()).throw(RuntimeError("shape mismatch")),
                           (torch.empty(2, device="meta"),), {})


def test_in_place_ops_are_pointwise_as_their_out_of_place_overloads():
    # torch 2.11 leaves hardtanh_ and elu_ without the pointwise tag their out-of-place overloads carry
    for op in (aten.hardtanh_.default, aten.elu_.default, aten.relu_.default, aten.add_.Tensor, aten.mul_.Scalar):
        assert torch_versions.is_pointwise(op), op
    for op in (aten.index_put_.default, aten.copy_.default, aten.mm.default, aten.view.default):
        assert not torch_versions.is_pointwise(op), op


class _GroupedAttention(torch.nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.q, self.kv, self.dropout = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), dropout

    def forward(self, x):
        batch, seq, _ = x.shape
        q = self.q(x).view(batch, seq, 4, 4).transpose(1, 2)
        k, v = self.kv(x).view(batch, seq, 2, 8).transpose(1, 2).chunk(2, dim=-1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                                dropout_p=self.dropout)


def test_a_sweep_over_grouped_attention_in_the_math_kernel_keeps_its_sizes():
    # torch 2.11's C++ math kernel pinned batch and seq under a backward (a meter made a capture per shape)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _GroupedAttention()
    with sdpa_kernel(SDPBackend.MATH):
        swept = sweep(model, torch.zeros(2, 8, 16), dims={"batch": 0, "seq": 1}, backward=True)
        fresh = fxflops.estimate(model, torch.zeros(3, 5, 16), backward=True)
    at = swept.at(batch=3, seq=5)
    assert len(swept.pieces) == 1  # the capture at (2, 8) serves (3, 5): its sizes stayed named
    assert (at.fwd_macs, at.bwd_macs) == (fresh.fwd_macs, fresh.bwd_macs)
    # q k^T and probs v: 4 heads x seq² x 4 each, the two projections 16 x 16 a token
    assert at.fwd_macs == 3 * (2 * 4 * 5 * 5 * 4 + 2 * 5 * 16 * 16)


def test_attention_with_dropout_keeps_its_own_kernel():
    args = (torch.empty(1), torch.empty(1), torch.empty(1))
    sdpa = aten.scaled_dot_product_attention.default
    assert torch_versions.folding_composite(sdpa, args, {})
    assert not torch_versions.folding_composite(sdpa, args, {"dropout_p": 0.1})
    assert not torch_versions.folding_composite(sdpa, (*args, None, 0.1), {})


class _OlderStage:
    """A pipeline stage as torch 2.11 makes it: a table of group ranks, no _resolve_peer_global_rank."""

    def __init__(self, group) -> None:
        self.group, self.stage_index_to_group_rank = group, {0: 1, 1: 0}


def test_a_pipeline_peer_from_a_stage_without_resolve_peer_global_rank():
    assert torch_versions.stage_peer_global_rank(_OlderStage(None), 0) == 1
    assert torch_versions.stage_peer_global_rank(_OlderStage(None), 1) == 0

    class Newer(_OlderStage):
        def _resolve_peer_global_rank(self, index: int) -> int:
            return 10 + index

    assert torch_versions.stage_peer_global_rank(Newer(None), 1) == 11


def test_pipeline_input_metadata_from_a_stage_with_meta_tensors_only():
    older = _OlderStage(None)
    older.inputs_meta = (torch.empty(2, 3, 4, device="meta").transpose(1, 2).requires_grad_(), None)
    first, second = torch_versions.stage_input_metas(older)
    assert (first.shape, first.stride, first.dtype, first.requires_grad) == ((2, 4, 3), (12, 1, 4), torch.float32, True)
    assert second is None
    older.inputs_meta = None
    assert torch_versions.stage_input_metas(older) is None


def test_an_error_that_is_no_device_mismatch_passes_through_the_capture_unchanged() -> None:
    # _through_mode now catches every RuntimeError to read older torch's mismatch message: any other one, and a
    # mismatch with no meta tensor to lift, must leave as the very object raised, its type and traceback kept
    from fxflops.capture.eager import FakeTwins

    def raising(error: Exception):
        def op(*args, **kwargs):
            raise error
        return op

    for error in (RuntimeError("shapes cannot be multiplied"),
                  RuntimeError("Unhandled FakeTensor Device Propagation for aten.mm.default")):
        with pytest.raises(RuntimeError) as caught:
            FakeTwins._through_mode(None, raising(error), (torch.zeros(2),), {})
        assert caught.value is error
