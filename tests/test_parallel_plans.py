"""What-if plans: estimate(model, inputs, parallel=...) on torch.distributed's fake process group.

Per-rank FLOPs are hand counts under the torch preset (FlopCounterMode's formulas: matmuls and SDPA);
collective bytes are the closed forms of Megatron tensor parallelism and FSDP.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

import fxflops
from tests.parallel_models import Llama

V, D, L, HEADS, F, B, S = 256, 64, 2, 8, 128, 2, 16
T = B * S  # tokens of one micro-batch
FP32 = 4
ATTN_LINEAR = 4 * 2 * T * D * D  # wq, wk, wv, wo
FFN = 3 * 2 * T * D * F  # w1, w3, w2
SDPA = 2 * (2 * B * HEADS * S * S * (D // HEADS))  # q @ k^T and p @ v (dense, as FlopCounterMode)
HEAD = 2 * T * D * V
PARAMS = V * D * 2 + D + L * (4 * D * D + 3 * D * F + 2 * D)


def fwd(tp: int, head_split: bool = False) -> int:
    return L * (ATTN_LINEAR + FFN + SDPA) // tp + HEAD // (tp if head_split else 1)


def bwd(tp: int, head_split: bool = False) -> int:
    # grad input + grad weight of every matmul (all inputs need a gradient: the embedding is trained);
    # SDPA's backward under FlopCounterMode: 5 products of the forward's size (scores recomputed)
    return L * (2 * (ATTN_LINEAR + FFN) + 5 * SDPA // 2) // tp + 2 * HEAD // (tp if head_split else 1)


@pytest.fixture(scope="module")
def llama():
    with torch.device("meta"):
        return Llama(V, D, L, HEADS, F)


def tokens():
    return torch.zeros(B, S, dtype=torch.long)


def plan_estimate(model, **plan):
    est = fxflops.estimate(model, (tokens(),), conventions="torch", backward=True, parallel=plan)
    assert not dist.is_initialized()  # the fake group is gone again
    return est


def by_phase_op(est) -> dict[tuple[str, str], tuple[int, int]]:
    return {key: (value["count"], value["bytes"]) for key, value in est.collective_totals(("phase", "op")).items()}


def test_no_plan_is_the_single_device_count(llama):
    est = plan_estimate(llama)
    assert (est.fwd_flops, est.bwd_flops) == (fwd(1), bwd(1)) == (6_553_600, 13_238_272)
    assert est.collectives == [] and [r.ranks for r in est.ranks] == [(0,)]


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_megatron_tp_flops_and_two_all_reduces_per_layer_each_way(llama, tp):
    est = plan_estimate(llama, tp=tp)
    assert (est.fwd_flops, est.bwd_flops) == (fwd(tp), bwd(tp))
    activations = T * D * FP32  # b*s*h
    assert by_phase_op(est) == {("forward", "all_reduce"): (2 * L, 2 * L * activations),
                                ("backward", "all_reduce"): (2 * L, 2 * L * activations)}
    assert {c.module for c in est.collectives if c.phase == "forward"} == \
        {f"layers.{i}.{m}" for i in range(L) for m in ("attention.wo", "feed_forward.w2")}
    assert est.parallel["tp"] == tp and est.ranks[0].ranks == tuple(range(tp))
    # the rank's parameters: its shards of the block linears, the embedding, norms and head whole
    assert est.total_params == V * D * 2 + D + L * ((4 * D * D + 3 * D * F) // tp + 2 * D)
    assert est.job_flops == tp * est.total_flops


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sequence_parallel_moves_the_same_bytes_as_all_gather_and_reduce_scatter(llama, tp):
    est = plan_estimate(llama, tp=tp, sequence_parallel=True)
    assert (est.fwd_flops, est.bwd_flops) == (fwd(tp, head_split=True), bwd(tp, head_split=True))
    plain = plan_estimate(llama, tp=tp)
    activations = T * D * FP32

    def in_layers(e, phase):
        return [c for c in e.collectives if c.module.startswith("layers.") and c.phase == phase]

    for phase in ("forward", "backward"):
        sp = in_layers(est, phase)
        assert sorted(c.op for c in sp) == ["all_gather"] * 2 * L + ["reduce_scatter"] * 2 * L
        assert all(c.bytes == activations for c in sp)
        assert sum(c.wire_bytes for c in sp) == sum(c.wire_bytes for c in in_layers(plain, phase))
    # outside the layers: the vocabulary-parallel embedding's reduce-scatter, the head's all-gather of its
    # input and of the logits (forward); their gradients' all-gather and reduce-scatter (backward)
    assert by_phase_op(est)[("forward", "all_gather")] == (2 * L + 2, (2 * L + 1) * activations + T * V * FP32)
    assert by_phase_op(est)[("backward", "reduce_scatter")] == (2 * L + 1, (2 * L + 1) * activations)


@pytest.mark.parametrize("dp", [2, 8])
@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_gathers_parameters_and_reduce_scatters_gradients(llama, dp, reshard):
    est = plan_estimate(llama, dp=dp, reshard_after_forward=reshard)
    assert (est.fwd_flops, est.bwd_flops) == (fwd(1), bwd(1))  # each rank runs its own micro-batch whole
    groups = L + 1  # one fully_shard per layer, and the root
    expected = {("forward", "all_gather"): (groups, PARAMS * FP32),
                ("backward", "reduce_scatter"): (groups, PARAMS * FP32)}
    if reshard:
        expected[("backward", "all_gather")] = (groups, PARAMS * FP32)
    assert by_phase_op(est) == expected
    assert all(c.group_size == dp and c.wire_bytes == (dp - 1) * c.bytes // dp for c in est.collectives)


@pytest.mark.parametrize(("dp", "shard"), [(4, 2), (8, 2), (8, 4)])
def test_hsdp_shards_within_groups_and_all_reduces_across_replicas(llama, dp, shard):
    est = plan_estimate(llama, dp=dp, dp_shard=shard)
    groups = L + 1
    assert {key: (total["count"], total["bytes"]) for key, total in
            est.collective_totals(("phase", "op", "group_desc", "group_size")).items()} == {
        ("forward", "all_gather", "mesh_dp_shard", shard): (groups, PARAMS * FP32),
        ("backward", "all_gather", "mesh_dp_shard", shard): (groups, PARAMS * FP32),
        ("backward", "reduce_scatter", "mesh_dp_shard", shard): (groups, PARAMS * FP32),
        # each replica group sums the gradient shard the reduce-scatter left
        ("backward", "all_reduce", "mesh_dp_replicate", dp // shard): (groups, PARAMS * FP32 // shard)}
    assert est.total_params == PARAMS // shard and est.ranks[0].ranks == tuple(range(dp))


def test_fsdp_with_tp_gathers_the_tensor_parallel_shards(llama):
    est = plan_estimate(llama, dp=2, tp=2)
    assert (est.fwd_flops, est.bwd_flops) == (fwd(2), bwd(2))
    # tp shards the block linears; embedding, norms and the head stay whole on each tp rank
    local_params = V * D * 2 + D + L * ((4 * D * D + 3 * D * F) // 2 + 2 * D)
    totals = by_phase_op(est)
    assert totals[("forward", "all_gather")] == (L + 1, local_params * FP32)
    assert totals[("forward", "all_reduce")] == (2 * L, 2 * L * T * D * FP32)
    sizes = {(c.op, c.group_size) for c in est.collectives}
    assert sizes == {("all_gather", 2), ("reduce_scatter", 2), ("all_reduce", 2)}
    assert est.ranks[0].ranks == (0, 1, 2, 3) and est.job_flops == 4 * est.total_flops
    assert est.total_params == local_params // 2  # after the step, FSDP holds its half of the tp shard


def test_a_user_plan_wins(llama):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"layers.*.feed_forward.w1": ColwiseParallel(), "layers.*.feed_forward.w3": ColwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel()}
    est = plan_estimate(llama, tp=2, tp_plan=plan)
    assert est.fwd_flops == L * (ATTN_LINEAR + SDPA + FFN // 2) + HEAD
    assert by_phase_op(est)[("forward", "all_reduce")][0] == L


def test_the_model_is_left_as_it_was(llama):
    before = {name: (type(p), p.shape) for name, p in llama.named_parameters()}
    classes = {name: type(m) for name, m in llama.named_modules()}
    plan_estimate(llama, tp=2, dp=2)
    plan_estimate(llama, dp=2)  # a second plan on the same model (torch's table of FSDP states restored)
    assert {name: (type(p), p.shape) for name, p in llama.named_parameters()} == before
    assert {name: type(m) for name, m in llama.named_modules()} == classes
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in llama.modules())


def test_parallel_dataclass_and_text_are_the_same_plan(llama):
    a = fxflops.estimate(llama, (tokens(),), conventions="torch", parallel=fxflops.Parallel(tp=2, dp=2))
    b = fxflops.estimate(llama, (tokens(),), conventions="torch", parallel="tp=2,dp=2")
    assert a.total_flops == b.total_flops == fwd(2)
    assert a.collective_bytes == b.collective_bytes


# --- bad plans: one clear line each -----------------------------------------------------------------


@pytest.mark.parametrize(("plan", "message"), [
    ({"tp": 3}, "tp=3 does not divide the 8 heads of layers.0.attention.n_heads"),
    ({"tp": 2, "dp": 2, "world_size": 8}, "world size 8 is not pp*dp*cp*tp = 1*2*1*2 = 4"),
    ({"pp": 3}, "pp=3 stages for 2 layers; pp can be at most 2"),
    ({"tp": 2, "tp_plan": {"layers.*.mlp.up": None}}, "tp_plan names module 'layers.*.mlp.up', which Llama does not have"),
    ({"tp": 0}, "tp must be a whole number >= 1; got 0"),
    ({"tpp": 2}, "unknown key 'tpp'"),
    ({"dp": 4, "dp_shard": 3}, "dp_shard=3 must divide dp=4"),
    ({"sequence_parallel": True}, "sequence_parallel splits the sequence over the tp ranks; give tp > 1"),
])
def test_bad_plans_are_one_clear_line(llama, plan, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")) as caught:
        fxflops.estimate(llama, (tokens(),), parallel=plan)
    assert "\n" not in str(caught.value)
    assert not dist.is_initialized()


def test_a_plan_inside_an_initialized_group_is_refused(llama):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(ValueError, match="already initialized"):
            fxflops.estimate(llama, (tokens(),), parallel={"tp": 2})
        assert dist.is_initialized()  # the user's own group untouched
    finally:
        dist.destroy_process_group()


def test_a_model_without_recognized_blocks_needs_a_tp_plan():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="found no attention or MLP block in Sequential"):
        fxflops.estimate(model, (torch.randn(2, 8),), parallel={"tp": 2})
    assert not dist.is_initialized()


def test_hf_llama_with_grouped_kv_heads_under_tp(llama):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                         num_attention_heads=HEADS, num_key_value_heads=4, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    est = fxflops.estimate(model, (tokens(),), conventions="torch", parallel={"tp": 2})
    kv = 4 * (D // HEADS)
    attention_linear = 2 * T * D * (2 * D + 2 * kv)  # q and o: D x D; k and v: D x kv
    assert est.total_flops == L * (attention_linear + FFN + SDPA) // 2 + HEAD
    assert by_phase_op(est) == {("forward", "all_reduce"): (2 * L, 2 * L * T * D * FP32)}
    with pytest.raises(ValueError, match="tp=8 does not divide the 4 heads of config.num_key_value_heads"):
        fxflops.estimate(model, (tokens(),), parallel={"tp": 8})


def test_the_plan_in_the_text_report_json_and_cli(llama, tmp_path, capsys):
    from fxflops.cli.main import main

    est = fxflops.estimate(llama, (tokens(),), conventions="torch", parallel={"tp": 2, "dp": 2})
    text = est.print(as_string=True, detailed=False)
    assert "dp=2, tp=2 (FSDP2, reshard_after_forward=True), 4 ranks" in text
    assert f"job flops (every rank):{' ' * 39}{4 * fwd(2):,}" in text
    record = est.to_dict()
    assert record["parallel"]["tp"] == 2 and record["job_flops"] == 4 * fwd(2)
    assert record["ranks"] == [{"name": "every rank", "ranks": [0, 1, 2, 3], "flops": fwd(2),
                                "collective_wire_bytes": est.collective_wire_bytes}]

    factory = tmp_path / "llama.py"
    factory.write_text("from tests.parallel_models import Llama\n"
                       "class Tokens(Llama):\n    def forward(self, input_ids):\n        return super().forward(input_ids)\n"
                       f"def build():\n    return Tokens({V}, {D}, {L}, {HEADS}, {F})\n")
    code = main([f"{factory}:build", "--input-shape", f"input_ids={B},{S}", "--parallel", "tp=2,dp=2",
                 "--conventions", "torch", "--format", "json", "-q"])
    out = capsys.readouterr().out
    assert code == 0, out
    import json

    assert json.loads(out)["totals"]["flops"] == fwd(2)
    assert main([f"{factory}:build", "--input-shape", f"input_ids={B},{S}", "--parallel", "tp=3", "-q"]) == 1
    assert "tp=3 does not divide the 8 heads" in capsys.readouterr().err


def test_a_real_two_rank_gloo_job_counts_what_the_fake_plan_predicted(tmp_path):
    import json

    from tests.torchrun import torchrun

    done = torchrun("distributed_parallel.py", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    with torch.device("meta"):
        predicted = fxflops.estimate(Llama(), (tokens(),), conventions="torch", backward=True, parallel={"tp": 2})
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (seen["fwd"], seen["bwd"]) == (predicted.fwd_flops, predicted.bwd_flops) == (fwd(2), bwd(2))
        assert seen["collectives"] == seen["torch_collectives"] == len(predicted.collectives) == 4 * L
        assert seen["wire"] == predicted.collective_wire_bytes


def test_a_plans_estimate_explains_compares_and_pickles(llama):
    import pickle

    est = plan_estimate(llama, tp=2)
    assert "aten.mm.default" in str(est.explain("layers.0.attention"))
    assert est.compare() is not None
    again = pickle.loads(pickle.dumps(est))
    assert again.ranks[0].ranks == (0, 1) and again.collectives == est.collectives


class _WidthFromInputAttention(torch.nn.Module):
    """A fused q|k|v projection split at the INPUT's width (nanoGPT's way): right on one device, wrong on a
    tensor-parallel rank, whose c_attn output is 3·h/tp wide."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.c_attn = torch.nn.Linear(h, 3 * h)
        self.c_proj = torch.nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=2)
        return self.c_proj(q * k + v)


def test_a_capture_the_derived_tp_plan_breaks_says_what_the_model_must_do() -> None:
    from fxflops.capture.diagnosis import CaptureError

    with torch.device("meta"):
        model = torch.nn.Sequential(*(_WidthFromInputAttention(16) for _ in range(2)))
    with pytest.raises(CaptureError) as caught:
        fxflops.estimate(model, (torch.randn(2, 4, 16, device="meta"),), parallel={"tp": 2})
    line = caught.value.summary()
    assert "\n" not in line and "under tp=2 the derived Megatron-style plan" in line and "tp_plan=" in line
    assert not dist.is_initialized()
