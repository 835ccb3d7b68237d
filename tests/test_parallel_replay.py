"""Replay of repeated blocks under what-if plans (forward): a block carrying tensor parallelism's hooks and
DTensor parameters is copied from its first call (capture.block_hooks), and every number equals the plain
path's (replay=False, which runs every call) and the hand counts of tests/test_parallel_plans.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fxflops
from fxflops.capture.replay import REPLAY_OF, ReplayMismatch
from tests.parallel_models import Llama

V, D, L, HEADS, F, B, S = 256, 64, 4, 8, 128, 2, 16
T = B * S
ATTN_LINEAR = 4 * 2 * T * D * D  # wq, wk, wv, wo
FFN = 3 * 2 * T * D * F  # w1, w3, w2
SDPA = 2 * (2 * B * HEADS * S * S * (D // HEADS))
HEAD = 2 * T * D * V


@pytest.fixture(scope="module")
def llama():
    with torch.device("meta"):
        return Llama(V, D, L, HEADS, F)


def plan_estimate(model, replay: bool, **plan):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayMismatch)
        return fxflops.estimate(model, (torch.zeros(B, S, dtype=torch.long),), conventions="torch", parallel=plan,
                                replay=replay)


def numbers(est) -> list[tuple]:
    """Per rank role: its ranks, FLOPs, per-module FLOPs and every collective record."""
    return [(role.name, role.ranks, role.estimate.total_flops,
             {name: (stats.flops, stats.self_flops) for name, stats in role.estimate.modules.items()},
             [(c.op, c.bytes, c.wire_bytes, c.module, c.phase, c.group, c.group_size, c.per_step)
              for c in role.estimate.collectives]) for role in est.ranks]


def ops(est) -> list[tuple]:
    """Every recorded op (placeholders aside) by target, module and output shape, in order."""
    return [(str(node.target), node.meta.get("fxflops_module"), tuple(getattr(node.meta.get("val"), "shape", ())))
            for node in est.source.captured.graph_module.graph.nodes if node.op != "placeholder"]


def replayed_modules(est) -> set[str]:
    return {node.meta["fxflops_module"][0] for node in est.source.captured.graph_module.graph.nodes
            if REPLAY_OF in node.meta}


def whole_blocks(est) -> set[str]:
    """The layers copied whole: their own ops (the residual adds) replayed."""
    return {name for name in replayed_modules(est) if name.startswith("layers.") and name.count(".") == 1}


@pytest.mark.parametrize("plan", [dict(tp=2), dict(tp=4), dict(tp=2, pp=2), dict(tp=2, dp=2),
                                  dict(tp=2, dp=2, fsdp=False), dict(tp=2, sequence_parallel=True), dict(pp=2, dp=2),
                                  dict(tp=2, pp=2, dp=2)])
def test_replay_under_a_plan_changes_no_number(llama, plan):
    replayed, plain = plan_estimate(llama, True, **plan), plan_estimate(llama, False, **plan)
    assert numbers(replayed) == numbers(plain)
    assert ops(replayed) == ops(plain)
    assert not replayed_modules(plain)


def test_tensor_parallel_blocks_are_replayed_with_their_all_reduces(llama):
    est = plan_estimate(llama, True, tp=2)
    # layers 1 to 3 copy layer 0 (the reference: a block with siblings is recorded at its first call) whole: its hooks (the block input made a replicated DTensor,
    # the row-parallel linears' outputs all-reduced) and its DTensor parameters' local shards
    assert whole_blocks(est) == {"layers.1", "layers.2", "layers.3"}
    assert est.fwd_flops == L * (ATTN_LINEAR + FFN + SDPA) // 2 + HEAD
    assert [(c.op, c.module, c.bytes) for c in est.collectives] == \
        [("all_reduce", f"layers.{i}.{m}", T * D * 4) for i in range(L) for m in ("attention.wo", "feed_forward.w2")]


def test_fsdp_blocks_run_and_their_parts_replay(llama):
    # FSDP's hooks move its state machine and gather parameters: the block runs (its all-gather is its own);
    # the attention and MLP inside it carry tensor parallelism's hooks only and are copied
    est = plan_estimate(llama, True, tp=2, dp=2)
    replayed = replayed_modules(est)
    assert any(name.startswith("layers.") for name in replayed) and not whole_blocks(est)
    assert sum(c.op == "all_gather" for c in est.collectives) == L + 1  # each block's and the root's


class CountingColwise(ColwiseParallel):
    """A user's style whose input hook has a side effect: replay cannot know, so its blocks run."""

    calls = 0

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        CountingColwise.calls += 1
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)


