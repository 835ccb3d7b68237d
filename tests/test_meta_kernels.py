"""The short route past FakeTensorMode's dispatch (fxflops/capture/meta_kernels.py): every op it takes
must come out as the mode's own dispatch makes it (shape, strides, offset, dtype, device, aliasing,
errors), op by op over a grid and node by node over whole models."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fxflops.capture.meta_kernels as meta_kernels
from fxflops.api import Counting
from fxflops.capture.meta_kernels import MetaKernels

aten = torch.ops.aten


def _metadata(value: Any, inputs: list[torch.Tensor]) -> Any:
    """What the count and later ops can see of an op's output; which input each output aliases."""
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()._cdata
        alias = [index for index, tensor in enumerate(inputs) if tensor.untyped_storage()._cdata == storage]
        same = [index for index, tensor in enumerate(inputs) if tensor is value]
        return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.device,
                value.requires_grad, type(value).__name__, alias, same)
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [_metadata(item, inputs) for item in value]
    return value


def _both_routes(mode: FakeTensorMode, func: Any, args: tuple, kwargs: dict | None = None) -> tuple[Any, Any, bool]:
    """(the mode's result, the short route's, whether the short route was taken); an error as its type."""
    kwargs = kwargs or {}
    inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    inputs += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
    try:
        with mode:
            through_mode = _metadata(func(*args, **kwargs), inputs)
    except Exception as error:  # noqa: BLE001 - an error must be an error both ways
        through_mode = type(error).__name__
    short = MetaKernels(mode)
    try:
        out = short(func, args, kwargs)
        taken = out is not NotImplemented
        shortcut = _metadata(out, inputs) if taken else through_mode
    except Exception as error:  # noqa: BLE001
        taken, shortcut = True, type(error).__name__
    return through_mode, shortcut, taken


