"""Repeated ops under named sizes rebuilt from the fake mode's own cache entry (capture.symbolic_cache): the
same tensors as the mode's rebuild, declined where the mode must run, and sweeps equal to fresh estimates
node by node."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import statically_known_true

import fxflops
from fxflops.capture.dynamic import SizePlan, SizeSymbols
from fxflops.capture.symbolic_cache import FIRST_SIGHT, CacheHits
from fxflops.results import ZERO
from fxflops.sweeps import sweep

aten = torch.ops.aten


@pytest.fixture
def symbolic():
    sizes = SizeSymbols(SizePlan({0: {0: "batch", 1: "seq"}}, {"batch": 2, "seq": 7}))
    mode = FakeTensorMode(shape_env=sizes.env, static_shapes=True)
    batch, seq = sizes.symints["batch"], sizes.symints["seq"]
    with mode:
        x = torch.empty_strided((batch, 8, seq, 16), (128 * seq, 16, 128, 1), device="cpu")
    return mode, CacheHits(mode), x, batch, seq


def calls(x, batch, seq):
    return [(aten.slice.Tensor, (x, 3, 0, 8)), (aten.slice.Tensor, (x, 2, 1, seq)), (aten.transpose.int, (x, 1, 2)),
            (aten.unsqueeze.default, (x, 1)), (aten.select.int, (x, 1, 3)), (aten.permute.default, (x, [0, 2, 1, 3])),
            (aten.view.default, (x, [batch, 8, seq, 2, 8])), (aten.expand.default, (x[:, :1], [batch, 8, seq, 16])),
            (aten.diagonal.default, (x, 0, 1, 2)), (aten.alias.default, (x,)), (aten.squeeze.dim, (x[:, :1], 1)),
            (aten.split.Tensor, (x, 2, 3)),  # several views
            (aten.mul.Tensor, (x, x)), (aten.add.Tensor, (x, x[:, :1])), (aten.neg.default, (x.transpose(1, 2),)),
            (aten.cat.default, ([x, x], -1)), (aten.cat.default, ([x[:, :, 1:], x], 2)),
            (aten.sum.dim_IntList, (x, [2])),
            (aten.max.dim, (x, 2)),  # two new tensors
            (aten.clone.default, (x.transpose(1, 2),)), (aten._to_copy.default, (x,), {"dtype": torch.bfloat16}),
            (aten.mul_.Tensor, (x.clone(), 2))]  # in place: its argument again


def test_a_repeated_op_is_the_tensor_the_mode_rebuilds(symbolic):
    mode, hits, x, batch, seq = symbolic
    with mode:
        for func, args, *rest in calls(x, batch, seq):
            kwargs = rest[0] if rest else {}
            func(*args, **kwargs)  # the first call: the mode runs the kernel and caches the entry
            # the mode's rebuild from its entry, as it comes out of the mode (below autograd's view tracking)
            with torch._C._AutoDispatchBelowADInplaceOrView():
                expected = func(*args, **kwargs)
            guards = len(mode.shape_env.guards)
            found = hits(func, args, kwargs)
            assert found is not NotImplemented, func
            assert len(mode.shape_env.guards) == guards  # it asks nothing of the sizes
            several = isinstance(expected, tuple | list)  # (the dispatcher gives a schema's list of the mode's tuple)
            assert isinstance(found, tuple | list) == several and (not several or len(found) == len(expected))
            for mine, theirs in zip(*((found, expected) if several else ((found,), (expected,)))):
                assert (mine.shape, mine.stride(), mine.storage_offset(), mine.dtype, mine.device) == \
                    (theirs.shape, theirs.stride(), theirs.storage_offset(), theirs.dtype, theirs.device), func
                assert type(mine) is type(theirs) and mine.fake_mode is mode
                assert (mine.requires_grad, mine._is_view(), mine.is_contiguous()) == \
                    (theirs.requires_grad, theirs._is_view(), theirs.is_contiguous()), func
                # the same storage as the mode's: the input's for a view or in place, else a new one of its size
                tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
                shared = [arg for arg in tensors if theirs.untyped_storage()._cdata == arg.untyped_storage()._cdata]
                if shared:
                    assert mine.untyped_storage()._cdata == shared[0].untyped_storage()._cdata, func
                else:
                    assert all(mine.untyped_storage()._cdata != arg.untyped_storage()._cdata for arg in tensors), func
                    assert statically_known_true(mine.untyped_storage().nbytes() == theirs.untyped_storage().nbytes())


def test_the_mode_runs_what_it_has_not_cached_or_is_no_plain_tensor(symbolic):
    mode, hits, x, batch, seq = symbolic
    with mode:
        assert hits(aten.slice.Tensor, (x, 3, 0, 4), {}) is FIRST_SIGHT  # a first call: no entry yet
        assert hits(aten.slice.Tensor, (x, 3, 0, 4), {}) is NotImplemented  # met before: the mode makes the entry
        y = torch.empty(4, 6)
        y.view(torch.int32)
        assert _declined(hits(aten.view.dtype, (y, torch.int32), {}))  # another dtype
        aten.transpose_(x.clone(), 0, 1)
        assert _declined(hits(aten.transpose_.default, (x.clone(), 0, 1), {}))  # an in-place view
        made = ((batch, seq, 3), (3 * seq, 3, 1))
        aten.empty_strided.default(*made)
        assert _declined(hits(aten.empty_strided.default, made, {}))  # the mode does not cache it
        z = torch.empty(3, 4, dtype=torch.complex64)
        aten._conj(z)
        assert _declined(hits(aten._conj.default, (z,), {}))  # the conjugate bit
        w = torch.empty(3, 4, requires_grad=True)
        aten.t.default(w)
        assert _declined(hits(aten.t.default, (w,), {}))  # autograd's


def test_a_call_met_once_makes_no_entry_the_second_makes_it_the_third_takes_the_route(symbolic):
    # the mode's entry (made at every miss, checked by rebuilding the output once more in symbolic arithmetic)
    # is made only for a call met before: most of a replayed capture's calls are met once
    mode, hits, x, batch, seq = symbolic
    call = (aten.transpose.int, (x, 1, 3), {})
    cache = mode.shape_env.fake_tensor_cache
    entries = len(cache)  # (the fixture's empty_strided)
    with mode:
        assert hits(*call) is FIRST_SIGHT
        with hits.uncached():
            first = aten.transpose.int(x, 1, 3)
        assert mode.cache_enabled and len(cache) == entries  # the flag back; no entry made
        assert hits(*call) is NotImplemented
        second = aten.transpose.int(x, 1, 3)  # through the mode, which makes the entry
        assert len(cache) > entries
        third = hits(*call)
    assert (first.shape, first.stride()) == (second.shape, second.stride()) == (third.shape, third.stride()) \
        == ((batch, 16, seq, 8), (128 * seq, 1, 128, 16))
    with pytest.raises(ZeroDivisionError), hits.uncached():
        1 / 0
    assert mode.cache_enabled  # restored on an error too


def _declined(found):
    """The route gives no output: the mode runs the call (FIRST_SIGHT: without making an entry)."""
    return found is NotImplemented or found is FIRST_SIGHT


def test_no_route_without_named_sizes():
    assert CacheHits(FakeTensorMode())(aten.alias.default, (torch.empty(2),), {}) is NotImplemented


def test_a_gqa_decoder_swept_over_batch_and_seq_equals_fresh_estimates():
    # a GQA Llama's attention repeats its calls (the heads split and transposed, the rotary halves sliced,
    # negated, concatenated and multiplied) layer after layer: every point node by node against estimate()
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                      max_position_embeddings=128)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    ids = lambda batch, seq: torch.zeros(batch, seq, dtype=torch.long, device="meta")  # noqa: E731
    swept = sweep(model, ids(2, 9), dims={"batch": 0, "seq": 1})
    for batch, seq in [(2, 9), (3, 5), (4, 17), (2, 2)]:
        at, fresh = swept.at(batch=batch, seq=seq), fxflops.estimate(model, ids(batch, seq))
        assert (at.total_macs, at.total_flops, at.total_params, at.total_bytes) == \
            (fresh.total_macs, fresh.total_flops, fresh.total_params, fresh.total_bytes)
        # node by node, but for the root's zero-cost views of the head's `hidden_states[:, slice(-0, None), :]`,
        # which torch indexes as an alias at fixed sizes and as slices at named ones (with or without the route)
        assert [_node(n) for n in at.nodes if not _head_view(n)] == [_node(n) for n in fresh.nodes if not _head_view(n)]
        # by hand: q, k, v, o and the MLP's three projections per token and layer, and the head
        per_token = 3 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64) + 32 * 50
        assert at.by_op["aten.linear.default"].macs == batch * seq * per_token


HEAD_VIEWS = ("aten.alias.default", "aten.slice.Tensor")


def _head_view(n):
    return n.module == "" and n.op in HEAD_VIEWS and n.status == ZERO


def _node(n):
    return n.op, n.module, n.input_shapes, n.output_shapes, n.macs, n.flops, n.bytes


def test_a_named_inputs_twin_is_the_tensor_the_modes_constructor_makes():
    """The twin of an input with named axes is made past the mode (whose cache entry for the call cost more than the
    tensor): what the mode's constructor makes, its sizes, strides and storage the same expressions, nothing asked."""
    from fxflops.capture.eager import FakeTwins

    sizes = SizeSymbols(SizePlan({0: {0: "batch", 2: "size", 3: "size"}}, {"batch": 2, "size": 9}))
    mode = FakeTensorMode(shape_env=sizes.env, static_shapes=True)
    for dtype, grad in ((torch.float32, False), (torch.bfloat16, True)):
        tensor = torch.empty(2, 3, 9, 9, dtype=dtype, device="meta", requires_grad=grad)
        shape = sizes.sizes(0, tensor)
        twins = FakeTwins(mode, torch.device("cpu"), {id(tensor): shape})
        made = twins(tensor)
        with mode:
            expected = torch.empty(shape, dtype=dtype, device="cpu").requires_grad_(grad)

        def layout(t):
            return ([s.node.expr if isinstance(s, torch.SymInt) else s for s in (*t.shape, *t.stride())],
                    t.untyped_storage().nbytes().node.expr, t.storage_offset(), t.dtype, t.device, t.requires_grad,
                    type(t), t.fake_mode)

        assert layout(made) == layout(expected)
    assert (sizes.env.guards, sizes.env.replacements, sizes.env.deferred_runtime_asserts) == ([], {}, {})
