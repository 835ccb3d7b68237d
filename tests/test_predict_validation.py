"""Predicted vs published training runs (docs/guide/predict.md's table): the published numbers as the
publications give them, the table's errors, and some rows predicted again here (the others take seconds
each: the benchmark benchmarks/predict_validation.py regenerates all of them)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from fxflops.predict.validation import KORTHIKANTI, LLAMA3, NARAYANAN, RUNS, SMITH, TORCHTITAN, predict_run

DOCS = Path(__file__).resolve().parent.parent / "docs" / "guide" / "predict.md"
ROW = re.compile(r"^\| (?P<name>[^|]+?) \| (?P<source>[^|]+?) \| [^|]+ \| [^|]+ \| (?P<kernels>[^|]+?) \| (?P<unit>[^|]+?) \| "
                 r"(?P<measured>[\d.]+) \| (?P<predicted>[\d.]+) \| (?P<error>[+-][\d.]+)% \| (?:[+-][\d.]+%|new) \|$")


def table() -> dict[str, dict[str, str]]:
    rows = {}
    for line in DOCS.read_text().splitlines():
        found = ROW.match(line)
        if found:
            rows[found["name"]] = found.groupdict()
    return rows


FIRST_SET = (KORTHIKANTI, NARAYANAN)  # the runs issue 41's target was first stated for


def test_each_row_states_its_kernels() -> None:
    # the runs before FlashAttention (2021-2022 Megatron-LM and DeepSpeed) computed attention unfused with
    # Megatron-LM's attention dropout 0.1; torchtitan reduce-scatters gradients in fp32
    for run in RUNS:
        unfused = run.source in (KORTHIKANTI, NARAYANAN, SMITH)
        assert (run.attention, run.attention_dropout) == (("math", 0.1) if unfused else ("flash", 0.0))
        assert run.grad_bytes == (4 if run.source == TORCHTITAN else None)
        # Megatron-LM's fused bias-GeLU / bias-dropout-add kernels in the Megatron-LM and MT-NLG runs; MT-NLG's
        # pipeline ran on DeepSpeed's engine
        assert run.fuse_elementwise == unfused and ("fused pointwise chains" in run.kernels) == unfused
        assert run.pipeline_engine == ("deepspeed" if run.source == SMITH else "megatron")


def test_published_numbers() -> None:
    # Korthikanti et al. 2022 Table 5 (iteration time, s), Narayanan et al. 2021 Table 1 (TFLOP/s per GPU),
    # Smith et al. 2022 Section 2.4 (iteration time, s), Llama 3 Table 4 (TFLOP/s per GPU), torchtitan (WPS)
    measured = {run.name: run.measured for run in RUNS}
    assert measured == {
        "22B, SP + selective": 1.10, "22B, full recompute": 1.42, "175B, SP + selective": 13.75,
        "175B, full recompute": 18.13, "530B, SP + selective": 37.83, "530B, full recompute": 49.05,
        "1T, SP + selective": 71.49, "1T, full recompute": 94.42, "1.7B on 32 GPUs": 137, "3.6B on 64 GPUs": 138,
        "7.5B on 128 GPUs": 142, "18.4B on 256 GPUs": 135, "39.1B on 512 GPUs": 138,
        "76.1B on 1024 GPUs": 140, "145.6B on 1536 GPUs": 148, "310.1B on 1920 GPUs": 155,
        "529.6B on 2520 GPUs": 163, "1T on 3072 GPUs": 163,
        "MT-NLG 530B on 2240 GPUs": 60.1, "MT-NLG 530B on 2800 GPUs": 50.2, "MT-NLG 530B on 3360 GPUs": 44.4,
        "Llama 3 405B on 8192 H100": 430, "Llama 3 405B on 16384 H100": 400,
        "Llama 3 405B, 128K context, on 16384 H100": 380, "Llama 3 70B, FSDP, full AC": 331,
        "Llama 2 70B, FSDP, full AC": 353, "Llama 2 13B, FSDP, no AC": 2162}
    assert {run.source for run in RUNS} == {KORTHIKANTI, NARAYANAN, SMITH, LLAMA3, TORCHTITAN}
    for run in RUNS:  # the plans add up to the GPUs the papers name
        assert run.tp * run.cp * run.pp * run.dp == run.gpus
    # Narayanan et al.'s Eq. 3 reproduces their Table 1: 1T at 163 TFLOP/s on 3072 GPUs is 502 PFLOP/s aggregate,
    # so one iteration of batch 3072 took Eq. 3 / 502e15 s
    one_t = next(run for run in RUNS if run.name == "1T on 3072 GPUs")
    assert one_t.published_flops() / (one_t.gpus * 163e12) == pytest.approx(one_t.published_flops() / 502e15, rel=3e-3)
    # Table 1's aggregate PFLOP/s column is GPUs x the per-GPU TFLOP/s (to its rounding) on every row
    aggregate = {"1.7B": 4.4, "3.6B": 8.8, "7.5B": 18.2, "18.4B": 34.6, "39.1B": 70.8, "76.1B": 143.8,
                 "145.6B": 227.1, "310.1B": 297.4, "529.6B": 410.2, "1T": 502.0}
    table_1 = [run for run in RUNS if run.source == NARAYANAN]
    assert sorted(run.name.split(" on")[0] for run in table_1) == sorted(aggregate)
    for run in table_1:
        assert run.gpus * run.measured / 1000 == pytest.approx(aggregate[run.name.split(" on")[0]], abs=0.05 + run.gpus / 2000)
    # Smith et al.'s TFLOP/s per GPU (126, 121, 113) are Eq. 3 over their iteration times (60.1, 50.2, 44.4 s):
    # the row's model, plan and batch are the paper's, recomputation included
    for run, tflops in zip((run for run in RUNS if run.source == SMITH), (126, 121, 113)):
        assert (run.gpus, run.tp, run.pp, run.global_batch) == (run.gpus, 8, 35, 1920)
        assert run.published_flops() / (run.gpus * run.measured) / 1e12 == pytest.approx(tflops, rel=0.01)
    # Llama 3 Table 4: 16M tokens a step (dp x sequences per dp rank x 8,192 or 131,072), MFU 43%, 41% and 38% of
    # 989 TFLOP/s (400 / 989 is 40.4%: the table's TFLOP/s are rounded, to within 1% of the peak); the rows'
    # (tp, cp, pp, dp): (8, 1, 16, 64), (8, 1, 16, 128), (8, 16, 16, 8)
    llama3 = [run for run in RUNS if run.source == LLAMA3]
    assert [(run.tp, run.cp, run.pp, run.dp, run.seq) for run in llama3] == [
        (8, 1, 16, 64, 8192), (8, 1, 16, 128, 8192), (8, 16, 16, 8, 131072)]
    for run, mfu in zip(llama3, (0.43, 0.41, 0.38), strict=True):
        assert run.global_batch * run.seq == 16 * 2**20
        assert run.measured / 989 == pytest.approx(mfu, abs=0.01)


def test_docs_table_holds_every_run_and_its_error() -> None:
    rows = table()
    assert set(rows) == {run.name for run in RUNS}
    errors = []
    for run in RUNS:
        row = rows[run.name]
        assert float(row["measured"]) == run.measured
        assert row["kernels"] == run.kernels and run.software  # each row states its software's kernels, with a source
        # the table rounds the prediction to 2 decimals and the error to 0.1%: they agree within that rounding
        error = (float(row["predicted"]) - run.measured) / run.measured
        assert error == pytest.approx(float(row["error"]) / 100, abs=0.005 / run.measured + 0.0005)
        errors.append(abs(error))
    mean, worst = sum(errors) / len(errors), max(errors)
    stated = re.search(r"Mean absolute error ([\d.]+)% over (\d+) runs; largest ([\d.]+)%", DOCS.read_text())
    assert int(stated[2]) == len(RUNS)
    assert float(stated[1]) == pytest.approx(100 * mean, abs=0.051) and float(stated[3]) == pytest.approx(100 * worst, abs=0.051)
    # issue 41's target holds on the runs it was first stated for and on every publication but MT-NLG's; the
    # docs say why not there (the same model and plan on the same nodes under Megatron-LM, Narayanan et al.'s
    # 529.6B row, is predicted within 8%)
    first = [error for run, error in zip(RUNS, errors) if run.source in FIRST_SET]
    assert sum(first) / len(first) < 0.10 and max(first) < 0.20
    rest = [error for run, error in zip(RUNS, errors) if run.source != SMITH]
    assert sum(rest) / len(rest) < 0.10 and max(rest) < 0.20
    # over every row it does not: the rows over 20% are exactly the three MT-NLG ones, and they take the mean
    # over 10% (10.2% over 27 rows: the upper bound catches a change that makes the rest worse)
    assert {run.name for run, error in zip(RUNS, errors) if error > 0.20} == {run.name for run in RUNS
                                                                             if run.source == SMITH}
    assert 0.10 < mean < 0.11


@pytest.mark.parametrize("name", ["22B, full recompute", "18.4B on 256 GPUs", "529.6B on 2520 GPUs",
                                  "MT-NLG 530B on 2240 GPUs",
                                  "Llama 3 405B on 16384 H100", "Llama 3 405B, 128K context, on 16384 H100",
                                  "Llama 2 13B, FSDP, no AC"])
def test_rows_predicted_again(name: str) -> None:
    run = next(run for run in RUNS if run.name == name)
    if run.arch == "llama":
        pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        predicted, prediction = predict_run(run)
    assert f"{predicted:.2f}" == table()[name]["predicted"]
    assert sum(prediction.breakdown.values()) == pytest.approx(prediction.step_time)