def test_a_hook_of_a_users_own_style_runs_every_call(llama):
    CountingColwise.calls = 0
    tp_plan = {"layers.*.feed_forward.w1": CountingColwise(), "layers.*.feed_forward.w3": ColwiseParallel(),
               "layers.*.feed_forward.w2": RowwiseParallel()}
    est = plan_estimate(llama, True, tp=2, tp_plan=tp_plan)
    assert CountingColwise.calls == L
    replayed = replayed_modules(est)
    # the blocks holding it run (their MLP's own ops, w1's matmul); w2 and w3, torch's styles alone, are copied
    assert not any(name.endswith((".feed_forward", ".w1")) for name in replayed)
    assert any(name.endswith(".w3") for name in replayed)
    assert est.fwd_flops == L * (ATTN_LINEAR + SDPA + FFN // 2) + HEAD


def test_a_block_sharded_otherwise_is_not_copied(llama):
    # layer 2's MLP left whole, the others' split: its hooks and parameters differ from layer 0's (the
    # reference), so it runs; layer 3 is layer 0's program again
    split = [i for i in range(L) if i != 2]
    tp_plan = {**{f"layers.{i}.feed_forward.{w}": ColwiseParallel() for i in split for w in ("w1", "w3")},
               **{f"layers.{i}.feed_forward.w2": RowwiseParallel() for i in split},
               "layers.*.attention.w[qkv]": ColwiseParallel(), "layers.*.attention.wo": RowwiseParallel()}
    replayed = plan_estimate(llama, True, tp=2, tp_plan=tp_plan)
    plain = plan_estimate(llama, False, tp=2, tp_plan=tp_plan)
    assert numbers(replayed) == numbers(plain) and ops(replayed) == ops(plain)
    copied = replayed_modules(replayed)
    assert not any(name.startswith("layers.2.feed_forward") for name in copied)
    assert any(name.startswith("layers.3.feed_forward") for name in copied)
    assert replayed.fwd_flops == L * (ATTN_LINEAR + SDPA) // 2 + (L - 1) * FFN // 2 + FFN + HEAD


def test_sequence_parallel_blocks_take_and_return_sharded_streams(llama):
    # under sequence parallelism a block's input and output are DTensors sharded along the sequence: the
    # copies read this call's local shard and return a DTensor of the reference's placements around theirs
    est = plan_estimate(llama, True, tp=2, sequence_parallel=True)
    assert whole_blocks(est) == {"layers.1", "layers.2", "layers.3"}
    assert est.fwd_flops == L * (ATTN_LINEAR + FFN + SDPA) // 2 + HEAD // 2
    per_layer = {(c.op, c.module, c.bytes) for c in est.collectives if c.module.startswith("layers.3.")}
    # the block's input gathered along the sequence for attention and MLP, their outputs reduce-scattered
    assert per_layer == {("all_gather", "layers.3.attention", T * D * 4), ("all_gather", "layers.3.feed_forward", T * D * 4),
                         ("reduce_scatter", "layers.3.attention.wo", T * D * 4),
                         ("reduce_scatter", "layers.3.feed_forward.w2", T * D * 4)}


@pytest.mark.parametrize("plan", [dict(tp=2), dict(tp=2, dp=2), dict(tp=2, sequence_parallel=True)])
def test_every_copied_call_checked_against_running_it(llama, plan, monkeypatch):
    # FXFLOPS_VERIFY_REPLAY: each call that would be copied runs too, and any difference is a ReplayMismatch
    # (an error here)
    monkeypatch.setenv("FXFLOPS_VERIFY_REPLAY", "1")
    est = plan_estimate(llama, True, **plan)
    assert est.fwd_flops == L * (ATTN_LINEAR + FFN + SDPA) // 2 + HEAD // (2 if plan.get("sequence_parallel") else 1)


def test_memory_under_a_plan_is_that_of_running_every_call(llama):
    # a copied block's values share the reference's fake storages, which the memory timeline (by storage)
    # would read as one longer life: a plan's capture under memory= runs every call
    def peak(replay: bool) -> int:
        return fxflops.estimate(llama, (torch.zeros(B, S, dtype=torch.long),), parallel=dict(tp=2), memory=True,
                                replay=replay).memory.peak_bytes

    assert peak(True) == peak(False)


def test_hooks_are_keyed_by_what_they_run():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    from fxflops.capture.block_hooks import hooks_key
    from fxflops.capture.block_state import Keyer
    from fxflops.parallel.whatif import composable_states_restored, fake_world

    with fake_world(2, 0), composable_states_restored(), torch.device("meta"):
        mesh = init_device_mesh("cpu", (2,))
        linears = [torch.nn.Linear(8, 8) for _ in range(4)]
        for linear, style in zip(linears, (ColwiseParallel(), ColwiseParallel(), ColwiseParallel(output_layouts=Replicate()),
                                           CountingColwise())):
            parallelize_module(linear, mesh, style)
        same, also, other, users = (hooks_key(linear, Keyer().key) for linear in linears)
    assert same == also  # two style objects of equal settings: one program
    assert same != other  # the output gathered: another program
    assert users == "a hook on Linear"  # a style of the user's class (its own hook code): never keyed
    plain = torch.nn.Linear(2, 2)
    plain.register_forward_hook(lambda module, args, out: None)
    assert hooks_key(plain, Keyer().key) == "a hook on Linear"


def test_a_dtensors_local_tensor_passed_again_is_keyed_as_an_alias():
    # a copied call stands for another only where their keys are equal: a reference call whose DTensor's local
    # tensor is also another argument (plain, or another DTensor's local) must not stand for a call without it
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from fxflops.capture.block_state import CallKey
    from fxflops.parallel.whatif import composable_states_restored, fake_world

    with fake_world(2, 0), composable_states_restored(), torch.device("meta"):
        mesh = init_device_mesh("cpu", (2,))
        local, other, third = torch.empty(4, 8), torch.empty(4, 8), torch.empty(4, 8)
        stream = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        stream_of_other = DTensor.from_local(other, mesh, [Shard(0)], run_check=False)
        stream_of_third = DTensor.from_local(third, mesh, [Shard(0)], run_check=False)
        held = stream._local_tensor  # (from_local wraps a view of `local`: the local tensor is this one)
        aliased, apart = CallKey((stream, held), {}).key, CallKey((stream_of_other, third), {}).key
        plain_first = CallKey((held, stream), {}).key, CallKey((third, stream_of_other), {}).key
        twin = DTensor(held, stream._spec, requires_grad=False)  # another DTensor over the same local tensor
        both = CallKey((stream, twin), {}).key
        neither = CallKey((stream_of_other, stream_of_third), {}).key
        again = CallKey((stream_of_other, third), {}).key
    assert aliased != apart
    assert plain_first[0] != plain_first[1]
    assert both != neither
    assert again == apart  # (no alias: equal calls keep equal keys)
