"""capture.symbolic_layers' layer norm and addmm against the fake mode's own (torch's Python reference and
decomposition) on the same symbolic inputs: the same outputs (shapes, strides, dtypes) and guards, over ranks,
normalized shapes, dtypes, weights and biases, layouts; the cases they leave to the mode; and a GPT-2 sweep
(its Conv1D is an addmm) equal to estimate() node by node."""

from __future__ import annotations

import pytest
import torch

import fxflops
from fxflops.results import ZERO
from fxflops.sweeps import sweep
from tests.test_symbolic_kernels import _cat_run

LAYER_NORM = torch.ops.aten.native_layer_norm.default
ADDMM = torch.ops.aten.addmm.default


def _run(kernel, build, outputs=3):
    """[(each output's shape, strides, dtype and constant; the guards)] of `kernel(*build(b, s))` under a sweep's
    shape env, sizes b=2, s=7 symbolic (test_symbolic_kernels' run, once per output); None where it gives
    NotImplemented."""
    if outputs == 1:
        return _cat_run(kernel, build)
    found = [_cat_run(lambda *args, index=index: _output(kernel(*args), index), build) for index in range(outputs)]
    return None if None in found else found


def _output(out, index):
    return out if out is NotImplemented else out[index]


def _norm(shape, normalized, dtype=torch.float32, weight=True, bias=True, parameter_dtype=None):
    def build(b, s):
        sizes = [{"b": b, "s": s}.get(size, size) for size in shape]
        made = (torch.empty(normalized, dtype=parameter_dtype or dtype) for _ in range(2))
        w, c = next(made), next(made)
        return torch.empty(sizes, dtype=dtype), list(normalized), w if weight else None, c if bias else None, 1e-5
    return build


CASES = {
    "a transformer's [b, s, 16]": _norm(("b", "s", 16), (16,)),
    "2-d [b, 16]": _norm(("b", 16), (16,)),
    "[b * s, 16]": lambda b, s: (torch.empty(b * s, 16), [16], torch.empty(16), torch.empty(16), 1e-5),
    "[s, 3, 8]": _norm(("s", 3, 8), (8,)),
    "a batch of 1: [1, s, 16]": _norm((1, "s", 16), (16,)),
    "[b, 1, 8]": _norm(("b", 1, 8), (8,)),
    "[1, s, 1]": _norm((1, "s", 1), (1,)),
    "float64": _norm(("b", "s", 16), (16,), torch.float64),
    "no weight": _norm(("b", "s", 16), (16,), weight=False),
    "no bias": _norm(("b", "s", 16), (16,), bias=False),
    "neither": _norm(("b", "s", 16), (16,), weight=False, bias=False),
}

# each of these asks the mode about the sizes (a guard), is an error there or has no named size: the kernel
# leaves them to the mode
REFUSED = {
    "two normalized axes": _norm(("b", "s", 4, 6), (4, 6)),
    "4-d": _norm(("b", "s", 3, 8), (8,)),
    "bfloat16": _norm(("b", "s", 16), (16,), torch.bfloat16),
    "float32 input, float64 weight": _norm(("b", "s", 16), (16,), parameter_dtype=torch.float64),
    "a symbolic normalized size": lambda b, s: (torch.empty(b, s), [7], None, None, 1e-5),
    "a transposed input": lambda b, s: (torch.empty(b, 16, s).transpose(1, 2), [16], None, None, 1e-5),
    "a weight of another shape": lambda b, s: (torch.empty(b, s, 16), [16], torch.empty(8), None, 1e-5),
    "static sizes": lambda b, s: (torch.empty(2, 7, 16), [16], None, None, 1e-5),
}


@pytest.mark.parametrize("case", CASES)
def test_the_symbolic_layer_norm_gives_what_the_mode_gives(case):
    from fxflops.capture.symbolic_kernels import symbolic_kernel

    direct = _run(lambda *args: symbolic_kernel(LAYER_NORM, args, {}), CASES[case])
    assert direct is not None
    assert direct == _run(LAYER_NORM, CASES[case])


