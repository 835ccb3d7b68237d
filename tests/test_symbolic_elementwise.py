"""capture.symbolic_elementwise against the fake mode on the same symbolic inputs: the same output (shape,
strides, offset, dtype, device) and the same ShapeEnv state (guards in order, runtime asserts, replacements,
ranges) at points where a named size is 1 too; the cases it leaves to the mode are refused (NotImplemented)
before anything is asked; and an RMSNorm decoder's sweep equal to the capture without the kernels and to
estimate() at every point."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.test_symbolic_kernels import _layout_run, sweep_as_without_the_kernels

aten = torch.ops.aten
ADD, SUB, MUL, DIV = aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor
NEG, RSQRT, POW, MEAN = aten.neg.default, aten.rsqrt.default, aten.pow.Tensor_Scalar, aten.mean.dim

# (op, inputs from symbolic batch b and seq s): what an RMSNorm, a residual stream and a scaled table make
TAKEN = {
    "residual add": (ADD, lambda b, s: (torch.empty(b, s, 8), torch.empty(b, s, 8))),
    "scale by the statistics": (MUL, lambda b, s: (torch.empty(b, s, 8), torch.empty(b, s, 1))),
    "weight times hidden": (MUL, lambda b, s: (torch.empty(8), torch.empty(b, s, 8))),
    "plus eps": (ADD, lambda b, s: (torch.empty(b, s, 1), 1e-6)),
    "sub of a row": (SUB, lambda b, s: (torch.empty(b, s, 8), torch.empty(1, s, 8))),
    "batch-1 table times states": (MUL, lambda b, s: (torch.empty(b, s, 8), torch.empty(1, s, 8))),
    "div": (DIV, lambda b, s: (torch.empty(b, s, 8), torch.empty(b, s, 1))),
    "div of ints": (DIV, lambda b, s: (torch.empty(b, s, dtype=torch.long), torch.empty(b, s, dtype=torch.long))),
    "int times a float": (MUL, lambda b, s: (torch.empty(b, s, dtype=torch.long), 0.5)),
    "int plus an int": (ADD, lambda b, s: (torch.empty(s, dtype=torch.long), 0)),
    "mixed dtypes": (MUL, lambda b, s: (torch.empty(b, s, 8, dtype=torch.float64), torch.empty(b, s, 1))),
    "half times float": (MUL, lambda b, s: (torch.empty(b, s, 8, dtype=torch.float16), torch.empty(8))),
    "bool operand": (MUL, lambda b, s: (torch.empty(b, s, 8), torch.empty(b, s, 8, dtype=torch.bool))),
    "1-d": (ADD, lambda b, s: (torch.empty(s), torch.empty(s))),
    "a size-1 axis of the input": (MUL, lambda b, s: (torch.empty(b, 1, s), torch.empty(b, 1, s))),
    "a contiguous slice": (ADD, lambda b, s: (torch.empty(b + 1, s, 8)[1:], torch.empty(b, s, 8))),
    "6-d": (ADD, lambda b, s: (torch.empty(b, s, 1, 2, 1, 3), torch.empty(3))),
    "neg": (NEG, lambda b, s: (torch.empty(b, s, 8),)),
    "rsqrt": (RSQRT, lambda b, s: (torch.empty(b, s, 1),)),
    "rsqrt in double": (RSQRT, lambda b, s: (torch.empty(b, s, 1, dtype=torch.float64),)),
    "pow 2": (POW, lambda b, s: (torch.empty(b, s, 8), 2)),
    "mean, kept": (MEAN, lambda b, s: (torch.empty(b, s, 8), [-1], True)),
    "mean, dropped": (MEAN, lambda b, s: (torch.empty(b, s, 8), [2])),
    "mean, 2-d": (MEAN, lambda b, s: (torch.empty(s, 8), [-1], True)),
    "mean of one": (MEAN, lambda b, s: (torch.empty(b, s, 1), [-1], True)),
}



def _seq_not_one(s):
    """The guard a decoder's first rotary op leaves (whether seq is 1), asked before the op."""
    bool(s != 1)
    return s


def _heads(b, s, heads=4):
    return torch.empty(b, s, heads, 8).transpose(1, 2)


