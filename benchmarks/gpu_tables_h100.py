"""The H100 tables, from what benchmarks/gpu_check.py measured on a lent H100 SXM (benchmarks/results/gpu/h100_run*.json).

    python benchmarks/gpu_tables_h100.py [--write-device] [--output benchmarks/results/gpu_h100.md]

As benchmarks/gpu_tables.py does for the H200: fits the measured device file
(fxflops/predict/data/devices/h100_sxm_measured.toml, with --write-device) from one half of the measured ops
(the GEMM grid and alignment tables, memory-bound ops at widths 768 and 8192, attention at 512, 2048 and 8192)
and validates it, and the H100 preset (published constants only), on the other half: the 32 GEMMs of the shape
list, the 60 linears of the Megatron-Core H100 rows of issue 41's validation at one rank's shapes (forward,
input and weight gradient), memory-bound ops at width 4096, attention at 1024, 4096 and 16384; and on six
training steps no fit saw (AdamW, bf16): the four of the H200 run and two Megatron-shaped GPTs at sequence 4,096.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_tables import (  # noqa: E402
    PER_OP_INTRO, detail, error, fit_measured_device, is_fit, optimizer_implementation_rows, optimizer_step_rows, own_peak, provenance,
    summary, unseen_steps)
from fxflops.predict import op_table  # noqa: E402
from fxflops.predict.hardware import device_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "gpu"
DEVICE_FILE = ROOT / "fxflops" / "predict" / "data" / "devices" / "h100_sxm_measured.toml"
RUN = 1


def load(run: int = RUN) -> dict[str, Any]:
    return json.loads((RESULTS / f"h100_run{run}.json").read_text(encoding="utf-8"))


def split_rows() -> tuple[list[op_table.Row], list[op_table.Row]]:
    """(fit, validate): the H200 split (benchmarks/gpu_tables.py), the Megatron-Core rows' linears validating."""
    run = load()
    fit = op_table.rows(run, ["gemm_grid", "gemm_alignment"])
    rest = op_table.rows(run, ["gemm", "memory", "attention"])
    fit += [row for row in rest if is_fit(row)]
    validate = [row for row in rest if not is_fit(row)] + op_table.rows(run, ["gemm_rows"])
    return fit, validate


def fitted_device(write: bool) -> tuple[Any, dict[str, tuple]]:
    return fit_measured_device(split_rows()[0], "H100 SXM", load()["env"], f"benchmarks/results/gpu/h100_run{RUN}.json",
                               DEVICE_FILE, "benchmarks/gpu_tables_h100.py", "benchmarks/results/gpu_h100.md", write)


def shape_list_and_rest(rows: list[op_table.Row]) -> list[op_table.Row]:
    """The held-out rows but the Megatron-Core linears (their own table): what the H200's summary groups."""
    return [row for row in rows if row.source.get("row") is None]


def megatron_linears(devices: dict[str, Any]) -> list[str]:
    """The Megatron-Core rows' linears, per row and pass: measured TFLOP/s and each device's median error."""
    rows = [row for row in op_table.rows(load(), ["gemm_rows"])]
    names = list(devices)
    lines = ["| Megatron-Core row (one rank) | pass | linears | measured TFLOP/s (min-max) | "
             + " | ".join(f"{name}: median error (min, max)" for name in names) + " |",
             "|---|---|---:|---|" + "---|" * len(names)]
    groups: dict[tuple[str, str], list[op_table.Row]] = {}
    for row in rows:
        groups.setdefault((row.source["row"], row.source["pass"]), []).append(row)
    for (name, pass_), members in groups.items():
        tflops = [member.source["tflops"] for member in members]
        cells = []
        for device in devices.values():
            errors = [error(_predict(row, device), row.seconds) for row in members]
            cells.append(f"{statistics.median(errors):+.0%} ({min(errors):+.0%}, {max(errors):+.0%})")
        rows_text = ", ".join(member.source["linear"] for member in members)
        lines.append(f"| {name} | {pass_} | {rows_text} | {statistics.median(tflops):.0f} "
                     f"({min(tflops):.0f}-{max(tflops):.0f}) | " + " | ".join(cells) + " |")
    return lines


