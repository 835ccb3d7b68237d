"""A user's own torch.distributed.pipelining job: estimate(schedule, step inputs) on each rank (issue 38).

The send/recv records are what torch's schedule issues in one step; the hand counts: each micro-batch sends
its activation (rows x width x 4 bytes) forward across every stage boundary and its gradient back. FLOPs under
the torch preset (FlopCounterMode's formulas: matmuls and SDPA).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                         ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

import fxflops
from tests.parallel_models import Llama

W, ROWS, M = 16, 8, 4  # width, rows per step, micro-batches
MB = ROWS // M  # rows per micro-batch
FP32 = 4
ACT = MB * W * FP32  # one micro-batch's activation
ONE = 2 * MB * W * W  # one linear's forward FLOPs on one micro-batch


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def linears() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(W, W, bias=False), torch.nn.Linear(W, W, bias=False))


def stage(index: int, stages: int, submodule: torch.nn.Module | None = None) -> PipelineStage:
    example = torch.empty(MB, W, requires_grad=True)  # the fake process group needs static metadata
    return PipelineStage(submodule or linears(), index, stages, torch.device("cpu"), input_args=(example,),
                         output_args=(example,))


def step_inputs(first: bool, last: bool) -> tuple[tuple, dict]:
    return ((torch.randn(ROWS, W),) if first else ()), ({"target": torch.randn(ROWS, W)} if last else {})


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().sum()


def p2p(est) -> list[tuple]:
    return [(c.op, c.phase, c.stage, c.micro_batch, c.peer, c.bytes, c.wire_bytes)
            for c in est.collectives if c.op in ("send", "recv")]


@pytest.mark.parametrize("kind", [ScheduleGPipe, Schedule1F1B])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_each_rank_of_a_three_stage_pipeline_sends_what_the_schedule_issues(kind, rank):
    with fake_world(rank, 3):
        schedule = kind(stage(rank, 3), M, loss_fn=loss)
        args, kwargs = step_inputs(rank == 0, rank == 2)
        est = fxflops.estimate(schedule, args, kwargs, conventions="torch")
    records = p2p(est)
    expected = []
    for mb in range(M):
        if rank > 0:  # the activation from the stage before, its gradient back
            expected += [("recv", "forward", rank, mb, rank - 1, ACT, 0),
                         ("send", "backward", rank, mb, rank - 1, ACT, ACT)]
        if rank < 2:  # the activation to the stage after, its gradient from there
            expected += [("send", "forward", rank, mb, rank + 1, ACT, ACT),
                         ("recv", "backward", rank, mb, rank + 1, ACT, 0)]
    assert sorted(records) == sorted(expected)
    # per stage, phase and kind the micro-batches go in order; a gradient comes after its forward
    for key in {(r[0], r[1]) for r in records}:
        assert [r[3] for r in records if (r[0], r[1]) == key] == list(range(M))
    first_backward = next(i for i, r in enumerate(records) if r[1] == "backward")
    forwards_before = sum(1 for r in records[:first_backward] if r[1] == "forward")
    per_micro_batch = (rank > 0) + (rank < 2)
    if kind is ScheduleGPipe:  # every forward before any backward
        assert forwards_before == M * per_micro_batch
    else:  # 1F1B: (stages - rank) micro-batches in flight before the first backward
        assert forwards_before == (3 - rank) * per_micro_batch < M * per_micro_batch
    assert est.collective_bytes == 2 * M * per_micro_batch * ACT  # per step: every micro-batch, each way
    # the stage on one micro-batch: two linears; backward: weight gradients, and input gradients where the
    # input is a received activation (the first stage's input needs none: one input gradient less)
    assert (est.fwd_flops, est.bwd_flops) == (2 * ONE, (3 if rank == 0 else 4) * ONE)


def test_an_interleaved_schedule_counts_both_stages_of_the_rank():
    with fake_world(1, 2):  # rank 1 holds stages 1 and 3 of 4
        schedule = ScheduleInterleaved1F1B([stage(1, 4), stage(3, 4)], M, loss_fn=loss)
        est = fxflops.estimate(schedule, (), {"target": torch.randn(ROWS, W)}, conventions="torch")
    assert [(role.name, role.ranks, role.estimate.fwd_flops, role.estimate.bwd_flops) for role in est.ranks] == [
        ("pipeline stage 1", (1,), 2 * ONE, 4 * ONE), ("pipeline stage 3", (1,), 2 * ONE, 4 * ONE)]
    expected = [("recv", "forward", 1, mb, 0, ACT, 0) for mb in range(M)] \
        + [("send", "backward", 1, mb, 0, ACT, ACT) for mb in range(M)] \
        + [("send", "forward", 1, mb, 0, ACT, ACT) for mb in range(M)] \
        + [("recv", "backward", 1, mb, 0, ACT, 0) for mb in range(M)] \
        + [("recv", "forward", 3, mb, 0, ACT, 0) for mb in range(M)] \
        + [("send", "backward", 3, mb, 0, ACT, ACT) for mb in range(M)]
    assert sorted(p2p(est)) == sorted(expected)


def test_each_stage_entry_of_an_interleaved_rank_holds_its_own_share_of_the_step():
    with fake_world(1, 2):  # rank 1 holds stages 1 and 3 of 4
        schedule = ScheduleInterleaved1F1B([stage(1, 4), stage(3, 4)], M, loss_fn=loss)
        est = fxflops.estimate(schedule, (), {"target": torch.randn(ROWS, W)}, conventions="torch")
    first, last = (role.estimate for role in est.ranks)
    # stage 1: the activation in and its gradient out, the activation on to stage 2 and its gradient back;
    # stage 3 (the last): the activation in and its gradient out; per micro-batch each
    assert sorted(p2p(first)) == sorted(r for r in p2p(est) if r[2] == 1)
    assert {r[2] for r in p2p(first)} == {1} and {r[2] for r in p2p(last)} == {3}
    assert (len(p2p(first)), len(p2p(last))) == (4 * M, 2 * M)
    assert (first.collective_bytes, last.collective_bytes, est.collective_bytes) == (4 * M * ACT, 2 * M * ACT,
                                                                                     6 * M * ACT)
    assert est.ranks[0].estimate is not est


def test_the_schedule_its_stages_and_the_model_are_left_as_they_were():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(W, W, bias=False), torch.nn.Linear(W, W, bias=False))
    before = [p.detach().clone() for p in model.parameters()]
    with fake_world(0, 2):
        schedule = Schedule1F1B(stage(0, 2, model), M, loss_fn=loss)
        x = torch.randn(ROWS, W)
        fxflops.estimate(schedule, (x,), conventions="torch")
        assert all(not isinstance(p, torch._subclasses.FakeTensor) for p in model.parameters())
        assert not schedule._stage_forward_initialized and not schedule._stage.fwd_cache
        schedule.step(x)  # the user's real step still runs, on real tensors (the fake group sends nothing)
        assert all(p.grad is not None and not isinstance(p.grad, torch._subclasses.FakeTensor)
                   for p in model.parameters())
        est = fxflops.estimate(schedule, (x,), conventions="torch")  # and after a real step, the same records
    assert len(p2p(est)) == 2 * M
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


class StageOfLlama(Llama):
    """torchtitan's manual split: the whole model with the other stages' modules removed."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