# a first operand in any layout (transposed heads, a slice of them) and a second that broadcasts by static 1s:
# the mode's first such op asks whether seq is 1 (a guard: taken by the mode), the next ones know it
STRIDED = {
    "q * cos": (MUL, lambda b, s: (_heads(b, s), torch.empty(1, s, 8).unsqueeze(1))),
    "q * cos, seq known not 1": (MUL, lambda b, s: (_heads(b, _seq_not_one(s)), torch.empty(1, s, 8).unsqueeze(1))),
    "k * cos": (MUL, lambda b, s: (_heads(b, _seq_not_one(s), 2), torch.empty(1, 1, s, 8))),
    "half * sin": (MUL, lambda b, s: (_heads(b, _seq_not_one(s))[..., 4:], torch.empty(1, 1, s, 4))),
    "rotated + q * cos": (ADD, lambda b, s: (_heads(b, _seq_not_one(s)), torch.empty(b, 4, s, 8))),
    "contiguous + transposed": (ADD, lambda b, s: (torch.empty(b, 4, _seq_not_one(s), 8), _heads(b, s))),
    "sub, double": (SUB, lambda b, s: (_heads(b, _seq_not_one(s)).double(), torch.empty(b, 4, s, 8).double())),
    "sub of a table (its own reference asks whether the batch is 1)": (
        SUB, lambda b, s: (_heads(b, _seq_not_one(s)), torch.empty(1, 1, s, 8))),
    "div by a static table": (DIV, lambda b, s: (_heads(b, _seq_not_one(s)), torch.empty(1, 4, 1, 8))),
    "neg of a transposed half": (NEG, lambda b, s: (_heads(b, _seq_not_one(s))[..., 4:],)),
    "neg of transposed heads": (NEG, lambda b, s: (_heads(b, s),)),
    "neg of a 3-d transpose": (NEG, lambda b, s: (torch.empty(s, b, 8).transpose(0, 1),)),
    "3-d transposed": (MUL, lambda b, s: (torch.empty(s, b, 8).transpose(0, 1), torch.empty(b, s, 8))),
    "channels last": (MUL, lambda b, s: (torch.empty(b, 3, s, s).to(memory_format=torch.channels_last),
                                         torch.empty(1, 3, 1, 1))),
}


@pytest.mark.parametrize("hints", [(2, 7), (1, 7), (3, 1), (1, 1)])
@pytest.mark.parametrize("case", STRIDED)
def test_the_strided_elementwise_op_gives_what_the_mode_gives_or_is_the_modes(case, hints):
    op, build = STRIDED[case]
    direct, through_the_mode = (_layout_run(op, build, hints, direct=d) for d in (True, False))
    if direct[0] is None:  # the mode asks a question that is a guard there, or a named size is 1 at this point
        seeded = _layout_run(SEED, lambda b, s: (build(b, s)[0],), hints, direct=False)[1]
        assert 1 in hints or through_the_mode[1][0] != seeded[0], "refused where the mode adds no guard"
        return
    assert direct == through_the_mode


def test_the_rotary_ops_are_taken_once_seq_is_known_not_1():
    assert _layout_run(*STRIDED["sub of a table (its own reference asks whether the batch is 1)"])[0] is None
    for case in ("q * cos, seq known not 1", "k * cos", "half * sin", "neg of a transposed half", "rotated + q * cos",
                 "sub, double", "div by a static table"):
        op, build = STRIDED[case]
        assert _layout_run(op, build)[0] is not None, case