def _predict(row: op_table.Row, device: Any) -> float:
    return op_table.roofline(row, "H100 SXM") if device == "roofline" else op_table.predicted(row, device)


def megatron_steps() -> list[tuple[str, Any, tuple, Any, str]]:
    """The two Megatron-shaped GPTs gpu_check.py's steps section trained, on the meta device."""
    import torch

    from fxflops.predict.validation import gpt, lm_loss

    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    return [(f"Megatron GPT 4 x {hidden}, {heads} heads, vocab 131072, batch 1 x 4096",
             gpt(4, hidden, heads, vocab=131072, seq=4096), (ids,), lm_loss,
             f"Megatron GPT 4 x {hidden}, {heads} heads, vocab 131072, bf16, batch 1 x 4096")
            for hidden, heads in ((2048, 16), (4096, 32))]


def step_rows(devices: dict[str, Any]) -> list[str]:
    """Training steps (torch.optim.AdamW's defaults on bf16 weights: foreach) never fitted: step time and peak memory
    against predict_step's (the optimizer timed as the foreach kernels it ran), and the GPU time of the optimizer's
    multi-tensor kernels the profiler saw."""
    import torch

    import fxflops

    measured = load()["steps"]
    names = [name for name in devices if name != "roofline"]
    lines = ["| training step (AdamW, bf16) | measured | " + " | ".join(names) +
             " | of it, optimizer kernels measured / predicted | peak memory measured / predicted |",
             "|---|---:|" + "---:|" * len(names) + "---:|---:|"]
    for label, model, inputs, loss, key in unseen_steps() + megatron_steps():
        entry = measured[key]
        seconds = entry["median"]
        cells, memory, optimizer = [], None, None
        for name in names:
            step = fxflops.predict_step(model, inputs, parallel={}, cluster="DGX H100", device=devices[name],
                                        dtype=torch.bfloat16, attention="cudnn", loss=loss, optimizer="adamw")
            cells.append(f"{step.step_time * 1e3:.2f} ms ({error(step.step_time, seconds):+.0%})")
            memory, optimizer = step.memory[0].tensor_bytes, step.breakdown["optimizer"]
        kernels = sum(s for name, s, _ in entry["kernels"]["top"] if "multi_tensor_apply" in name)
        peak = own_peak(measured, key)
        lines.append(f"| {label} | {seconds * 1e3:.2f} ms | " + " | ".join(cells) +
                     f" | {kernels * 1e3:.2f} / {optimizer * 1e3:.2f} ms | "
                     f"{peak / 2**30:.2f} / {memory / 2**30:.2f} GiB ({error(memory, peak):+.0%}) |")
    return lines


def profiles() -> list[str]:
    """fxflops.profile() per module over 1 ms: CUDA-event latency (the host queued ahead) against the kernel time
    torch.profiler attributes to the module, and the whole forward."""
    run = load()["profile"]
    lines = ["| model | module | kernels (torch.profiler) | profile() latency |", "|---|---|---:|---:|"]
    for model in ("gpt2", "resnet50"):
        for name, stats in run[model]["modules"].items():
            kernels = stats["kernel_seconds"]
            if kernels and max(stats["latency"] or 0, kernels) >= 1e-3:
                lines.append(f"| {run[model]['model'].split(',')[0]} | {name} ({stats['type']}) | {kernels * 1e3:.3f} ms | "
                             f"{stats['latency'] * 1e3:.3f} ms ({error(stats['latency'], kernels):+.0%}) |")
    lines += ["", "| model | plain forward | hooked forward | host launch plain / hooked | roofline prediction | "
                  "utilization |", "|---|---:|---:|---:|---:|---:|"]
    for model in ("gpt2", "resnet50"):
        entry = run[model]
        lines.append(f"| {entry['model']} | {entry['fwd_latency'] * 1e3:.2f} ms | {entry['hooked_fwd_latency'] * 1e3:.2f} ms | "
                     f"{entry['extra']['host_launch_plain'] * 1e3:.2f} / {entry['extra']['host_launch_hooked'] * 1e3:.2f} ms | "
                     f"{entry['predicted_latency'] * 1e3:.2f} ms | {entry['utilization']:.1%} |")
    return lines