V, D, L, HEADS, F, B, S = 256, 64, 4, 8, 128, 2, 16


def llama_stage(index: int) -> StageOfLlama:
    with torch.device("meta"):
        model = StageOfLlama(V, D, L, HEADS, F)
    model.layers = torch.nn.ModuleList(list(model.layers)[2 * index:2 * index + 2])
    if index == 0:
        model.norm = model.output = None
    else:
        model.tok_embeddings = None
    return model


@pytest.mark.parametrize("rank", [0, 1])
def test_the_plans_pipeline_sends_what_torchs_schedule_sends(rank):
    """The what-if plan (pp=2, cut from one capture) and torch's 1F1B on the same Llama split by hand: per
    micro-batch the same send/recv bytes each way (b·s·h) and the same FLOPs on each stage."""
    with torch.device("meta"):
        whole = Llama(V, D, L, HEADS, F)
    plan = fxflops.estimate(whole, (torch.zeros(B, S, dtype=torch.long),), conventions="torch", backward=True,
                            parallel={"pp": 2, "microbatches": M})
    planned = plan.ranks[rank].estimate
    hidden = torch.empty(B, S, D, requires_grad=True)
    tokens = torch.zeros(B, S, dtype=torch.long)
    examples = ((tokens,), (hidden,)) if rank == 0 else ((hidden,), (torch.empty(B, S, V),))
    with fake_world(rank, 2):
        pipeline_stage = PipelineStage(llama_stage(rank), rank, 2, torch.device("cpu"), input_args=examples[0],
                                       output_args=examples[1])
        schedule = Schedule1F1B(pipeline_stage, M, loss_fn=lambda output, target: output.sum())
        step = ((torch.zeros(M * B, S, dtype=torch.long),), {}) if rank == 0 else ((), {"target": torch.zeros(M * B)})
        est = fxflops.estimate(schedule, *step, conventions="torch")
    activation = B * S * D * FP32
    per_micro_batch = sorted((c.op, c.phase, c.bytes) for c in est.collectives if c.micro_batch == 0)
    assert per_micro_batch == sorted((c.op, c.phase, c.bytes) for c in planned.collectives)
    assert per_micro_batch == sorted([("send", "forward", activation), ("recv", "backward", activation)] if rank == 0
                                     else [("recv", "forward", activation), ("send", "backward", activation)])
    assert len(est.collectives) == M * len(planned.collectives)
    assert (est.fwd_flops, est.bwd_flops) == (planned.fwd_flops, planned.bwd_flops)


