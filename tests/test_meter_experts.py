"""The meter with torchtitan's experts: grouped experts handed the tokens sorted by expert and the tokens per
expert (`GroupedExperts(x, num_tokens_per_expert)`, a for-loop over `.tolist()` splits or `torch._grouped_mm`
over the counts' offsets), alone and under torchtitan's expert parallelism (its dispatch and combine
hooks, on torch's fake process group here; on 2 gloo processes in
test_a_real_two_rank_expert_parallel_job_meters_each_ranks_received_tokens). Each micro-batch is counted at
the tokens this rank's experts received in that forward, read from the experts' own inputs.

Hand counts, torch conventions (matmuls only; `_grouped_mm`, which FlopCounterMode has no formula for,
counted as its rows x in x out products): dim D = hidden H = 8, 4 experts, top-1 router fixed so a token
goes to the expert named by its largest of the first 4 features. The router costs 2·T·D·4 forward and
nothing backward (argmax passes no gradient); an expert row costs 2 x 2·D·H forward and 3 x 2·D·H
backward (two weight gradients and the hidden's gradient: the tokens need none).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.flop_counter import FlopCounterMode

from fxflops import FlopsMeter
from fxflops.timing.meter import FlopsMeterWarning
from tests.moe_models import ExpertParallel, TitanMoE, fake_all_to_all_writes_its_output, routed_batch

D = H = 8
EXPERTS, SEQ = 4, 5
DIMS = {"batch": 0, "seq": 1}
ROUTINGS = ([0, 0, 1, 2, 2, 2, 3, 0, 1, 1], [3, 3, 3, 3, 3, 3, 3, 3, 0, 1], [1] * 10)


def hand(tokens: int, rows: int) -> tuple[int, int]:
    """(forward, backward) FLOPs of a step routing `tokens` tokens whose experts here ran `rows` rows."""
    return 2 * tokens * D * EXPERTS + rows * 2 * 2 * D * H, rows * 3 * 2 * D * H


def counts(picks: list[int]) -> list[int]:
    return [picks.count(e) for e in range(EXPERTS)]


def metered(meter: FlopsMeter, model: torch.nn.Module, x: torch.Tensor) -> tuple:
    with meter.observe():
        with FlopCounterMode(display=False) as counter:
            model(x).sum().backward()
        counted = meter.micro_batch(x)
    model.zero_grad()
    stats = meter.step(time=1.0)
    return counted, stats, counter.get_total_flops()


@pytest.fixture
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlopsMeterWarning)  # nothing goes uncounted
        warnings.filterwarnings("ignore", message=".*peak.*")  # no MFU on a CPU
        yield


def test_grouped_experts_count_the_tokens_per_expert_they_were_handed(quiet) -> None:
    """One rank: the experts' total does not depend on the split (every token meets one expert), but each
    expert's tokens are read from the counts it was handed, and the count equals FlopCounterMode's."""
    model = TitanMoE(D, H, EXPERTS)
    meter = FlopsMeter(model, routed_batch(ROUTINGS[0], D, SEQ), dims=DIMS, conventions="torch")
    for picks in ROUTINGS:
        counted, stats, oracle_flops = metered(meter, model, routed_batch(picks, D, SEQ))
        assert (counted.fwd_flops, counted.bwd_flops) == hand(10, 10) == (640 + 2560, 3840)
        assert stats.flops == oracle_flops
        assert stats.routed_rows == {f"experts[{e}]": c for e, c in enumerate(counts(picks))}
    assert meter.captures == 1


@pytest.fixture
def ep_mesh():
    """Rank 0 of 2 on torch's fake process group: its collectives copy this rank's own chunks, so every
    rank routes as this one does (the routing of fxflops' plans); rank 0 holds experts 0 and 1."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        if not fake_all_to_all_writes_its_output():
            pytest.skip(f"torch {torch.__version__}: the fake process group leaves all_to_all_single's output "
                        "unwritten (the routing counts this test reads)")
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("grouped_mm", [False, True], ids=["for_loop", "grouped_mm"])
@pytest.mark.parametrize("first_step", ["example_batch", "observed"])
def test_expert_parallel_ranks_count_the_tokens_their_experts_received(quiet, ep_mesh, grouped_mm: bool,
                                                                       first_step: str) -> None:
    """Under torchtitan's expert parallelism each step counts the rows the all-to-all delivered to this
    rank's experts: 2 ranks x the tokens each routed to experts 0 and 1. Built without an example batch,
    the first step is counted too (every module watched until the first capture)."""
    model = TitanMoE(D, H, EXPERTS, grouped_mm)
    ExpertParallel(ep_mesh).apply(model.experts)
    example = routed_batch(ROUTINGS[0], D, SEQ) if first_step == "example_batch" else None
    meter = FlopsMeter(model, example, dims=DIMS, conventions="torch")
    totals = []
    for picks in ROUTINGS:
        counted, stats, oracle_flops = metered(meter, model, routed_batch(picks, D, SEQ))
        local = [2 * c for c in counts(picks)[:2]]  # rank 0's experts, from each of the 2 ranks
        assert (counted.fwd_flops, counted.bwd_flops) == hand(10, sum(local))
        if grouped_mm:
            assert stats.flops - oracle_flops == sum(local) * 5 * 2 * D * H  # FlopCounterMode misses _grouped_mm
            assert stats.routed_rows == {"experts": sum(local)}
        else:
            assert stats.flops == oracle_flops
            assert stats.routed_rows == {"experts[0]": local[0], "experts[1]": local[1]}
        totals.append(stats.flops)
    # rows 2·(3+3), 2·(1+1) and 2·(0+10): 640 + 256·rows forward, 384·rows backward
    assert totals == [640 + 640 * 12, 640 + 640 * 4, 640 + 640 * 20]
    assert meter.captures == 1
    assert all(not m._forward_pre_hooks or m is model.experts for m in model.modules())  # only EP's own hooks


def test_a_real_two_rank_expert_parallel_job_meters_each_ranks_received_tokens(tmp_path) -> None:
    """tests/distributed_meter.py `ep`: torchtitan's expert parallelism over 2 gloo processes, each rank
    routing its own batches; each rank logs the rows its two experts received from both ranks, its local
    FLOPs at those rows (the first step too: the meter is built without an example), the job's total their
    all-reduced sum."""
    import json

    from tests.distributed_meter import EP_ROUTINGS
    from tests.torchrun import torchrun

    done = torchrun("distributed_meter.py", "ep", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = [json.loads((tmp_path / f"ep-rank{rank}.json").read_text()) for rank in range(2)]
    job = 0
    for rank, seen in enumerate(ranks):
        expected_rows, expected_flops = [], []
        for step in range(len(EP_ROUTINGS[0])):
            # rank r holds experts 2r and 2r+1: from each rank, the tokens that rank routed to them
            got = [sum(counts(EP_ROUTINGS[source][step])[2 * rank + e] for source in range(2)) for e in range(2)]
            expected_rows.append({f"experts[{e}]": got[e] for e in range(2)})
            expected_flops.append(sum(hand(10, sum(got))))
        assert seen["rows"] == expected_rows
        assert seen["local"] == expected_flops
        job += sum(expected_flops)
    # a hand check of the first step: rank 0 routed 3 and 3 tokens to experts 0 and 1, rank 1 routed 1 and 4
    assert ranks[0]["rows"][0] == {"experts[0]": 3 + 1, "experts[1]": 3 + 4}
    assert ranks[0]["local"][0] == 640 + 640 * 11
    assert ranks[0]["job"] == ranks[1]["job"] == job


def test_experts_handed_two_candidate_count_tensors_are_refused_in_one_line(quiet) -> None:
    from tests.moe_models import TitanExperts

    class Ambiguous(TitanExperts):
        def forward(self, x, num_tokens_per_expert, also):
            return super().forward(x, num_tokens_per_expert)

    class Layer(TitanMoE):
        def forward(self, x):
            flat = x.reshape(-1, D)
            picks = self.router(flat).argmax(-1)
            counts = torch.histc(picks.float(), bins=EXPERTS, min=0, max=EXPERTS).long()
            order = torch.argsort(picks, stable=True)
            return self.experts(flat[order], counts, torch.arange(EXPERTS)).sum()

    model = Layer(D, H, EXPERTS)
    model.experts = Ambiguous(D, H, EXPERTS, grouped_mm=False)
    x = routed_batch(ROUTINGS[0], D, SEQ)
    meter = FlopsMeter(model, x, dims=DIMS, conventions="torch")
    with pytest.raises(FlopsMeterWarning, match=r"^fxflops.FlopsMeter: a micro-batch was not counted: 'experts' was "
                                                r"called with 2 1-D integer tensors of 4 elements, where its capture "
                                                r"read its tokens per expert from one$"):
        with meter.observe():
            model(x).backward()
            meter.micro_batch(x)
