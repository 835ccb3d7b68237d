"""DDP's gradient buckets in what-if plans (fsdp=False): one all-reduce per bucket, the buckets as torch's
DDP Reducer assigns them (torch.distributed._compute_bucket_assignment_by_size, the oracle here, over the
gradients in reverse registration order with DDP's limits: a 1 MiB first bucket, then bucket_cap_mb)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxflops
from tests.parallel_models import Llama

FP32, MIB = 4, 1 << 20


def llama(vocab: int, dim: int, hidden: int) -> Llama:
    with torch.device("meta"):
        return Llama(vocab, dim, 2, 8, hidden)


def plan_estimate(model, **plan):
    est = fxflops.estimate(model, (torch.zeros(1, 8, dtype=torch.long),), conventions="torch", backward=True,
                           parallel={"fsdp": False, **plan})
    assert not dist.is_initialized()
    return est


def torchs_buckets(model, limits: list[int]) -> list[int]:
    """The bytes of each bucket torch's Reducer makes of the model's gradients, ready last layer first."""
    params = list(reversed(list(model.parameters())))
    buckets, _ = dist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
    return [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in buckets]


def reductions(est):
    return [c for c in est.collectives if c.op == "all_reduce"]


def test_the_default_buckets_are_a_1_mib_first_bucket_then_25_mib():
    vocab, dim, hidden = 4096, 256, 512
    model = llama(vocab, dim, hidden)
    est = plan_estimate(model, dp=4)
    head = vocab * dim * FP32  # 4 MiB: the first gradient ready, over the first bucket's 1 MiB alone
    layer = 4 * dim * dim + 3 * dim * hidden + 2 * dim
    rest = dim + 2 * layer + vocab * dim  # the final norm, the layers, the embedding: under 25 MiB
    assert [c.bytes for c in reductions(est)] == [head, rest * FP32] == torchs_buckets(model, [MIB, 25 * MIB])
    # the head's bucket is all-reduced once the head has its gradient, the second once the embedding has its
    assert [(c.module, c.group_size, c.per_step, c.wire_bytes) for c in reductions(est)] == \
        [(module, 4, True, 2 * 3 * c.bytes // 4) for module, c in zip(("output", "tok_embeddings"), reductions(est))]


@pytest.mark.parametrize("cap_mb", [0.05, 0.1, 0.25])
def test_bucket_cap_mb_sets_every_buckets_limit(cap_mb):
    model = llama(256, 64, 128)
    est = plan_estimate(model, dp=2, bucket_cap_mb=cap_mb)
    found = [c.bytes for c in reductions(est)]
    assert found == torchs_buckets(model, [int(cap_mb * MIB)])
    assert len(found) > 1 and sum(found) == sum(p.numel() for p in model.parameters()) * FP32
    # each bucket is recorded for the module whose gradient completes it, in the order they are ready
    names = [name.rpartition(".")[0] for name, _ in reversed(list(model.named_parameters()))]
    modules = [c.module for c in reductions(est)]
    assert modules == sorted(modules, key=names.index) and modules[-1] == "tok_embeddings"


def test_buckets_hold_a_tensor_parallel_ranks_shards():
    vocab, dim, hidden, tp = 256, 64, 128, 2
    est = plan_estimate(llama(vocab, dim, hidden), dp=2, tp=tp, bucket_cap_mb=0.05)
    local = 2 * vocab * dim + dim + 2 * ((4 * dim * dim + 3 * dim * hidden) // tp + 2 * dim)
    found = [c.bytes for c in reductions(est) if c.group_desc != "mesh_tp"]
    assert sum(found) == local * FP32 and all(size >= 0.05 * MIB for size in found[:-1])
    assert {c.group_desc for c in est.collectives if c.per_step} == {"mesh_dp"}


def test_bucket_cap_mb_in_the_plans_text_and_with_fsdp():
    model = llama(256, 64, 128)
    assert fxflops.Parallel.of("dp=2,fsdp=false,bucket_cap_mb=0.5").bucket_cap_mb == 0.5
    with pytest.raises(ValueError, match="bucket_cap_mb sizes DDP's gradient buckets; give it with fsdp=False"):
        fxflops.estimate(model, (torch.zeros(1, 8, dtype=torch.long),), parallel={"dp": 2, "bucket_cap_mb": 1})
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be a finite number of MiB > 0 .*; got 0"):
        plan_estimate(model, dp=2, bucket_cap_mb=0)


@pytest.mark.parametrize("cap", [0, -1.0, float("inf"), float("nan"), "8", True])
def test_a_bucket_cap_no_ddp_could_use_fails_in_one_line(cap):
    # (inf and nan used to pass the plan's check and crash in bucket_limits with OverflowError / ValueError)
    with pytest.raises(ValueError, match=r"^parallel plan: bucket_cap_mb must be a finite number of MiB > 0 "
                                         r"\(DDP's gradient bucket size\); got "):
        fxflops.Parallel.of({"dp": 2, "fsdp": False, "bucket_cap_mb": cap})


def test_each_pipeline_rank_buckets_its_own_stages_gradients():
    vocab, dim, hidden = 256, 64, 128
    est = plan_estimate(llama(vocab, dim, hidden), pp=2, dp=2)
    layer = 4 * dim * dim + 3 * dim * hidden + 2 * dim
    first, last = ([(c.module, c.bytes, c.group_size) for c in reductions(role.estimate)] for role in est.ranks)
    # one bucket each (under 1 MiB): the first stage's completes at the embedding (reduced at the end of its
    # backward), the last stage's at its layer's first parameter, the head's and final norm's before it
    assert first == [("tok_embeddings", (vocab * dim + layer) * FP32, 2)]
    assert last == [("layers.1.attention_norm", (layer + dim + dim * vocab) * FP32, 2)]


def test_the_buckets_are_those_a_real_two_rank_ddp_job_rebuilds(tmp_path):
    """tests/distributed_ddp_buckets.py: torch's own DistributedDataParallel over 2 gloo processes, its buckets
    as its Reducer rebuilt them from the real gradient order (a block's w2 before its w3: same sizes here)."""
    import json

    from tests.torchrun import torchrun

    done = torchrun("distributed_ddp_buckets.py", str(tmp_path), "0.1")
    assert done.returncode == 0, done.stderr[-2000:]
    real = json.loads((tmp_path / "buckets.json").read_text())
    est = plan_estimate(llama(256, 64, 128), dp=2, bucket_cap_mb=0.1)
    assert real["rebuilt"] == 1 and [c.bytes for c in reductions(est)] == real["sizes"]
    assert real["sizes"] == [131328, 131584, 114944, 82176]


def test_the_plans_text_says_ddps_buckets_and_the_group_gradients_are_reduced_over():
    # a DDP plan records one all-reduce per bucket: the plan line says so, with the bucket size
    model = llama(256, 64, 128)
    default = plan_estimate(model, dp=2).print(as_string=True, detailed=False)
    assert "dp=2 (DDP (torch's replicate), gradients all-reduced in DDP's buckets (DDP's default: 1 MiB first, " \
           "then 25 MiB)), 2 ranks" in default
    given = plan_estimate(model, dp=2, bucket_cap_mb=0.5).print(as_string=True, detailed=False)
    assert "gradients all-reduced in DDP's buckets of 0.5 MiB" in given
    # dp = 1 with cp = 2: the gradients are still reduced, over the cp ranks
    cp_only = fxflops.estimate(model, (torch.zeros(1, 8, dtype=torch.long),), conventions="torch",
                               parallel={"cp": 2}).print(as_string=True, detailed=False)
    assert "cp=2 (FSDP2 over cp, reshard_after_forward=True), 2 ranks" in cp_only
