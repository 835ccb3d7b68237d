"""Predicted vs published training runs (issue 41's validation).

Each run of fxflops.predict.validation.RUNS (Korthikanti et al. 2022 Tables 3/5: iteration time; Narayanan
et al. 2021 Table 1: per-GPU TFLOP/s by the paper's own FLOP formula; Smith et al. 2022 (MT-NLG 530B):
iteration time; BigScience's BLOOM-176B log: iteration time; Megatron-LM's README (Megatron-Core r0.8.0 on H100):
TFLOP/s per GPU by Megatron-LM's own formula; MosaicML llm-foundry's MPT benchmark table: tokens/s per A100;
the Llama 3 paper's Table 4: TFLOP/s per H100; torchtitan's
performance page: tokens/s per A100) is predicted with predict_step on the run's cluster (a preset, or a file of
fxflops/predict/data/published/ for a cluster no preset describes), the model
captured at two layers (the costs stand for the run's depth), with the kernels its software ran as the
row states them (unfused or flash attention, attention dropout, fused pointwise chains, the gradient
reduction's dtype) and its pipeline engine (Megatron-LM's or DeepSpeed's). The
constants come from fxflops/predict/data and were not fitted to these runs. Writes benchmarks/results/predict_validation.md.

    python benchmarks/predict_validation.py
"""

from __future__ import annotations

import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import ROOT, environment  # noqa: E402


UNITS = {"step_time": "s", "tflops_per_gpu": "TFLOP/s/GPU", "model_tflops_per_gpu": "TFLOP/s/GPU",
         "megatron_tflops_per_gpu": "TFLOP/s/GPU",
         "tokens_per_sec_per_gpu": "tokens/s/GPU"}


def main() -> None:
    from fxflops.predict.validation import RUNS, predict_run

    rows, errors = [], []
    for run in RUNS:
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            predicted, prediction = predict_run(run)
        error = (predicted - run.measured) / run.measured
        errors.append(abs(error))
        b = prediction.breakdown
        unit = UNITS[run.metric]
        rows.append(f"| {run.name} | {run.source.split(',')[0]} | {run.cluster} | tp={run.tp}{f' cp={run.cp}' if run.cp > 1 else ''} pp={run.pp} v={run.virtual_stages} "
                    f"dp={run.dp}{' (FSDP)' if run.fsdp else ''}, batch {run.global_batch}/{run.micro_batch}, {run.recompute}"
                    f"{', TP overlap' if run.tp_comm_overlap else ''}"
                    f"{', param-gather overlap' if run.overlap_param_gather else ''}"
                    f"{', DeepSpeed engine' if run.pipeline_engine == 'deepspeed' else ''} | "
                    f"{run.kernels} | {unit} | "
                    f"{run.measured:g} | {predicted:.2f} | {error:+.1%} | {b['compute']:.2f} / "
                    f"{b['exposed_comm']:.2f} / {b['bubble']:.2f} / {b['optimizer']:.2f} | "
                    f"{time.perf_counter() - start:.1f} |")
        print(rows[-1], flush=True)
    mean, worst = sum(errors) / len(errors), max(errors)
    text = "\n".join([
        "# predict_validation.py", "", environment(), "", "Breakdown of the step's critical rank in seconds:",
        "compute / exposed communication / bubble / optimizer.", "",
        "| run | publication | cluster preset | plan | kernels | metric | measured | predicted | error | breakdown (s) | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|", *rows, "",
        f"Mean absolute error {mean:.1%} over {len(errors)} runs; largest {worst:.1%}.", ""])
    path = os.path.join(ROOT, "benchmarks", "results", "predict_validation.md")
    with open(path, "w") as stream:
        stream.write(text)
    print(f"mean abs error {mean:.1%}, max {worst:.1%}; wrote {path}")


if __name__ == "__main__":
    main()