@pytest.mark.parametrize("case", [*STRIDED, *TAKEN])
def test_a_taken_op_runs_nothing_through_the_mode(case):
    """The kernels shape an op past the mode: torch's binary fast path too, whose output constructor, called with
    the mode on the stack, was an op of its own through the mode (its cache entry made and checked: a channels-last
    operand's product)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxflops.capture.symbolic_kernels import symbolic_kernel

    op, build = {**STRIDED, **TAKEN}[case]
    env = _env()

    def through_the_mode():
        info = FakeTensorMode.cache_info()
        return info.hits, info.misses, sum(info.bypasses.values())

    with FakeTensorMode(shape_env=env, static_shapes=True):
        args = build(*_sizes(env))
        before = through_the_mode()
        symbolic_kernel(op, args, {})
        assert through_the_mode() == before


SEED = aten.alias.default  # an op asking nothing: the ShapeEnv's state after the inputs alone


# what the mode would ask as a guard, or a layout the kernels do not work out: left to the mode
REFUSED = {
    "transposed heads times a table": (MUL, lambda b, s: (torch.empty(b, s, 2, 8).transpose(1, 2),
                                                          torch.empty(1, 1, s, 8))),
    "a [1, s, d] table against [b, h, s, d] heads": (MUL, lambda b, s: (torch.empty(b, 2, s, 8),
                                                                        torch.empty(1, s, 8))),
    "two named sizes broadcast": (MUL, lambda b, s: (torch.empty(b, 1, 8), torch.empty(1, s, 8))),
    "a [1, s] operand first": (MUL, lambda b, s: (torch.empty(1, s, 8), torch.empty(b, s, 8))),
    "a named size against another": (ADD, lambda b, s: (torch.empty(b, 8), torch.empty(s, 8))),
    "a table of fewer axes against transposed heads": (MUL, lambda b, s: (_heads(b, _seq_not_one(s)),
                                                                          torch.empty(s, 8))),
    "4-d contiguous": (ADD, lambda b, s: (torch.empty(b, 3, s, s), torch.empty(b, 3, s, s))),
    "a transposed operand": (ADD, lambda b, s: (torch.empty(b, s, 8), torch.empty(b, 8, s).transpose(1, 2))),
    "a strided slice": (MUL, lambda b, s: (torch.empty(b, s, 8)[..., :4], torch.empty(b, s, 4))),
    "0-d tensor": (MUL, lambda b, s: (torch.empty(b, s, 8), torch.tensor(2.0))),
    "a symbolic scalar": (MUL, lambda b, s: (torch.empty(b, s, 8), s)),
    "scalar first": (MUL, lambda b, s: (2, torch.empty(b, s, 8))),
    "alpha": (ADD, lambda b, s: (torch.empty(b, s, 8), torch.empty(b, s, 8))),
    "static sizes": (ADD, lambda b, s: (torch.empty(3, 8), torch.empty(3, 8))),
    "neg of ints": (NEG, lambda b, s: (torch.empty(b, s, dtype=torch.long),)),
    "rsqrt, 4-d": (RSQRT, lambda b, s: (torch.empty(b, 2, s, 1),)),
    "pow by a tensor's exponent": (POW, lambda b, s: (torch.empty(b, s, 8), s)),
    "mean over a named axis": (MEAN, lambda b, s: (torch.empty(b, s, 8), [1], True)),
    "mean over two axes": (MEAN, lambda b, s: (torch.empty(b, s, 8), [1, 2], True)),
    "mean, transposed": (MEAN, lambda b, s: (torch.empty(b, 8, s).transpose(1, 2), [-1], True)),
    "mean of nothing": (MEAN, lambda b, s: (torch.empty(b, s, 0), [-1], True)),
}


@pytest.mark.parametrize("hints", [(2, 7), (1, 7), (3, 1), (1, 1)])
@pytest.mark.parametrize("case", TAKEN)
def test_the_symbolic_elementwise_op_gives_what_the_mode_gives(case, hints):
    op, build = TAKEN[case]
    direct, through_the_mode = (_layout_run(op, build, hints, direct=d) for d in (True, False))
    if direct[0] is None:  # only where a named size of an operand is 1 at the capture's point: the mode guards it
        assert 1 in hints and through_the_mode[1][0], "the kernel takes this op"
        return
    assert direct == through_the_mode


# found by review: where the mode's route asks a guard (or raises) that a direct shape skipped. float16 and
# bfloat16 unary ops and means run the mode's reference in float32 (its conversions ask whether sizes are 1);
# `pow` by 1 is the reference's clone, and at a point of fewer than 2 elements the reference guards every size
# to 1; an int beyond int64 raises OverflowError in the mode
GUARDED = {
    "neg in half": (NEG, lambda b, s: (torch.empty(b, s, 8, dtype=torch.float16),)),
    "rsqrt in bfloat16": (RSQRT, lambda b, s: (torch.empty(b, s, dtype=torch.bfloat16),)),
    "pow 0.5 in half": (POW, lambda b, s: (torch.empty(b, s, 8, dtype=torch.float16), 0.5)),
    "pow 2 in half, 2-d": (POW, lambda b, s: (torch.empty(s, 8, dtype=torch.float16), 2)),
    "pow by 1": (POW, lambda b, s: (torch.empty(b, s, 8), 1)),
    "pow by 1.0": (POW, lambda b, s: (torch.empty(b, s), 1.0)),
    "pow 2 of fewer than 2 elements": (POW, lambda b, s: (torch.empty(b, s, 1), 2)),
    "pow -2 of fewer than 2 elements": (POW, lambda b, s: (torch.empty(s), -2)),
    "pow by an int beyond int64": (POW, lambda b, s: (torch.empty(b, s), 2**70)),
    "mean in half": (MEAN, lambda b, s: (torch.empty(b, s, 8, dtype=torch.float16), [-1], True)),
    "mean in bfloat16": (MEAN, lambda b, s: (torch.empty(s, 8, dtype=torch.bfloat16), [1])),
    "plus an int beyond int64": (ADD, lambda b, s: (torch.empty(b, s, dtype=torch.long), 2**70)),
}


@pytest.mark.parametrize("hints", [(2, 7), (1, 7), (3, 1), (1, 1)])
@pytest.mark.parametrize("case", GUARDED)
def test_an_op_whose_mode_route_guards_or_raises_is_left_to_the_mode(case, hints):
    op, build = GUARDED[case]
    direct = _layout_run(op, build, hints, direct=True)
    assert direct[0] is None or direct == _layout_run(op, build, hints, direct=False)


@pytest.mark.parametrize("case", REFUSED)
def test_an_elementwise_op_the_kernel_cannot_shape_without_a_question_goes_through_the_mode(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxflops.capture.symbolic_kernels import symbolic_kernel

    op, build = REFUSED[case]
    if case == "alpha":
        with FakeTensorMode(shape_env=_env(), static_shapes=True) as mode:
            args = build(*_sizes(mode.shape_env))
            assert symbolic_kernel(op, args, {"alpha": 2}) is NotImplemented
        return
    assert _layout_run(op, build) == (None, None)


def _env():
    from fxflops.capture.size_one import size_one_shape_env

    return size_one_shape_env()


def _sizes(env):
    from torch._dynamo.source import ConstantSource

    sizes = []
    for name, hint in (("b", 2), ("s", 7)):
        source = ConstantSource(name)
        sizes.append(env.create_symintnode(env.create_symbol(hint, source=source, do_not_specialize_zero_one=True),
                                           hint=hint, source=source))
    return sizes


def test_the_refused_broadcasts_are_ones_the_mode_guards():
    """Two named sizes broadcast against each other, or a [1, s] first operand against [b, s]: the mode asks
    whether b is 1 (a guard), which a direct shape would have skipped."""
    for case in ("two named sizes broadcast", "a [1, s] operand first"):
        op, build = REFUSED[case]
        state = _layout_run(op, build, direct=False)[1]
        assert state[0], case


class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + 1e-6))


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm, self.up, self.down = RMSNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(-self.up(self.norm(x)) / 2 - 1)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = RMSNorm(16)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def test_an_rmsnorm_sweep_is_the_captures_without_the_kernels_and_every_point_is_estimate(monkeypatch):
    swept = sweep_as_without_the_kernels(Stack().eval(), monkeypatch)
    # by hand: two linears a block, 16*32 + 32*16 MACs a row
    assert swept.at(batch=2, seq=9).total_macs == 2 * 2 * 9 * (16 * 32 + 32 * 16)


def test_a_transformers_llama_sweep_has_the_captures_pieces_without_the_kernels_and_estimates_totals(monkeypatch):
    """Rotary block on transposed heads, RMSNorm, GQA: the pieces (conditions) the mode alone gives, and
    estimate()'s totals at points where batch or seq is 1 too."""
    transformers = pytest.importorskip("transformers")
    import fxflops
    from fxflops.capture import symbolic_kernels  # (a capture with named sizes takes its kernel from there)
    from fxflops.sweeps import sweep

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=256)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    tokens = lambda b, s: torch.zeros(b, s, dtype=torch.long, device="meta")  # noqa: E731
    dims = {"batch": 0, "seq": 1}
    swept = sweep(model, tokens(2, 7), dims=dims)
    with monkeypatch.context() as patched:
        patched.setattr(symbolic_kernels, "symbolic_kernel", lambda func, args, kwargs: NotImplemented)
        through_the_mode = sweep(model, tokens(2, 7), dims=dims)
    assert [piece.conditions for piece in swept.pieces] == [piece.conditions for piece in through_the_mode.pieces]
    for batch, seq in ((1, 1), (1, 7), (3, 1), (3, 30)):
        at, fresh = swept.at(batch=batch, seq=seq), fxflops.estimate(model, tokens(batch, seq))
        assert (at.total_macs, at.total_flops) == (fresh.total_macs, fresh.total_flops)


def test_refusing_guards_raises_where_a_question_would_be_a_guard_and_adds_none():
    from fxflops.capture.size_one import WouldGuard, refusing_guards

    env = _env()
    b, s = _sizes(env)
    with refusing_guards(env):
        assert bool(b * s >= 0)  # known from the ranges: answered
        with pytest.raises(WouldGuard):
            bool(b == s)
    assert not env.guards and not env.refusing
    assert not bool(b == s) and len(env.guards) == 1  # outside it, asked as always: a guard