def _layouts(mode: FakeTensorMode, shape: list[int], dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """One tensor of `shape` per layout: contiguous; stored reversed, channels last, last two axes
    swapped; a strided slice of the last axis."""
    axes = list(range(len(shape)))
    orders = {tuple(axes[::-1]), tuple([0, *axes[2:], 1][:len(shape)]), tuple([*axes[:-2], *axes[-2:][::-1]])}
    with mode:
        yield torch.empty(shape, dtype=dtype, device=device)
        for order in sorted(orders - {tuple(axes)}):
            stored = torch.empty([shape[axis] for axis in order], dtype=dtype, device=device)
            yield stored.permute([order.index(axis) for axis in axes])
        if shape:
            yield torch.empty([*shape[:-1], 2 * shape[-1]], dtype=dtype, device=device)[..., ::2]


SHAPES = [[3], [1, 4], [2, 3], [2, 1, 3], [2, 3, 4], [1, 3, 1, 2], [2, 3, 2, 2]]


def _grid(mode: FakeTensorMode, calls) -> tuple[set[str], list]:
    """Run every (func, args) both ways; (the ops the short route took at least once, differences)."""
    differences, taken_by = [], set()
    for func, args in calls:
        through_mode, shortcut, taken = _both_routes(mode, func, args)
        if taken:
            taken_by.add(str(func))
        if through_mode != shortcut:
            shapes = [tuple(a.shape) + (a.stride(),) if isinstance(a, torch.Tensor) else a for a in args]
            differences.append((str(func), shapes, through_mode, shortcut))
    return taken_by, differences


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # a fake CUDA device needs no GPU
def test_pointwise_ops_come_out_as_the_mode_makes_them(device):
    mode = FakeTensorMode()

    def calls():
        for shape in SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                for x in _layouts(mode, shape, dtype, device):
                    with mode:
                        row = torch.empty(shape[-1:], dtype=torch.float32, device=device)
                        same = torch.empty(shape, dtype=dtype, device=device)
                        ints = torch.empty(shape, dtype=torch.int64, device=device)
                        flags = torch.empty(shape, dtype=torch.bool, device=device)
                    for func in (aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor,
                                 aten.add_.Tensor, aten.mul_.Tensor):
                        for other in (row, same, ints, x.t() if x.dim() == 2 and x.shape[0] == x.shape[1] else same):
                            yield func, (x, other)
                            yield func, (other, x)
                    for func in (aten.relu_.default, aten.silu_.default, aten.sigmoid.default, aten.tanh.default,
                                 aten.gelu.default, aten.neg.default, aten.rsqrt.default, aten.silu.default):
                        yield func, (x,)
                    yield aten.hardtanh_.default, (x, 0.0, 6.0)
                    yield aten.pow.Tensor_Scalar, (x, 2)
                    yield aten.masked_fill.Scalar, (x, flags, 0.0)
                    yield aten.where.self, (flags, x, row)
                    yield aten.clamp.default, (x, 0.0, None)
                    yield aten.add.Tensor, (ints, x)
                    yield aten.add_.Tensor, (ints, x)  # a float result cannot be written into int64: an error

    taken, differences = _grid(mode, calls())
    assert differences == []
    # the route really is taken (the speed depends on it)
    assert {"aten.add.Tensor", "aten.add_.Tensor", "aten.relu_.default", "aten.hardtanh_.default",
            "aten.gelu.default", "aten.where.self"} <= taken


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_shape_ops_matmuls_and_norms_come_out_as_the_mode_makes_them(device):
    mode = FakeTensorMode()

    def calls():
        for shape in SHAPES:
            for x in _layouts(mode, shape, device=device):
                numel = x.numel()
                for target in ([-1], [numel], [1, numel], [numel, 1], [-1, shape[-1]]):
                    yield aten.view.default, (x, target)
                    yield aten._unsafe_view.default, (x, target)
                for axis in range(x.dim()):
                    yield aten.split.Tensor, (x, 1, axis)
                    yield aten.split.Tensor, (x, 2, axis)
                    yield aten.transpose.int, (x, 0, axis)
                    yield aten.unsqueeze.default, (x, axis)
                    yield aten.select.int, (x, axis, 0)
                    yield aten.slice.Tensor, (x, axis, 0, 1)
                    yield aten.cat.default, ([x, x], axis)
                    yield aten.mean.dim, (x, [axis], True)
                    yield aten._softmax.default, (x, axis, False)
                for dtype in (torch.float32, torch.bfloat16):
                    with mode:
                        y, weight = x.to(dtype), torch.empty(shape[-1], dtype=dtype, device=device)
                    yield aten.native_layer_norm.default, (y, shape[-1:], weight, weight, 1e-5)
                    yield aten.native_layer_norm.default, (y, shape[-1:], None, None, 1e-5)
                if x.dim() == 2:
                    for columns in (1, 3):
                        for right in _layouts(mode, [shape[1], columns], device=device):
                            yield aten.mm.default, (x, right)
                            for bias_shape in ([columns], [shape[0], columns], [1, columns], [shape[0], 1]):
                                for bias in _layouts(mode, bias_shape, device=device):
                                    yield aten.addmm.default, (bias, x, right)
        with mode:
            table, ids = torch.empty(10, 4, device=device), torch.zeros(2, 3, dtype=torch.long, device=device)
        yield aten.embedding.default, (table, ids)

    taken, differences = _grid(mode, calls())
    assert differences == []
    assert {"aten.view.default", "aten.split.Tensor", "aten.transpose.int", "aten.cat.default",
            "aten.native_layer_norm.default", "aten.addmm.default", "aten.mm.default",
            "aten.embedding.default"} <= taken


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("training", [False, True])
def test_batch_norm_and_convolution_come_out_as_the_mode_makes_them(device, training):
    """native_batch_norm: the mode decomposes it (CPU: statistics in the input's dtype, empty in eval),
    the route runs the meta kernel and remakes the statistics; convolution keeps the mode's rule
    (which picks the memory format the CPU or CUDA kernel would)."""
    mode = FakeTensorMode()

    def calls():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for shape in ([3, 4, 5, 6], [1, 4, 1, 1], [1, 4, 5, 1], [2, 4, 3], [2, 4, 2, 2, 2]):
                formats = [torch.contiguous_format] + [torch.channels_last] * (len(shape) == 4)
                for memory_format in formats:
                    with mode:
                        x = torch.empty(shape, dtype=dtype, device=device).to(memory_format=memory_format)
                        stats = torch.empty(4, device=device)
                    for weight in (stats, None):
                        yield aten.native_batch_norm.default, (x, weight, weight, stats, stats, training, 0.1, 1e-5)
                    if len(shape) == 4:
                        with mode:
                            kernel = torch.empty(8, 4, 3, 3, dtype=dtype, device=device)
                            depthwise = torch.empty(4, 1, 3, 3, dtype=dtype, device=device)
                        yield aten.convolution.default, (x, kernel, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
                        yield aten.convolution.default, (x, depthwise, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 4)

    taken, differences = _grid(mode, calls())
    # the mode's decomposition divides by zero where a training batch norm sees one value a channel
    assert [d for d in differences if d[2] != "ZeroDivisionError"] == []
    assert {"aten.native_batch_norm.default", "aten.convolution.default"} <= taken


@pytest.mark.parametrize("training", [False, True])
def test_a_cpu_batch_norm_is_shaped_as_the_mode_decomposes_it_in_every_layout(training):
    """The CPU batch norm made without a kernel (contiguous or channels-last inputs) against the mode's
    decomposition: every axis order of every shape of sizes 1-3 in 2-4 axes, the canonical orders in 5."""
    mode = FakeTensorMode()

    def calls():
        for axes in (2, 3, 4, 5):
            for shape in itertools.product([1, 2, 3], repeat=axes - 1):
                shape = [shape[0], 4, *shape[1:]]
                orders = itertools.permutations(range(axes)) if axes < 5 else \
                    [(0, 1, 2, 3, 4), (0, 2, 3, 4, 1), (4, 3, 2, 1, 0), (1, 0, 2, 3, 4)]
                for order in orders:
                    canonical = order in ((0, 1, 2, 3, 4)[:axes], (0, 2, 3, 1))
                    for dtype in (torch.float32, torch.bfloat16) if canonical else (torch.float32,):
                        with mode:
                            stored = torch.empty([shape[axis] for axis in order], dtype=dtype)
                            x = stored.permute([order.index(axis) for axis in range(axes)])
                            stats = torch.empty(4)
                        yield aten.native_batch_norm.default, (x, stats, stats, stats, stats, training, 0.1, 1e-5)
                        if canonical:
                            yield aten.native_batch_norm.default, (x, None, None, stats, stats, training, 0.1, 1e-5)
        with mode:
            x, wrong = torch.empty(2, 4, 3, 3), torch.empty(3)
        yield aten.native_batch_norm.default, (x, wrong, None, torch.empty(4), torch.empty(4), training, 0.1, 1e-5)
        yield aten.native_batch_norm.default, (x, None, None, None, None, training, 0.1, 1e-5)

    taken, differences = _grid(mode, calls())
    assert [d for d in differences if d[2] != "ZeroDivisionError"] == []
    assert "aten.native_batch_norm.default" in taken


def test_an_in_place_op_already_run_on_its_dtype_leaves_its_tensor_as_the_mode_does():
    """After one call has run, an in-place pointwise op on a dense tensor of the same dtype and
    arguments returns the tensor without a kernel; any other call still runs one, so what the kernel
    refuses (an overlapping tensor, another dtype, a negative in-place ELU slope) still fails."""
    mode = FakeTensorMode()
    short = MetaKernels(mode)
    with mode:
        first, second = torch.empty(2, 3, 4), torch.empty(5, 6).t()
        wide = torch.empty(1, 3).expand(4, 3)  # four rows stored once: in place, an error
        flags, ints = torch.empty(2, 3, dtype=torch.bool), torch.empty(2, 3, dtype=torch.int64)
    assert short(aten.hardtanh_.default, (first, 0.0, 6.0), {}) is first
    assert short._accepted  # the next call of its kind needs no kernel
    assert short(aten.hardtanh_.default, (second, 0.0, 6.0), {}) is second
    for func, args in ((aten.hardtanh_.default, (wide, 0.0, 6.0)), (aten.relu_.default, (flags,)),
                       (aten.hardtanh_.default, (flags, 0.0, 6.0)), (aten.sigmoid_.default, (ints,)),
                       (aten.elu_.default, (first, 1.0)), (aten.elu_.default, (second.t(), -1.0)),
                       (aten.elu_.default, (first, -1.0))):
        through_mode, shortcut, _ = _both_routes(mode, func, args)
        assert through_mode == shortcut, func


def test_a_call_equal_to_an_earlier_one_comes_from_the_cache_as_the_mode_makes_it():
    """The route's cache (the mode's key, checks and rebuilt outputs): a repeated call runs no kernel and
    gives what the mode's dispatch gives, new tensors for new outputs, the argument for an in-place op;
    a call differing in any metadata (strides, offset, dtype, a plain argument's type or value) runs its kernel."""
    mode = FakeTensorMode()
    short = MetaKernels(mode)
    ran: list[Any] = []
    dispatch_end = short._dispatch_end
    short._dispatch_end = lambda func, *rest: ran.append(func) or dispatch_end(func, *rest)
    with mode:
        x, y = torch.empty(2, 3, 4), torch.empty(2, 3, 4)
        sliced = torch.empty(2, 3, 8)[..., ::2]
        offset = torch.empty(30)[6:].view(2, 3, 4)
        half = torch.empty(2, 3, 4, dtype=torch.bfloat16)
        rows, flags = torch.empty(4), torch.empty(2, 3, 4, dtype=torch.bool)
        index = torch.empty(5, dtype=torch.int64)
    calls = [(aten.add.Tensor, (x, y)), (aten.add.Tensor, (x, sliced)), (aten.add.Tensor, (sliced, x)),
             (aten.add.Tensor, (offset, x)), (aten.add.Tensor, (x, half)), (aten.add.Tensor, (x, rows)),
             (aten.mul.Tensor, (x, 2)), (aten.mul.Tensor, (x, 2.0)), (aten.mul.Tensor, (half, 2.0)),
             (aten.mul.Tensor, (half, 0.5)), (aten.pow.Tensor_Scalar, (x, 2)),
             (aten.where.self, (flags, x, rows)), (aten.mean.dim, (x, [1], True)), (aten.mean.dim, (x, [1])),
             (aten.index_select.default, (x, 1, index)), (aten.cat.default, ([x, y], 1)),
             (aten.cat.default, ([x, half], 1)), (aten.native_layer_norm.default, (x, [4], rows, rows, 1e-5)),
             (aten.addcmul_.default, (x, y, y)), (aten.index_put_.default, (x, [index], y[0, 0, 0]))]
    for round_ in range(3):  # (a call's first shapes run the kernel; the next call of its shapes makes the entry)
        if round_ == 2:
            ran.clear()
        for func, args in calls:
            through_mode, shortcut, taken = _both_routes(mode, func, args)
            assert taken and through_mode == shortcut, (func, round_)
            first = short(func, args, {})
            again = short(func, args, {})
            inputs = [t for t in args if isinstance(t, torch.Tensor)]
            assert _metadata(again, inputs) == _metadata(first, inputs) == through_mode, (func, round_)
            if isinstance(first, torch.Tensor) and first is not args[0]:
                assert again is not first  # a new tensor, as a new dispatch makes
    assert ran == []  # every call of the last round came from the cache, each as the mode makes it
    assert short._cache
    mode.cache_enabled = False  # the mode's own caching off: the route keeps none either
    uncached = MetaKernels(mode)
    assert not uncached._caching


def test_ops_the_mode_must_shape_itself_do_not_take_the_route():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode()
    short = MetaKernels(mode)
    with mode:
        x, y = torch.empty(2, 3), torch.empty(2, 3, device="cuda")
        constant = torch.tensor(2.0)  # the mode keeps its value (so .item() works)
    assert constant.constant is not None
    assert short(aten.add.Tensor, (x, constant), {}) is NotImplemented
    assert short(aten.add.Tensor, (x, torch.ones(3)), {}) is NotImplemented  # a real tensor: the mode converts it
    assert short(aten.add.Tensor, (x, y), {}) is NotImplemented  # mixed devices: the mode's error
    assert short(aten.nonzero.default, (x,), {}) is NotImplemented  # an output shape from values
    assert short(aten.empty.memory_format, ([2, 3],), {}) is NotImplemented  # no tensor in
    assert short(aten.add.Tensor, (x, x), {}) is not NotImplemented
    symbolic = FakeTensorMode(shape_env=ShapeEnv())
    named = symbolic.from_tensor(torch.empty(4, 3))
    assert named._has_symbolic_sizes_strides
    assert MetaKernels(symbolic)(aten.add.Tensor, (named, named), {}) is NotImplemented  # C++ would pin them


def _node_values(model: nn.Module, args: tuple, kwargs: dict | None = None, backward: bool = False) -> list:
    counting = Counting.prepare("deepspeed", None, None, "dense")
    captured = counting.capture(model, args, kwargs or {}, "eager", backward=backward)
    values = []
    for node in captured.graph_module.graph.nodes:
        leaves = torch.utils._pytree.tree_leaves(node.meta.get("val"))
        values.append((node.op, str(node.target), [(tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device)
                                                   if isinstance(v, torch.Tensor) else v for v in leaves]))
    rows = [(c.name, c.macs, c.flops, c.bytes, c.input_shapes, c.output_shapes) for c in counting.count(captured)]
    return values + rows


def _same_with_and_without_the_route(monkeypatch, model: nn.Module, args: tuple, kwargs: dict | None = None,
                                     backward: bool = False) -> None:
    with_route = _node_values(model, args, kwargs, backward)
    monkeypatch.setattr(meta_kernels, "_fake_internals", lambda: None)
    assert with_route == _node_values(model, args, kwargs, backward)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("train", [False, True])
def test_a_convnet_captures_node_by_node_as_through_the_mode(monkeypatch, channels_last, train):
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        model = torchvision.models.mobilenet_v3_small(num_classes=10).train(train)
    x = torch.empty(2, 3, 64, 64, device="meta")
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    _same_with_and_without_the_route(monkeypatch, model, (x,), backward=train)


def test_a_transformer_captures_node_by_node_as_through_the_mode(monkeypatch):
    tf = pytest.importorskip("transformers")
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32)
    with torch.device("meta"):
        model = tf.GPT2LMHeadModel(config).eval()
    _same_with_and_without_the_route(monkeypatch, model, (), {"input_ids": torch.zeros(1, 12, dtype=torch.long)})
    config = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=64)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config).to(torch.bfloat16)
    _same_with_and_without_the_route(monkeypatch, model, (), {"input_ids": torch.zeros(2, 12, dtype=torch.long)},
                                     backward=True)


