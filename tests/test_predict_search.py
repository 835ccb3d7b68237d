"""The plan search (fxflops.plan / `fxflops plan`): enumeration, memory filter, ranking, outputs."""

from __future__ import annotations

import csv
import io
import json
import warnings

import pytest
import torch

import fxflops
from fxflops.cli.main import main
from fxflops.predict.hardware import cluster
from fxflops.predict.layers import LayerCosts, Part
from fxflops.predict.step_memory import OPTIMIZER_STATE_BYTES
from fxflops.predict.step import StepPlan, simulate_plan
from fxflops.predict.validation import GPT
from tests.test_html import needs_browser, read_png, run_chromium


def build(layers: int) -> GPT:
    with torch.device("meta"):
        return GPT(layers, 256, 8, vocab=1024, seq=256).to(torch.bfloat16)


@pytest.fixture(scope="module")
def search():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.plan(build, gpus=16, cluster="DGX A100 80GB", global_batch=32, seq_len=256, layers=8,
                            micro_batch=(1, 2), tp=(1, 2))


def test_plans_enumerated_ranked_and_filtered(search) -> None:
    # tp in (1, 2) x micro-batch (1, 2): 4 captures (sequence parallel at tp > 1), every other choice derived
    assert search.captures == 4
    times = [row.step_time for row in search.rows]
    assert times == sorted(times)
    assert search.evaluated == len(search.rows) + len(search.dropped) >= 100
    for row in search.rows + search.dropped:
        p = row.plan
        assert p.tp * p.pp * p.dp == 16 and 8 % (p.pp * p.virtual_stages) == 0
        assert 32 % (p.dp * p.micro_batch) == 0
        assert row.fits == (row.peak_bytes <= search.capacity)  # peak_bytes holds the 0.5 GiB allowance once
    best = search.best
    assert best.fits and best.parallel["tp"] * best.parallel["pp"] * best.parallel["dp"] == 16
    assert "a prediction, a model with stated error" in str(search)


def test_outputs_hold_every_plan(search, tmp_path) -> None:
    rows = list(csv.DictReader(io.StringIO(search.to_csv(tmp_path / "plans.csv"))))
    assert len(rows) == search.evaluated and (tmp_path / "plans.csv").exists()
    data = json.loads(search.to_json(tmp_path / "plans.json"))
    assert len(data["plans"]) == len(search.rows) and data["plans"][0]["step_time_s"] == search.best.step_time


def test_rank_memory_by_hand() -> None:
    # 8 layers of 1,000 parameters saving 100 bytes each per micro-batch; pp = 2 with 1F1B and m = 4: the first
    # stage holds 4 layers' state and 2 micro-batches in flight
    block = Part(forward=1.0, backward=2.0, params=1000, saved_bytes=100)
    costs = LayerCosts(1, False, 1, 10, 8, block, Part(), Part(), 40, 2, "bfloat16", "A100", 8)
    a100 = cluster("DGX A100 80GB")
    plan = StepPlan(pp=2, dp=2, micro_batch=1, global_batch=8, distributed_optimizer=True)
    top = simulate_plan(costs, plan, a100).peak_memory
    peak, kinds = top.total, top.by_kind
    assert kinds == {"parameters": 4 * 1000 * 2, "gradients": 4 * 1000 * 2,
                     "optimizer": 4 * 1000 * OPTIMIZER_STATE_BYTES // 2, "activations": 2 * 4 * 100,
                     "temporaries": 0}
    assert peak == sum(kinds.values()) + (512 << 20)
    # full recomputation keeps each layer's input (40 bytes); the layer whose backward runs holds its recomputed
    # activations (100) instead
    full = StepPlan(pp=2, dp=2, micro_batch=1, global_batch=8, distributed_optimizer=True, recompute="full")
    kinds = simulate_plan(costs, full, a100).peak_memory.by_kind
    assert kinds["activations"] == 2 * 4 * 40 - 40 + 100