def meter() -> list[str]:
    entry = load()["meter"]
    logged = statistics.median(step["mfu"] for step in entry["logged"])
    flops = entry["logged"][-1]["flops"]
    return ["| model | FLOPs: meter / FlopCounterMode (real step) | step, bare / metered (median) | logged MFU (median) | "
            "FLOPs / bare step / peak |", "|---|---|---:|---:|---:|",
            f"| {entry['model']} | {flops:,} / {entry['oracle_flops']:,} "
            f"({'equal' if flops == entry['oracle_flops'] else 'differ'}) | "
            f"{statistics.median(entry['bare_step_seconds']) * 1e3:.2f} / "
            f"{statistics.median(entry['metered_step_seconds']) * 1e3:.2f} ms | {logged:.2%} | "
            f"{entry['mfu_from_oracle']:.2%} |"]


def _step_tensors() -> dict[str, int]:
    """Parameter tensors of each measured step's model (the launch count of its multi-tensor kernels)."""
    return {key: sum(1 for p in model.parameters() if p.requires_grad)
            for _, model, _, _, key in unseen_steps() + megatron_steps()}


def header() -> list[str]:
    run = load()
    env = run["env"]
    ceilings = run["ceilings"]
    return [f"Device: {provenance(env)}; {env['sm_count']} SMs, {env['memory_gib']} GiB, L2 {env['l2_mb']} MB; "
            f"clocks {env['nvidia_smi'].splitlines()[1]}. Run {RUN} at commit {str(run.get('commit'))[:12]}, "
            f"sections {', '.join(k for k in ('ceilings', 'ops', 'tests', 'profile', 'meter', 'steps') if k in run)}.",
            "", f"Ceilings: bf16 8192^3 matmul {ceilings['matmul']['tflops']:.0f} TFLOP/s, device-to-device copy "
            f"{ceilings['copy']['tb_per_s']:.2f} TB/s (read + write). tests/test_cuda.py: {run['tests']['summary']}."]


def report(devices: dict[str, Any]) -> str:
    _, validate = split_rows()
    return "\n".join([
        "# On a lent H100: measured vs predicted (issue 41)", "",
        "Written by `python benchmarks/gpu_tables_h100.py --output benchmarks/results/gpu_h100.md` from "
        "`benchmarks/results/gpu/h100_run1.json` (`benchmarks/gpu_check.py --only "
        "env,ceilings,ops,tests,profile,meter,steps`).", "", *header(), "",
        "## profile(): module latency against the kernels torch.profiler attributes to the module", "", *profiles(), "",
        "## The meter on real bf16 training steps", "", *meter(), "",
        "## Per op: predicted vs measured, on ops the measured device file was not fitted to", "",
        PER_OP_INTRO, "",
        *summary(shape_list_and_rest(validate), devices), "",
        "## The Megatron-Core H100 rows' linears (issue 41's validation), one rank's shapes", "",
        *megatron_linears(devices), "",
        "## Training steps (never fitted)", "", *step_rows(devices), "",
        "## The optimizer step: measured kernels against the fused and foreach predictions", "",
        *optimizer_step_rows(RESULTS / f"h100_run{RUN}.json", devices, _step_tensors()), "",
        "One optimizer.step() alone per implementation (run 2: 805M elements in 48 tensors):", "",
        *optimizer_implementation_rows(RESULTS / "h100_run2.json", devices), "",
        "## Every validation op", "", *detail(validate, devices), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-device", action="store_true", help="(re)write the measured device file")
    parser.add_argument("--output", type=Path, help="write the whole report there")
    args = parser.parse_args()
    fitted_device(args.write_device)
    devices = {"roofline": "roofline", "H100 SXM preset": device_model("H100 SXM")}
    if DEVICE_FILE.exists():
        devices["H100 SXM measured"] = device_model(str(DEVICE_FILE))
    if args.output:
        args.output.write_text(report(devices), encoding="utf-8")
        return
    _, validate = split_rows()
    print("\n".join(summary(shape_list_and_rest(validate), devices)))
    print()
    print("\n".join(megatron_linears(devices)))
    print()
    print("\n".join(step_rows(devices)))


if __name__ == "__main__":
    main()