def test_an_op_that_fails_fails_in_the_modes_words(monkeypatch):
    """A kernel's refusal on the short route hands the op back to the mode, whose error is the one raised."""

    class WrongNorm(nn.Module):
        def forward(self, x):
            return nn.functional.layer_norm(x, (5,)) + x.transpose(0, 1)

    def failure() -> str:
        with pytest.raises(Exception) as caught:
            Counting.prepare("deepspeed", None, None, "dense").capture(WrongNorm(), (torch.empty(2, 3, 4),), {}, "eager")
        return f"{type(caught.value).__name__}: {caught.value}"

    with_route = failure()
    monkeypatch.setattr(meta_kernels, "_fake_internals", lambda: None)
    assert with_route == failure()
    assert "normalized_shape" in with_route


def test_ops_dispatched_inside_a_function_mode_keep_the_mode():
    """vmap's exit runs unsqueeze/expand from C++ while a torch-function mode is active (transformers'
    mask functions do this): the route must not run Python those modes would see (Tensor.dim calls
    recorded as nodes, found by benchmarks/meta_route_architectures.py on t5gemma2)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    def seen(route_on: bool) -> list[str]:
        fake = FakeTensorMode()
        short = MetaKernels(fake)
        names: list[str] = []

        class Route(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = short(func, args, kwargs or {}) if route_on else NotImplemented
                return func(*args, **(kwargs or {})) if out is NotImplemented else out

        class Log(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                names.append(getattr(func, "__name__", str(func)))
                return func(*args, **(kwargs or {}))

        with fake:
            x, y = torch.empty(2, 3), torch.empty(3)
        with fake, Route(), Log():
            torch.vmap(lambda a, b: b + 1, in_dims=(0, None))(x, y)
        return names

    assert seen(True) == seen(False)


def test_metadata_queries_are_answered_as_the_mode_answers_them():
    """prim.device (asked by the dispatcher inside many ops) and aten.size/stride: the mode's first
    step answers them from the fake tensor; the route gives the same answer, meta inside a kernel."""
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    fake = FakeTensorMode()
    short = MetaKernels(fake)
    for device in ("cpu", "cuda"):
        with fake:
            x = torch.empty(2, 3, device=device)[:, 1:]
        for func in (torch.ops.prim.device.default, aten.size.default, aten.stride.default,
                     aten.storage_offset.default):
            with fake:
                expected = func(x)
            answer = short(func, (x,), {})  # (a tuple for int[]: the dispatcher hands the caller a list)
            assert (list(answer) if isinstance(answer, tuple) else answer) == expected, (func, device)
        assert short(torch.ops.prim.device.default, (x,), {}) == x.device
        with in_kernel_invocation_manager(fake):
            assert short(torch.ops.prim.device.default, (x,), {}) == torch.device("meta")