def test_rank_memory_fsdp_by_hand() -> None:
    # FSDP over dp = 2, no pipeline: 8 layers of 1,000 parameters, an embedding of 50 and a head of 70, bf16;
    # the shards (8,120 / 2 of each), two gathered layers and the root unit (embedding, head) whole. One micro-batch:
    # FSDP2's sharded .grad is made as each layer's reduce-scatter ends (zero_grad(set_to_none=True) frees it), so
    # the peak is the first layer's backward: the head's and 7 layers' shards, one layer's whole gradients (the
    # reduce-scatter in flight), the embedding's and the first layer's activations
    block = Part(params=1000, saved_bytes=100)
    costs = LayerCosts(1, False, 1, 10, 8, block, Part(params=50, saved_bytes=6), Part(params=70, saved_bytes=8),
                       40, 2, "bfloat16", "A100", 8, (), 30)
    plan = StepPlan(dp=2, fsdp=True, micro_batch=1, global_batch=2)
    kinds = simulate_plan(costs, plan, cluster("DGX A100 80GB"), optimizer_state_bytes=4).peak_memory.by_kind
    assert kinds == {"parameters": 8120 * 2 // 2 + (2 * 1000 + 120) * 2,
                     "gradients": (70 + 7 * 1000) * 2 // 2 + 1000 * 2,
                     "optimizer": 8120 * 4 // 2, "activations": 6 + 100, "temporaries": 0}


def test_gpipe_is_enumerated_and_ranks_after_1f1b_or_is_dropped_for_memory() -> None:
    # pp = 4 stages of 2 layers, dp = 1, 16 micro-batches: GPipe's uniform bubble is 1F1B's, (p-1) stage passes,
    # so its step is no shorter; it keeps all 16 micro-batches' activations on the first stage where 1F1B keeps
    # p = 4 of them (the simulated in-flight counts)
    def search(margin: int = 0):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fxflops.plan(build, gpus=4, cluster="DGX A100 80GB", global_batch=16, seq_len=256, layers=8,
                                tp=(1,), pp=(4,), virtual_stages=(1,), micro_batch=(1,), fsdp=(False,),
                                recompute=("none",), memory_margin=margin)

    both = search()
    assert sorted(row.schedule for row in both.rows) == ["1f1b", "gpipe"] and not both.dropped
    one_f, gpipe = sorted(both.rows, key=lambda row: row.schedule)
    # equal but for the summation order (the backwards after micro-batch 0 add their gradients into .grad, so the
    # passes are not all alike): the ranking between the two is a matter of the last bit
    assert gpipe.step_time == pytest.approx(one_f.step_time, rel=1e-9)
    assert [gpipe.prediction.timeline.in_flight(0), one_f.prediction.timeline.in_flight(0)] == [16, 4]
    # stage by stage the same parameters and optimizer state; more activations (GPipe's last stage holds all 16
    # micro-batches' head and loss activations where 1F1B's holds one, so its busiest stage may be another)
    for g, o in zip(gpipe.prediction.memory, one_f.prediction.memory, strict=True):
        kept = ("parameters", "optimizer")
        assert [g.by_kind[k] for k in kept] == [o.by_kind[k] for k in kept]
        assert g.by_kind["activations"] > o.by_kind["activations"]
    assert gpipe.peak_bytes > one_f.peak_bytes
    # memory for 1F1B's peak and not GPipe's: GPipe is dropped, 1F1B is the best plan
    usable = both.capacity
    tight = search(usable - (one_f.peak_bytes + gpipe.peak_bytes) // 2)
    assert [row.schedule for row in tight.rows] == ["1f1b"] and [row.schedule for row in tight.dropped] == ["gpipe"]
    assert "gpipe" in gpipe.record()["schedule"] and " gpipe " in both.table()
    with pytest.raises(ValueError, match="schedules=\\('zb',\\)"):
        fxflops.plan(build, gpus=4, global_batch=16, seq_len=256, layers=8, schedules=("zb",))


def test_best_plan_fits_the_memory_a_capture_of_it_holds() -> None:
    # the search's best FSDP plan, captured whole on its rank (torch's fully_shard, AdamW): the parameters it
    # predicts (shards, two gathered layers, the root unit gathered) and the optimizer state are the capture's;
    # its peak is above the capture's (it holds the gradient shards and every saved activation at once, where
    # the capture's peak comes before the gradients exist and after the head's activations are freed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = fxflops.plan(build, gpus=4, cluster="DGX A100 80GB", global_batch=8, seq_len=256, layers=4,
                             micro_batch=(1,), tp=(1, 2), fsdp=(True,), recompute=("none",), optimizer_state_bytes=4)
        best = found.best
        est = fxflops.estimate(build(4), (torch.zeros(best.plan.micro_batch, 256, dtype=torch.long),),
                               parallel=best.parallel, backward=True, optimizer="adamw", memory=True)
    captured = est.memory
    tensors = captured.by_kind
    assert best.memory["parameters"] == tensors["parameters"] + tensors["gathered"]
    # torch's AdamW keeps a 4-byte step counter per parameter tensor beside its two bf16 moments
    counters = 4 * sum(1 for p in build(4).parameters())
    assert best.memory["optimizer"] == tensors["optimizer"] - counters
    assert captured.peak_bytes <= best.peak_bytes - (512 << 20)


def test_cli_plan(tmp_path, capsys) -> None:
    assert main(["plan", "gpt2-small", "--gpus", "8", "--cluster", "DGX A100 80GB", "--batch", "16",
                 "--seq-len", "128", "--micro-batch", "2", "--top", "3", "--csv", str(tmp_path / "p.csv"),
                 "--attention", "math", "--attention-dropout", "0.1", "--schedules", "gpipe"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plans for 8 x A100 80GB SXM (DGX A100 80GB), global batch 16:")
    assert len([line for line in out.splitlines() if line[:3].strip().isdigit()]) == 3
    rows = list(csv.DictReader(io.StringIO((tmp_path / "p.csv").read_text())))
    assert (tmp_path / "p.csv").read_text().startswith("tp,pp,virtual_stages,schedule")
    # --schedules gpipe: the plans with pp > 1 and one chunk a stage run GPipe (none 1F1B)
    assert {row["schedule"] for row in rows if row["pp"] != "1" and row["virtual_stages"] == "1"} == {"gpipe"}


def test_cli_plan_takes_every_attention_kernel_predict_step_takes() -> None:
    """`--attention` offers what plan() / predict_step take (op_time.ATTENTION_KERNELS), cuDNN's kernels included."""
    from fxflops.cli.plan import build_parser
    from fxflops.predict.op_time import ATTENTION_KERNELS

    for kernel in ATTENTION_KERNELS:
        args = build_parser().parse_args(["gpt2-small", "--gpus", "8", "--batch", "16", "--seq-len", "128",
                                            "--attention", kernel])
        assert args.attention == kernel


def test_cli_plan_errors_are_one_line(capsys) -> None:
    assert main(["plan", "gpt2-small", "--gpus", "8", "--cluster", "DGX Z9", "--batch", "16", "--seq-len", "128"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fxflops: error:") and len(err.strip().splitlines()) == 1


def test_frontier_by_hand() -> None:
    # (GiB, s): (10, 5) (15, 6) (20, 3) (30, 3) (40, 1): (15, 6) and (30, 3) are beaten on both counts
    from types import SimpleNamespace

    from fxflops.predict.frontier import frontier_rows

    rows = [SimpleNamespace(peak_bytes=gib << 30, step_time=s) for gib, s in ((30, 3), (10, 5), (40, 1), (15, 6),
                                                                               (20, 3))]
    assert [(r.peak_bytes >> 30, r.step_time) for r in frontier_rows(rows)] == [(10, 5), (20, 3), (40, 1)]


@needs_browser
def test_cli_plan_draws_the_frontier(tmp_path) -> None:
    from fxflops.predict.frontier import COLOURS

    page = tmp_path / "plans.html"
    assert main(["plan", "gpt2-small", "--gpus", "8", "--cluster", "DGX A100 80GB", "--batch", "16",
                 "--seq-len", "128", "--micro-batch", "2", "--html", str(page)]) == 0
    text = page.read_text()
    assert text.count("<circle") >= 10 and "<polyline" in text and "frontier: tp=" in text
    shot = tmp_path / "plans.png"
    done = run_chromium(f"--screenshot={shot}", "--window-size=960,600", url=page.as_uri())
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    _, _, pixels = read_png(shot.read_bytes())
    seen = {pixels[i:i + 3] for i in range(0, len(pixels), 3)}
    for kind in ("fits", "frontier", "capacity"):
        assert bytes.fromhex(COLOURS[kind][1:]) in seen, f"{kind} is not drawn"


def test_cli_plan_tries_the_context_and_expert_parallel_degrees_it_is_given(tmp_path, capsys) -> None:
    table = tmp_path / "p.csv"
    assert main(["plan", "gpt2-small", "--gpus", "8", "--cluster", "DGX A100 80GB", "--batch", "16", "--seq-len", "128",
                 "--micro-batch", "2", "--cp", "1", "2", "--ep", "1", "2", "--csv", str(table)]) == 0
    out = capsys.readouterr().out
    rows = table.read_text().splitlines()
    cp_column = rows[0].split(",").index("cp")
    assert any(row.split(",")[cp_column] == "2" for row in rows[1:])  # cp=2 plans evaluated
    assert "note: ep=2 at tp=1, micro-batch 2 left out: parallel plan: ep=2 found no experts in GPT2" in out


def test_math_attention_keeps_the_probabilities_for_the_backward() -> None:
    # build(2): 8 heads, 256 positions, micro-batch 1, bf16. Unfused attention keeps the probabilities P
    # (8 x 256 x 256 elements of 2 bytes) per layer; with attention dropout also its one-byte mask and the
    # dropped probabilities (2 + 1 + 2 bytes a pair, Korthikanti et al.'s 5 a s^2 b); the fused op keeps none
    from fxflops.predict.op_time import Kernels
    from fxflops.predict.step import capture_costs

    a100, ids = cluster("DGX A100 80GB"), torch.zeros(1, 256, dtype=torch.long)
    blocks = {kernels: capture_costs(build(2), ids, a100, memory=True, kernels=kernels).block
              for kernels in (Kernels(), Kernels("math"), Kernels("math", 0.1))}
    flash, math_, dropped = blocks.values()
    assert flash.attention_saved_bytes == 0
    assert math_.attention_saved_bytes == math_.saved_bytes - flash.saved_bytes == 8 * 256 * 256 * 2
    assert dropped.attention_saved_bytes == dropped.saved_bytes - flash.saved_bytes == 8 * 256 * 256 * 5


def test_rank_memory_selective_recomputation_frees_unfused_attention_by_hand() -> None:
    # as test_rank_memory_by_hand, 30 of each layer's 100 saved bytes unfused attention's probabilities: selective
    # recomputation keeps 70 a layer and micro-batch, plus one layer's 30 while its backward recomputes them
    block = Part(forward=1.0, backward=2.0, params=1000, saved_bytes=100, attention_saved_bytes=30)
    costs = LayerCosts(1, False, 1, 10, 8, block, Part(), Part(), 40, 2, "bfloat16", "A100", 8)
    a100 = cluster("DGX A100 80GB")
    for recompute, activations in (("none", 2 * 4 * 100), ("selective", 2 * 4 * 70 + 30),
                                   ("full", 2 * 4 * 40 - 40 + 100)):
        plan = StepPlan(pp=2, dp=2, micro_batch=1, global_batch=8, distributed_optimizer=True, recompute=recompute)
        assert simulate_plan(costs, plan, a100).peak_memory.by_kind["activations"] == activations


def test_plan_with_math_attention_counts_the_probabilities_and_drops_what_no_longer_fits() -> None:
    # one GPU, 4 layers, one micro-batch in flight: the math plan holds 4 x 8 x 256 x 256 x 2 bytes more
    # activations without recomputation, one layer's worth with selective recomputation
    def search(attention: str, margin: int = 0):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fxflops.plan(build, gpus=1, cluster="DGX A100 80GB", global_batch=2, seq_len=256, layers=4,
                                micro_batch=(1,), recompute=("none", "selective"), attention=attention,
                                memory_margin=margin)

    flash, math_ = search("flash"), search("math")
    by = {(r.plan.recompute,): r for r in flash.rows}
    for row in math_.rows:
        extra = row.memory["activations"] - by[(row.plan.recompute,)].memory["activations"]
        assert extra == (4 if row.plan.recompute == "none" else 1) * 8 * 256 * 256 * 2
    # memory for the flash plan and not the math one: the math search drops it
    none_flash, none_math = by[("none",)], next(r for r in math_.rows if r.plan.recompute == "none")
    usable = flash.capacity
    tight = search("math", usable - (none_flash.peak_bytes + none_math.peak_bytes) // 2)
    assert [r.plan.recompute for r in tight.dropped] == ["none"]
    assert "none" in [r.plan.recompute for r in search("flash", usable - (none_flash.peak_bytes
                                                                         + none_math.peak_bytes) // 2).rows]


def test_plan_takes_the_pipeline_engine_and_fused_pointwise_chains() -> None:
    # 4 GPUs, 8 layers, 16 micro-batches: under DeepSpeed's engine no plan has virtual stages, GPipe or FSDP with a
    # pipeline (its TrainSchedule is a non-interleaved 1F1B; it refuses ZeRO-2/3 with pp), and each plan's step is
    # the one predicted with pipeline_engine="deepspeed"
    def search(**options):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fxflops.plan(build, gpus=4, cluster="DGX A100 80GB", global_batch=16, seq_len=256, layers=8,
                                tp=(1,), micro_batch=(1,), recompute=("none",), **options)

    megatron, deepspeed = search(), search(pipeline_engine="deepspeed")
    assert any(r.plan.virtual_stages > 1 for r in megatron.rows) and any(r.schedule == "gpipe" for r in megatron.rows)
    assert any(r.plan.fsdp and r.plan.pp > 1 for r in megatron.rows)
    everything = deepspeed.rows + deepspeed.dropped
    assert everything and all(r.plan.pipeline_engine == "deepspeed" and r.schedule == "1f1b" for r in everything)
    assert not any(r.plan.fsdp and r.plan.pp > 1 for r in everything)
    assert any("pipeline_engine='deepspeed'" in note for note in deepspeed.notes)
    assert {r.record()["pipeline_engine"] for r in everything} == {"deepspeed"}
    # the same plan under each engine: DeepSpeed's blocking sends lengthen the pipelined step
    plain = {(r.plan.pp, r.plan.dp, r.plan.fsdp): r for r in megatron.rows if r.schedule == "1f1b"
             and r.plan.virtual_stages == 1}
    piped = [r for r in deepspeed.rows if r.plan.pp > 1]
    assert piped and all(r.step_time > plain[(r.plan.pp, r.plan.dp, r.plan.fsdp)].step_time for r in piped)
    # fused pointwise chains: the same plans, each with less compute
    fused = {(r.plan.pp, r.plan.dp, r.plan.fsdp, r.schedule, r.plan.virtual_stages): r
             for r in search(fuse_elementwise=True).rows}
    for r in megatron.rows:
        twin = fused[(r.plan.pp, r.plan.dp, r.plan.fsdp, r.schedule, r.plan.virtual_stages)]
        assert twin.prediction.breakdown["compute"] < r.prediction.breakdown["compute"]
    # apex's persistent layer norm (A100: 0.617 / 0.571 of 2,039 GB/s against the fused one's 0.439 / 0.281): the
    # same plans, each with less compute, and the search says which kernels every plan assumed, as predict_step does
    persistent = search(persistent_norm=True, fuse_elementwise=True)
    quicker = {(r.plan.pp, r.plan.dp, r.plan.fsdp, r.schedule, r.plan.virtual_stages): r for r in persistent.rows}
    for key, r in fused.items():
        assert quicker[key].prediction.breakdown["compute"] < r.prediction.breakdown["compute"]
    assert "layer norms timed as apex's persistent fast layer norm (persistent_norm=True)" in persistent.notes
    assert "each chain of pointwise ops timed as one fused kernel (fuse_elementwise=True)" in persistent.notes
    assert not any("persistent_norm" in note or "fuse_elementwise" in note for note in megatron.notes)
    with pytest.raises(ValueError, match="pipeline_engine='zero'"):
        search(pipeline_engine="zero")


def test_cli_plan_fuse_elementwise_and_pipeline_engine(tmp_path, capsys, monkeypatch) -> None:
    # the flags reach fxflops.plan (on gpt2-small as the CLI loads it, fused chains change no predicted time;
    # test_plan_takes_the_pipeline_engine_and_fused_pointwise_chains checks their effect)
    import fxflops.predict.search as search_module

    given = {}
    real = search_module.plan

    def spy(*args, **kwargs):
        given.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(search_module, "plan", spy)
    table = tmp_path / "p.csv"
    assert main(["plan", "gpt2-small", "--gpus", "8", "--cluster", "DGX A100 80GB", "--batch", "16", "--seq-len", "128",
                 "--micro-batch", "2", "--fuse-elementwise", "--pipeline-engine", "deepspeed", "--persistent-norm",
                 "--csv", str(table)]) == 0
    out = capsys.readouterr().out
    rows = list(csv.DictReader(io.StringIO(table.read_text())))
    assert rows and {row["pipeline_engine"] for row in rows} == {"deepspeed"}
    assert {row["virtual_stages"] for row in rows} == {"1"} and {row["schedule"] for row in rows} == {"1f1b"}
    assert "note: pipeline_engine='deepspeed'" in out
    assert given["fuse_elementwise"] is True and given["pipeline_engine"] == "deepspeed"
    assert given["persistent_norm"] is True


def test_plan_times_the_optimizer_as_torch_optims_kernels_when_named(capsys) -> None:
    # plan(optimizer="adamw"): every plan's step carries torch's foreach AdamW (40 B a bf16 parameter element against
    # the fused default's 28, and one launch per pass and 320 chunks), its state 2 x 2 B like the parameters; the
    # same plans, each with a longer optimizer term, and the search says which optimizer every plan assumed
    def search(**options):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fxflops.plan(build, gpus=4, cluster="DGX A100 80GB", global_batch=16, seq_len=256, layers=8,
                                tp=(1,), micro_batch=(1,), recompute=("none",), **options)

    fused, foreach = search(), search(optimizer="adamw")
    key = lambda r: (r.plan.pp, r.plan.dp, r.plan.fsdp, r.schedule, r.plan.virtual_stages, r.plan.dp_shard)  # noqa: E731
    before = {key(r): r for r in fused.rows + fused.dropped}
    assert foreach.rows
    for r in foreach.rows:
        assert r.plan.optimizer_kernels.label == "adamw foreach (weight_decay=0.01)"
        assert r.prediction.breakdown["optimizer"] > before[key(r)].prediction.breakdown["optimizer"]
        assert r.prediction.optimizer_state_bytes == 4  # torch.optim's bf16 moments, not fp32 master weights
    assert "optimizer step timed as torch.optim's adamw foreach (weight_decay=0.01) kernels (optimizer=, optimizer_impl=)" \
        in foreach.notes and not any("torch.optim" in note for note in fused.notes)
    with pytest.raises(ValueError, match=r"plan\(\): optimizer_impl='foreach' times torch.optim's own kernels"):
        search(optimizer_impl="foreach")
    # the CLI: --optimizer reaches the search; an implementation alone is one line
    assert main(["plan", "gpt2-small", "--gpus", "8", "--batch", "16", "--seq-len", "128", "--micro-batch", "2",
                 "--optimizer", "sgd", "--optimizer-impl", "fused", "--top", "1"]) == 0
    assert "torch.optim's sgd fused" in capsys.readouterr().out
    assert main(["plan", "gpt2-small", "--gpus", "8", "--batch", "16", "--seq-len", "128",
                 "--optimizer-impl", "for_loop"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fxflops: error: plan(): optimizer_impl='for_loop'") and len(err.strip().splitlines()) == 1