def test_a_stage_without_metadata_is_one_clear_line():
    from fxflops.parallel.schedule import received_inputs

    with pytest.raises(ValueError, match=r"^pipeline stage 1 has no input metadata; give PipelineStage its "
                                         r"input_args= \(and output_args=\)$"):
        received_inputs(1, None)


def test_a_real_two_process_gloo_pipeline_issues_what_the_fake_group_estimate_says(tmp_path):
    """tests/distributed_schedule.py: each rank of a real 2-stage Schedule1F1B job (gloo, CPU) logs the send/recv
    torch dispatched in one real step and FlopCounterMode's FLOPs of it, and estimates its schedule inside the
    real group; all equal the fake group's estimate of the same rank and the hand counts."""
    import json

    from tests.torchrun import torchrun

    done = torchrun("distributed_schedule.py", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        with fake_world(rank, 2):
            schedule = Schedule1F1B(stage(rank, 2), M, loss_fn=loss)
            fake = fxflops.estimate(schedule, *step_inputs(rank == 0, rank == 1), conventions="torch")
        assert seen["refused"].startswith("Schedule1F1B has not run a step yet: its first step votes with the other "
                                          "ranks over the process group")
        assert seen["after"]["p2p"] == [list(record) for record in p2p(fake)]
        assert (seen["after"]["fwd"], seen["after"]["bwd"]) == (fake.fwd_flops, fake.bwd_flops) == \
            (2 * ONE, (3 if rank == 0 else 4) * ONE)
        # the real step: torch's one-time vote on the first step (an int32 each way), then the step's own ops
        # in the order the estimate lists them
        peer = 1 - rank
        vote = [["send", 4, peer], ["recv", 4, peer]]
        assert sorted(seen["real_p2p"][:2]) == sorted(vote)
        assert seen["real_p2p"][2:] == [[c.op, c.bytes, c.peer] for c in fake.collectives]
        assert seen["real_flops"] == M * (fake.fwd_flops + fake.bwd_flops)
        # stages from torch's tracer: estimated inside the real group before any real step (their first step
        # only warms up the communicators: a float each way, not listed); the same records and FLOPs
        warm_up = [["send", 4, peer], ["recv", 4, peer]]
        assert sorted(seen["traced_real_p2p"][:2]) == sorted(warm_up)
        assert seen["traced"]["p2p"] == seen["after"]["p2p"]
        assert seen["traced_real_p2p"][2:] == [[c.op, c.bytes, c.peer] for c in fake.collectives]
        assert seen["traced_real_flops"] == seen["real_flops"]
        assert (seen["traced"]["fwd"], seen["traced"]["bwd"]) == (fake.fwd_flops, fake.bwd_flops)


class HFStage(torch.nn.Module):
    """A stage of transformers' Llama split by hand as torchtitan splits it: the model's own forward with the
    other stages' layers removed, a later stage starting from the received hidden state (inputs_embeds), so it
    builds its rotary tables itself from positions."""

    def __init__(self, config, index: int) -> None:
        from transformers import LlamaForCausalLM

        super().__init__()
        with torch.device("meta"):
            whole = LlamaForCausalLM(config)
        self.model, self.lm_head = whole.model, whole.lm_head if index == 1 else None
        self.model.layers = torch.nn.ModuleList(list(self.model.layers)[2 * index:2 * index + 2])
        if index == 0:
            self.model.norm = torch.nn.Identity()
        else:
            self.model.embed_tokens = None
        self.first = index == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.model(**{"input_ids" if self.first else "inputs_embeds": x}).last_hidden_state
        return hidden if self.lm_head is None else self.lm_head(hidden)


@pytest.mark.parametrize("rank", [0, 1])
def test_hf_llama_the_plan_and_torchs_schedule_send_the_hidden_state_only(rank):
    """transformers' Llama computes its rotary cos/sin once before the layers; a stage split as torchtitan does
    builds them again from positions, and torch's schedule sends only the hidden state (b·s·h) each way. The plan
    agrees: a value of parameters, buffers and constants alone is computed on each stage that reads it, not
    sent (its ops on both stages: s·hd/2 + 4·s·hd FLOPs under the deepspeed preset)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    head_dim = D // HEADS
    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                         num_attention_heads=HEADS, num_key_value_heads=4, attn_implementation="sdpa", use_cache=False)
    with torch.device("meta"):
        whole = LlamaForCausalLM(config)
    tokens = torch.zeros(B, S, dtype=torch.long)
    plans = {conventions: fxflops.estimate(whole, (tokens,), conventions=conventions, backward=True,
                                           parallel={"pp": 2}).ranks[rank].estimate
             for conventions in ("torch", "deepspeed")}
    hidden = torch.empty(B, S, D, requires_grad=True)
    examples = ((tokens,), (hidden,)) if rank == 0 else ((hidden,), (torch.empty(B, S, V),))
    with fake_world(rank, 2):
        pipeline_stage = PipelineStage(HFStage(config, rank), rank, 2, torch.device("cpu"), input_args=examples[0],
                                       output_args=examples[1])
        schedule = Schedule1F1B(pipeline_stage, M, loss_fn=lambda output, target: output.sum())
        step = ((torch.zeros(M * B, S, dtype=torch.long),), {}) if rank == 0 else ((), {"target": torch.zeros(M * B)})
        torch_estimates = {conventions: fxflops.estimate(schedule, *step, conventions=conventions)
                           for conventions in ("torch", "deepspeed")}
    activation = B * S * D * FP32
    sent = sorted((c.op, c.phase, c.bytes) for c in torch_estimates["torch"].collectives if c.micro_batch == 0)
    assert sent == sorted((c.op, c.phase, c.bytes) for c in plans["torch"].collectives) == sorted(
        [("send", "forward", activation), ("recv", "backward", activation)] if rank == 0
        else [("recv", "forward", activation), ("send", "backward", activation)])
    ours, theirs = plans["torch"], torch_estimates["torch"]
    assert (ours.fwd_flops, ours.bwd_flops) == (theirs.fwd_flops, theirs.bwd_flops)
    rotary = S * head_dim // 2 + 4 * S * head_dim  # inv_freq x positions, cos, sin, and each scaled
    assert plans["deepspeed"].modules["model.rotary_emb"].flops == \
        torch_estimates["deepspeed"].modules["model.rotary_emb"].flops == rotary


def test_the_records_travel_through_json_and_the_users_losses_are_left_alone():
    from fxflops.report.machine import from_json

    losses = ["mine"]
    with fake_world(1, 2):
        schedule = Schedule1F1B(stage(1, 2), M, loss_fn=loss)
        est = fxflops.estimate(schedule, (), {"target": torch.randn(ROWS, W), "losses": losses}, conventions="torch")
    assert losses == ["mine"]  # the step fills it with a loss per micro-batch: put back
    back = from_json(est.to_json())
    assert [(c.op, c.phase, c.peer, c.stage, c.micro_batch, c.bytes) for c in back.collectives] == \
        [(c.op, c.phase, c.peer, c.stage, c.micro_batch, c.bytes) for c in est.collectives] == \
        [(op, phase, 0, 1, mb, ACT) for mb in range(M) for op, phase in (("recv", "forward"), ("send", "backward"))]


@pytest.mark.parametrize("rank", [0, 3])
def test_tensor_parallel_stages_send_on_the_pp_group_and_all_reduce_on_the_tp_group(rank):
    """4 ranks, mesh (pp=2, tp=2): each stage an up/down MLP split colwise then rowwise over tp. A stage sends its
    (replicated) activation to the rank of the next stage with its tp position, and all-reduces over tp per
    micro-batch: the forward's output, and backward the input's gradient where the input needs one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    hidden = 4 * W
    with fake_world(rank, 4):
        # dimension names of this test's own, one per rank: torch's DTensor caches what it decided per mesh, and
        # a mesh equals one of an earlier fake world of this process with the same layout and names whatever
        # its groups (its cached redistributions would name that world's groups)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(f"pp{rank}", f"tp{rank}"))
        with torch.device("meta"):
            mlp = torch.nn.Sequential(torch.nn.Linear(W, hidden, bias=False), torch.nn.Linear(hidden, W, bias=False))
        mlp = parallelize_module(mlp, mesh[f"tp{rank}"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        pp = mesh[f"pp{rank}"].get_local_rank()
        example = torch.empty(MB, W, requires_grad=True)
        pipeline_stage = PipelineStage(mlp, pp, 2, torch.device("cpu"), input_args=(example,), output_args=(example,),
                                       group=mesh[f"pp{rank}"].get_group())
        est = fxflops.estimate(Schedule1F1B(pipeline_stage, M, loss_fn=loss), *step_inputs(pp == 0, pp == 1),
                               conventions="torch")
    one = 2 * MB * W * hidden // 2  # one linear's local share on one micro-batch
    assert (est.fwd_flops, est.bwd_flops) == (2 * one, (3 if pp == 0 else 4) * one)
    peer = rank + 2 if pp == 0 else rank - 2  # the same tp position in the other stage
    kinds = [("send", "forward"), ("recv", "backward")] if pp == 0 else [("recv", "forward"), ("send", "backward")]
    assert sorted((c.op, c.phase, c.peer, c.micro_batch, c.group_desc, c.bytes) for c in est.collectives
                  if c.op in ("send", "recv")) == sorted((op, phase, peer, mb, f"mesh_pp{rank}", ACT)
                                                          for mb in range(M) for op, phase in kinds)
    reduced = [("forward", "1")] + ([("backward", "0")] if pp == 1 else [])
    assert sorted((c.phase, c.module, c.micro_batch, c.group_desc, c.bytes) for c in est.collectives
                  if c.op == "all_reduce") == sorted((phase, module, mb, f"mesh_tp{rank}", ACT)
                                                     for mb in range(M) for phase, module in reduced)


class StepLog(TorchDispatchMode):
    """The oracle of a real `schedule.step()` under the fake process group (real tensors, nothing sent): each
    send/recv torch dispatches (kind, bytes, peer) in order, and the step's FLOPs by FlopCounterMode's own formulas
    (torch.utils.flop_counter's registry). FlopCounterMode itself cannot wrap a split-backward step: its module
    tracker's gradient hooks on the stage's inputs fail inside the torch.autograd.grad of torch's input backward."""

    def __init__(self) -> None:
        super().__init__()
        self.p2p: list[tuple] = []
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map
        from torch.utils.flop_counter import flop_registry

        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d" and func._overloadpacket.__name__ in ("send", "recv_"):
            kind = "send" if func._overloadpacket.__name__ == "send" else "recv"
            self.p2p += [(kind, t.numel() * t.element_size(), int(args[2])) for t in args[0]]
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            shape = lambda value: value.shape if isinstance(value, torch.Tensor) else value  # noqa: E731
            self.flops += formula(*tree_map(shape, args), **tree_map(shape, kwargs or {}), out_val=tree_map(shape, out))
        return out


# the split-backward schedules (rank r of 2 holds two of 4 stages: interleaved r and r+2, V-shaped r and 3-r)
SPLIT = [(ScheduleInterleavedZeroBubble, ((0, 2), (1, 3))), (ScheduleZBVZeroBubble, ((0, 3), (1, 2))),
         (ScheduleDualPipeV, ((0, 3), (1, 2)))]


@pytest.mark.parametrize("kind,held", SPLIT, ids=[kind.__name__ for kind, _ in SPLIT])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_split_backward_schedule_counts_input_and_weight_gradients_once_each(kind, held, rank):
    """Zero-bubble schedules run each micro-batch's backward as an input-gradient pass (I) and, later, a
    weight-gradient pass (W). Per stage and micro-batch, two linears of MB x W x W: the forward 2 ONE; I: each
    linear's input gradient (2 ONE; 1 ONE on stage 0, whose input needs none); W: each weight's gradient (2 ONE).
    The stage's backward is I + W, once each (torch runs stage 0's I and W as one full backward in its W); the real
    step's FLOPs are n_microbatches x that over the rank's stages, and its send/recv the estimate's, in order."""
    stages = held[rank]
    rank_of = {index: r for r, indices in enumerate(held) for index in indices}
    with fake_world(rank, 2):
        torch.manual_seed(0)
        schedule = kind([stage(index, 4, torch.nn.Sequential(torch.nn.Linear(W, W, bias=False),
                                                             torch.nn.Linear(W, W, bias=False)))
                         for index in stages], M, loss_fn=loss)
        args, kwargs = step_inputs(0 in stages, 3 in stages)
        est = fxflops.estimate(schedule, args, dict(kwargs), conventions="torch")
        log = StepLog()
        with log:
            schedule.step(*args, **kwargs)
    input_grads = {index: 1 if index == 0 else 2 for index in stages}
    assert [(role.name, role.estimate.fwd_flops, role.estimate.bwd_flops) for role in est.ranks] == [
        (f"pipeline stage {index}", 2 * ONE, (input_grads[index] + 2) * ONE) for index in stages]
    assert log.flops == M * sum(role.estimate.fwd_flops + role.estimate.bwd_flops for role in est.ranks)
    expected = []
    for index in stages:
        for mb in range(M):
            if index > 0 and rank_of[index - 1] != rank:  # from the stage before on the other rank, and back
                expected += [("recv", "forward", index, mb, rank_of[index - 1], ACT, 0),
                             ("send", "backward", index, mb, rank_of[index - 1], ACT, ACT)]
            if index < 3 and rank_of[index + 1] != rank:
                expected += [("send", "forward", index, mb, rank_of[index + 1], ACT, ACT),
                             ("recv", "backward", index, mb, rank_of[index + 1], ACT, 0)]
    assert sorted(p2p(est)) == sorted(expected)
    assert [(c.op, c.bytes, c.peer) for c in est.collectives] == log.p2p  # the schedule's own order


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(W, 2 * W, bias=False), torch.nn.Linear(2 * W, W, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block() for _ in range(4))
        self.head = torch.nn.Linear(W, W, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("kind", [ScheduleGPipe, Schedule1F1B])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_stage_built_by_torchs_tracer_splitter_counts_under_the_stages_names(kind, rank):
    """pipeline(model, mb_args, split_spec=) then build_stage: the stage's module is the tracer's copy, its
    submodules under their original qualified names. Per micro-batch (ONE = 2·MB·W·W): a block's up and down are
    2 ONE forward each; backward 2 ONE per weight gradient and 2 ONE per input gradient, but none for the input of
    stage 0's first matmul; the head 1 ONE forward, 2 backward. Only the step's traffic is listed: not the traced
    stage's one-time warm-up of its communicators on the first step (a float each way, stage None before)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    with fake_world(rank, 2):
        torch.manual_seed(0)
        pipe = pipeline(Blocks(), (torch.randn(MB, W),), split_spec={"layers.2": SplitPoint.BEGINNING})
        schedule = kind(pipe.build_stage(rank, torch.device("cpu")), M, loss_fn=loss)
        est = fxflops.estimate(schedule, *step_inputs(rank == 0, rank == 1), conventions="torch")
    flops = {name: module.flops for name, module in est.modules.items() if name.count(".") == 2 or name == "head"}
    if rank == 0:
        assert flops == {"layers.0.up": (2 + 2) * ONE, "layers.0.down": (2 + 4) * ONE,
                         "layers.1.up": (2 + 4) * ONE, "layers.1.down": (2 + 4) * ONE}
    else:
        assert flops == {"layers.2.up": 6 * ONE, "layers.2.down": 6 * ONE, "layers.3.up": 6 * ONE,
                         "layers.3.down": 6 * ONE, "head": (1 + 2) * ONE}
    assert est.total_flops == sum(flops.values())
    peer = 1 - rank
    kinds = [("send", "forward"), ("recv", "backward")] if rank == 0 else [("recv", "forward"), ("send", "backward")]
    assert sorted(p2p(est)) == sorted((op, phase, rank, mb, peer, ACT, ACT if op == "send" else 0)
                                      for mb in range(M) for op, phase in kinds)


@pytest.mark.parametrize("rank", [0, 1])
def test_traced_stages_in_a_v_shaped_zero_bubble_schedule(rank):
    """Four traced stages (a block each; the last with the head) on 2 ranks, V-shaped: per micro-batch a block is
    2+2 ONE forward (up, down), 2+4 backward on stage 0 (no input gradient into the first matmul), 4+4 elsewhere;
    the head 1 forward, 2 backward. The real step's FLOPs are n_microbatches x the estimate's, and its send/recv
    are the estimate's in order from the second real step on (the first adds the traced stages' warm-up)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    held = ((0, 3), (1, 2))[rank]
    with fake_world(rank, 2):
        torch.manual_seed(0)
        pipe = pipeline(Blocks(), (torch.randn(MB, W),),
                        split_spec={f"layers.{i}": SplitPoint.BEGINNING for i in (1, 2, 3)})
        schedule = ScheduleZBVZeroBubble([pipe.build_stage(i, torch.device("cpu")) for i in held], M, loss_fn=loss)
        args, kwargs = step_inputs(rank == 0, rank == 0)
        est = fxflops.estimate(schedule, args, dict(kwargs), conventions="torch")
        schedule.step(*args, **kwargs)
        log = StepLog()
        with log:
            schedule.step(*args, **kwargs)
    block = {0: 4 + 6, 1: 4 + 8, 2: 4 + 8, 3: 4 + 8 + 3}  # forward + backward of each stage
    assert [(role.name, role.estimate.total_flops) for role in est.ranks] == [
        (f"pipeline stage {index}", block[index] * ONE) for index in held]
    assert [name for name in est.ranks[0].estimate.modules if name.count(".") == 1] == [f"layers.{held[0]}"]
    assert log.flops == M * sum(role.estimate.total_flops for role in est.ranks)
    assert [(c.op, c.bytes, c.peer) for c in est.collectives] == log.p2p
    assert len(log.p2p) == 2 * 2 * M  # one boundary to the other rank per stage, each way, per micro-batch