@pytest.mark.parametrize("case", REFUSED)
def test_a_layer_norm_the_kernel_cannot_shape_without_a_question_goes_through_the_mode(case):
    from fxflops.capture.symbolic_kernels import symbolic_kernel

    assert _run(lambda *args: symbolic_kernel(LAYER_NORM, args, {}), REFUSED[case]) is None


def _addmm(rows, dtype=torch.float32, transposed=False, bias=(8,)):
    def build(b, s):
        size = {"b": b, "s": s, "b*s": b * s}[rows]
        source = torch.empty(16, size, dtype=dtype).t() if transposed else torch.empty(size, 16, dtype=dtype)
        return torch.empty(bias, dtype=dtype), source, torch.empty(16, 8, dtype=dtype)
    return build


ADDMM_CASES = {
    "[b * s, 16] (a transformer's tokens)": _addmm("b*s"),
    "[b, 16] (a classifier's head)": _addmm("b"),
    "[s, 16], float64": _addmm("s", torch.float64),
    "a transposed input": _addmm("b*s", transposed=True),
}

ADDMM_REFUSED = {
    "bfloat16": _addmm("b*s", torch.bfloat16),
    "a [1, 8] bias": _addmm("b", bias=(1, 8)),
    "a symbolic inner size": lambda b, s: (torch.empty(8), torch.empty(b, s), torch.empty(7, 8)),
    "static sizes": lambda b, s: (torch.empty(8), torch.empty(3, 16), torch.empty(16, 8)),
}


@pytest.mark.parametrize("case", ADDMM_CASES)
def test_the_symbolic_addmm_gives_what_the_mode_gives(case):
    from fxflops.capture.symbolic_kernels import symbolic_kernel

    direct = _run(lambda *args: symbolic_kernel(ADDMM, args, {}), ADDMM_CASES[case], outputs=1)
    assert direct is not None
    assert direct == _run(ADDMM, ADDMM_CASES[case], outputs=1)


@pytest.mark.parametrize("case", ADDMM_REFUSED)
def test_an_addmm_the_kernel_does_not_shape_goes_through_the_mode(case):
    from fxflops.capture.symbolic_kernels import symbolic_kernel

    assert _run(lambda *args: symbolic_kernel(ADDMM, args, {}), ADDMM_REFUSED[case], outputs=1) is None
    assert _run(lambda *args: symbolic_kernel(ADDMM, args, {"beta": 2}), ADDMM_CASES["[b, 16] (a classifier's head)"],
                outputs=1) is None


def test_a_gpt2_sweep_counts_every_point_as_estimate_does():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=64)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config).eval()
    ids = lambda batch, seq: torch.zeros(batch, seq, dtype=torch.long, device="meta")  # noqa: E731
    swept = sweep(model, ids(2, 9), dims={"batch": 0, "seq": 1})
    for batch, seq in [(2, 9), (1, 5), (3, 17), (2, 2), (1, 64)]:
        at, fresh = swept.at(batch=batch, seq=seq), fxflops.estimate(model, ids(batch, seq))
        assert (at.total_macs, at.total_flops, at.total_params, at.total_bytes) == \
            (fresh.total_macs, fresh.total_flops, fresh.total_params, fresh.total_bytes)
        # node by node, but for the head's zero-cost view of `hidden_states[:, slice(-0, None), :]`, which
        # torch indexes as an alias at fixed sizes and as a slice at named ones
        assert [_node(n) for n in at.nodes if not _head_view(n)] == \
            [_node(n) for n in fresh.nodes if not _head_view(n)]
        # two layer norms a layer and the final one, each over batch x seq x 32 (GPT2Config's n_embd)
        norms = [n for n in at.nodes if n.op == "aten.native_layer_norm.default"]
        assert len(norms) == 5 and all(n.output_shapes[0] == (batch, seq, 32) for n in norms)


def _head_view(node):
    return node.module == "" and node.op in ("aten.slice.Tensor", "aten.alias.default") and node.status == ZERO


def _node(node):
    return node.op, node.module, node.macs, node.flops, node.bytes, node.input_shapes, node.output_shapes
