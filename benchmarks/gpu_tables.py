"""Issue 42's tables, from what benchmarks/gpu_check.py measured on a lent GPU (benchmarks/results/gpu/).

    python benchmarks/gpu_tables.py [--write-device]     # prints benchmarks/results/gpu_h200.md's text

It fits the measured device file (fxflops/predict/data/devices/h200_sxm_measured.toml, with --write-device)
from one half of the measured ops and validates it on the other half (and on whole models it never saw):
- fit: the GEMM grid (90 linears) and the alignment table (21), memory-bound ops at widths 768 and 8192,
  attention at query lengths 512, 2048 and 8192 (math: 512 and 2048);
- validate: the 32 GEMMs of the shape list, memory-bound ops at width 4096, attention at 1024, 4096 and
  16384 (math: 1024), and GPT-2's and ResNet-50's forwards and five training steps as measured (run 2's
  Llama, run 7's GQA Llama, GPT-2 medium, ResNet-50 and ViT-B/16, with their peak memory).
Every prediction is also made with the H200 preset (published constants only) and the plain roofline.
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

from fxflops.predict import op_table  # noqa: E402
from fxflops.predict.calibrate import write_device_file  # noqa: E402
from fxflops.predict.hardware import device_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "gpu"
DEVICE_FILE = ROOT / "fxflops" / "predict" / "data" / "devices" / "h200_sxm_measured.toml"
FIT_SEQS, FIT_MATH_SEQS = (512, 2048, 8192), (512, 2048)
FIT_WIDTHS = (768, 8192)


def load(run: int) -> dict[str, Any]:
    return json.loads((RESULTS / f"h200_run{run}.json").read_text(encoding="utf-8"))


def provenance(env: dict[str, Any]) -> str:
    return (f"{env['name']}, driver {env['nvidia_smi'].splitlines()[1].split(', ')[1]}, torch {env['torch']} "
            f"(CUDA {env['cuda']}, cuDNN {env['cudnn']}), {env['date'][:10]}, benchmarks/gpu_check.py")


def is_fit(row: op_table.Row) -> bool:
    entry = row.source
    if entry["kind"] == "attention":
        seq = entry["shape"][2]
        return seq in (FIT_MATH_SEQS if entry["backend"] == "math" else FIT_SEQS)
    if entry["kind"] == "memory":
        return entry["op"] == "embedding" and entry["shape"][2] != 4096 or \
            entry["op"] != "embedding" and len(entry["shape"]) == 2 and entry["shape"][1] in FIT_WIDTHS
    return False  # GEMMs: the grid and alignment tables fit, the shape list validates


def split_rows() -> tuple[list[op_table.Row], list[op_table.Row]]:
    run3, run5 = load(3), load(5)
    fit = op_table.rows(run3, ["gemm_grid"]) + op_table.rows(run5, ["gemm_alignment"])
    rest = op_table.rows(run3, ["gemm", "memory", "attention"])
    fit += [row for row in rest if is_fit(row)]
    validate = [row for row in rest if not is_fit(row)]
    return fit, validate


def fit_measured_device(fit: list[op_table.Row], base: str, env: dict[str, Any], runs: str, path: Path, script: str,
                        report: str, write: bool) -> tuple[Any, dict[str, tuple]]:
    """`base` fitted to the `fit` rows, every constant citing the run (`env`, the `runs` files); with `write`, written
    to `path` as the device "<base> measured"."""
    device, fitted = op_table.fit_device(fit, base, f"measured on {provenance(env)} ({runs})")
    if write:
        write_device_file(path, base, fitted, name=f"{base} measured",
                          note=f"fitted by {script} from half of the ops benchmarks/gpu_check.py "
                               f"measured; the other half validates it ({report})")
    return device, fitted


def fitted_device(write: bool) -> tuple[Any, dict[str, tuple]]:
    return fit_measured_device(split_rows()[0], "H200 SXM", load(3)["env"],
                               "benchmarks/results/gpu/h200_run3.json, run5.json", DEVICE_FILE,
                               "benchmarks/gpu_tables.py", "benchmarks/results/gpu_h200.md", write)


def error(predicted: float, measured: float) -> float:
    return predicted / measured - 1


def summary(rows: list[op_table.Row], devices: dict[str, Any]) -> list[str]:
    lines = ["| ops | n | " + " | ".join(f"{name}: median abs. error / within 25%" for name in devices) + " |",
             "|---|---:|" + "---:|" * len(devices)]
    groups: dict[str, list[op_table.Row]] = {}
    for row in rows:
        groups.setdefault(_group(row), []).append(row)
    for group, members in groups.items():
        cells = []
        for device in devices.values():
            errors = [abs(error(_predict(row, device), row.seconds)) for row in members]
            within = sum(e <= 0.25 for e in errors)
            cells.append(f"{statistics.median(errors):.0%} / {within} of {len(errors)}")
        lines.append(f"| {group} | {len(members)} | " + " | ".join(cells) + " |")
    return lines


def _group(row: op_table.Row) -> str:
    if row.kind == "attention":
        return f"attention, {row.kernel}, {'backward' if 'backward' in row.label else 'forward'}"
    if row.kind == "gemm":
        return "GEMMs (shape list)"
    return f"memory-bound: {row.source['op']}"


def _predict(row: op_table.Row, device: Any) -> float:
    return op_table.roofline(row, "H200 SXM") if device == "roofline" else op_table.predicted(row, device)


def detail(rows: list[op_table.Row], devices: dict[str, Any]) -> list[str]:
    lines = ["| op | measured (us) | " + " | ".join(f"{name} (us, error)" for name in devices) + " |",
             "|---|---:|" + "---:|" * len(devices)]
    for row in rows:
        cells = [f"{_predict(row, d) * 1e6:,.1f} ({error(_predict(row, d), row.seconds):+.0%})" for d in devices.values()]
        lines.append(f"| {row.label} | {row.seconds * 1e6:,.1f} | " + " | ".join(cells) + " |")
    return lines


def whole_models(devices: dict[str, Any]) -> list[str]:
    """GPT-2's and ResNet-50's forward (kernel time torch.profiler summed) and a Llama training step (wall)
    as measured, against the time model over the ops fxflops counts for them."""
    import torch

    import fxflops
    from fxflops.cli.examples import get_example
    from fxflops.predict.op_time import Kernels, estimate_seconds

    run5, run2 = load(5), load(2)
    rows = ["| model | measured | " + " | ".join(f"{name}" for name in devices if name != "roofline") + " |",
            "|---|---:|" + "---:|" * (len(devices) - 1)]
    example = get_example("gpt2-small")
    with torch.device("meta"):
        gpt2 = example.build().to(torch.bfloat16)
    (ids,) = example.inputs(batch=8, seq_len=1024, device="meta")
    cases = [("GPT-2 small forward, batch 8 x 1024 (kernel time)", fxflops.estimate(gpt2, (ids,)),
              run5["profile"]["gpt2"]["modules"]["<root>"]["kernel_seconds"])]
    import torchvision

    with torch.device("meta"):
        resnet = torchvision.models.resnet50().to(torch.bfloat16).eval()
    x = torch.empty(64, 3, 224, 224, device="meta", dtype=torch.bfloat16)
    cases.append(("ResNet-50 forward, batch 64 (kernel time)", fxflops.estimate(resnet, (x,)),
                  run5["profile"]["resnet50"]["modules"]["<root>"]["kernel_seconds"]))
    for label, est, measured in cases:
        cells = []
        for name, device in devices.items():
            if name == "roofline":
                continue
            seconds = estimate_seconds(est, device, torch.bfloat16, Kernels(attention="cudnn"))["total"]
            cells.append(f"{seconds * 1e3:.2f} ms ({error(seconds, measured):+.0%})")
        rows.append(f"| {label} | {measured * 1e3:.2f} ms | " + " | ".join(cells) + " |")
    llama, batch = small_llama(), torch.empty(8, 1024, device="meta", dtype=torch.long)
    measured = statistics.median(run2["meter"]["bare_step_seconds"])
    cells = []
    for name, device in devices.items():
        if name == "roofline":
            continue
        step = fxflops.predict_step(llama, (batch,), parallel={}, cluster="DGX H100", device=device,
                                    dtype=torch.bfloat16, attention="cudnn", optimizer="adamw")  # the meter's AdamW
        cells.append(f"{step.step_time * 1e3:.2f} ms ({error(step.step_time, measured):+.0%})")
    rows.append(f"| Llama 542M training step (AdamW), batch 8 x 1024 (wall) | {measured * 1e3:.2f} ms | "
                + " | ".join(cells) + " |")
    return rows


def unseen_steps() -> list[tuple[str, Any, tuple, Any, str]]:
    """(label, model on meta, inputs, loss, key in run 6) of the four training steps run 6 measured: built
    as gpu_check.py's steps section builds them, on the meta device."""
    import torch
    import torchvision
    from transformers import LlamaConfig, LlamaForCausalLM

    from fxflops.cli.examples import get_example

    f = torch.nn.functional
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    ids = torch.zeros(4, 2048, dtype=torch.long, device="meta")
    tokens = torch.zeros(8, 1024, dtype=torch.long, device="meta")
    images = torch.empty(64, 3, 224, 224, device="meta", dtype=torch.bfloat16)
    labels = torch.zeros(64, dtype=torch.long, device="meta")
    with torch.device("meta"):
        llama = LlamaForCausalLM(config).to(torch.bfloat16)
        gpt2 = get_example("gpt2-small").build(n_layer=24, d_model=1024, n_head=16).to(torch.bfloat16)
        resnet = torchvision.models.resnet50().to(torch.bfloat16)
        vit = torchvision.models.vit_b_16().to(torch.bfloat16)
    return [
        ("Llama GQA 853M (16 x 2048, kv 4), batch 4 x 2048", llama, (ids,),  # the loss as HF's, unshifted
         lambda out: f.cross_entropy(out.logits.flatten(0, 1).float(), ids.flatten()),
         "Llama GQA 16 layers x 2048, kv 4, bf16, batch 4 x 2048"),
        ("GPT-2 medium-shaped 355M, batch 8 x 1024", gpt2, (tokens,),
         lambda out: f.cross_entropy(out.flatten(0, 1).float(), tokens.flatten()),
         "GPT-2 medium-shaped (24 x 1024), bf16, batch 8 x 1024"),
        ("ResNet-50, batch 64", resnet, (images,), lambda out: f.cross_entropy(out.float(), labels),
         "ResNet-50, bf16, batch 64"),
        ("ViT-B/16, batch 64", vit, (images,), lambda out: f.cross_entropy(out.float(), labels),
         "ViT-B/16, bf16, batch 64"),
    ]


def own_peak(steps: dict[str, Any], key: str) -> int:
    """The peak allocated bytes of one model's step, less what else was on the GPU: `resident_before_bytes`
    where gpu_check.py recorded it; in run 6, which built all four models before stepping the first, the
    other three models' bf16 weights (2 bytes a parameter), which max_memory_allocated counted in every peak."""
    entry = steps[key]
    if entry.get("resident_before_bytes") is not None:
        return entry["peak_allocated"] - entry["resident_before_bytes"]
    return entry["peak_allocated"] - sum(2 * other["params"] for name, other in steps.items() if name != key)


def unseen_step_rows(devices: dict[str, Any]) -> list[str]:
    """Training steps (torch.optim.AdamW's defaults on bf16 weights: foreach on CUDA, 4 bytes of state a parameter)
    of run 7 (one model on the GPU at a time; run 6 held all four at once), never fitted: step time and peak
    allocated memory against predict_step's, its optimizer timed as the foreach kernels the step ran."""
    import torch

    import fxflops

    measured = load(7)["steps"]
    names = [name for name in devices if name != "roofline"]
    rows = ["| training step (AdamW, bf16) | measured | " + " | ".join(names) +
            " | peak memory measured (less what was resident before) / predicted |",
            "|---|---:|" + "---:|" * len(names) + "---:|"]
    for label, model, inputs, loss, key in unseen_steps():
        seconds = measured[key]["median"]
        cells, memory = [], None
        for name in names:
            step = fxflops.predict_step(model, inputs, parallel={}, cluster="DGX H100", device=devices[name],
                                        dtype=torch.bfloat16, attention="cudnn", loss=loss, optimizer="adamw",
                                        optimizer_state_bytes=4)
            cells.append(f"{step.step_time * 1e3:.2f} ms ({error(step.step_time, seconds):+.0%})")
            memory = step.memory[0].tensor_bytes
        peak = own_peak(measured, key)
        rows.append(f"| {label} | {seconds * 1e3:.2f} ms | " + " | ".join(cells) +
                    f" | {peak / 2**30:.2f} / {memory / 2**30:.2f} GiB ({error(memory, peak):+.0%}) |")
    return rows


def optimizer_step_rows(path: Path, devices: dict[str, Any], tensors: dict[str, int] | None = None) -> list[str]:
    """Per training step of gpu_check.py's steps section in the run at `path` (torch.optim.AdamW, lr 1e-4,
    weight_decay 1e-2, bf16 parameters and state: foreach on CUDA): the GPU time of the optimizer's multi-tensor
    kernels (those of torch.profiler's top 40 named multi_tensor_apply) against the optimizer step predicted as
    one fused kernel (fxflops' default: 12 B a parameter element) and as the foreach kernels AdamW launches
    (`fxflops.predict.optimizer_time`: 40 B, one launch per 320 chunks). `tensors`: parameter tensors per step
    key (default: the models of `unseen_steps`; a step without one is timed on its chunk bound only)."""
    from fxflops.predict.optimizer_time import MASTER_FUSED, optimizer_kernels

    if tensors is None:
        tensors = {key: sum(1 for p in model.parameters() if p.requires_grad)
                   for _, model, _, _, key in unseen_steps()}
    foreach = optimizer_kernels("adamw")
    names = [name for name in devices if name != "roofline"]
    lines = ["| training step (AdamW, bf16) | parameters | multi-tensor kernels measured (launches) | " +
             " | ".join(f"{name}: fused / foreach" for name in names) + " |", "|---|---:|---:|" + "---:|" * len(names)]
    for key, entry in json.loads(Path(path).read_text(encoding="utf-8"))["steps"].items():
        kernels = [(s, n) for name, s, n in entry["kernels"]["top"] if "multi_tensor_apply" in name]
        measured, launches = sum(s for s, _ in kernels), sum(n for _, n in kernels)
        params, count = entry["params"], tensors.get(key, 0)
        cells = []
        for name in names:
            fused = MASTER_FUSED.seconds(params, count, 2, 2, 4, devices[name])  # 4 B of state: m and v in bf16
            mine = foreach.seconds(params, count, 2, 2, 2, devices[name])
            cells.append(f"{fused * 1e3:.2f} ({error(fused, measured):+.0%}) / {mine * 1e3:.2f} ms "
                         f"({error(mine, measured):+.0%})")
        lines.append(f"| {key} | {params / 1e6:,.1f}M | {measured * 1e3:.2f} ms ({launches}; predicted "
                     f"{foreach.launches(params, count)}) | " + " | ".join(cells) + " |")
    return lines


def optimizer_implementation_rows(path: Path, devices: dict[str, Any]) -> list[str]:
    """One optimizer.step() alone per implementation, optimizer and dtype (gpu_check.py's optimizers ops table in
    the run at `path`: 48 weight-shaped tensors, the state allocated) against `optimizer_time`'s prediction."""
    import torch

    from fxflops.predict.optimizer_time import optimizer_kernels

    names = [name for name in devices if name != "roofline"]
    lines = ["| optimizer and implementation | dtype | B / element | measured | " + " | ".join(names) + " |",
             "|---|---|---:|---:|" + "---:|" * len(names)]
    for row in json.loads(Path(path).read_text(encoding="utf-8"))["ops"]["optimizers"]:
        if "seconds" not in row:
            continue
        # the optimizer as the row built it (its options over torch's defaults), read from an instance's defaults
        instance = getattr(torch.optim, row["optimizer"])([torch.nn.Parameter(torch.zeros(1))], lr=1e-4,
                                                           **row["options"])
        kernels = optimizer_kernels(instance, row["impl"])
        element = {"bfloat16": 2, "float32": 4}[row["dtype"]]
        per = kernels.bytes_per_element(element, element, element)
        cells = []
        for device in names:
            predicted = kernels.seconds(row["params"], row["tensors"], element, element, element, devices[device])
            cells.append(f"{predicted * 1e3:.2f} ms ({error(predicted, row['seconds']):+.0%})")
        lines.append(f"| {kernels.label} | {row['dtype']} | {per} | {row['seconds'] * 1e3:.2f} ms | "
                     + " | ".join(cells) + " |")
    return lines


def small_llama() -> Any:
    """The Llama gpu_check.py's meter section trained (on the meta device)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=32000, max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def header() -> list[str]:
    runs = {i: load(i) for i in (1, 2, 3, 4, 5, 6, 7)}
    lines = ["| run | commit | date (UTC) | sections | what changed |", "|---|---|---|---|---|"]
    changes = {1: "first run", 2: "meter again (run 1's oracle refused GQA: MHA Llama)",
               3: "module kernel time from host-side ranges only; CUDA-graph times; clocks ramped",
               4: "profile() with the queue ahead (first version)",
               5: "queue ahead sized by the host's launch before the clock syncs; alignment table",
               6: "training steps of four models no fit saw (all four built first: peaks hold the others)",
               7: "the merged tree after review: profile, one model at a time for the steps, 12 CUDA tests"}
    for i, run in runs.items():
        env = run.get("env", {})
        sections = ", ".join(k for k in ("ceilings", "profile", "meter", "ops", "tests", "steps") if k in run)
        lines.append(f"| {i} | {str(run.get('commit'))[:12]} | {env.get('date', '')[:19]} | {sections} | {changes[i]} |")
    env = runs[3]["env"]
    return [f"Device: {provenance(env)}; {env['sm_count']} SMs, {env['memory_gib']} GiB, L2 {env['l2_mb']} MB; "
            f"clocks {env['nvidia_smi'].splitlines()[1]}.", "", *lines]


def ceilings() -> list[str]:
    lines = ["| run | bf16 8192^3 matmul | device-to-device copy (read + write) |", "|---|---:|---:|"]
    for i in (1, 3):
        c = load(i)["ceilings"]
        lines.append(f"| {i} | {c['matmul']['tflops']:.0f} TFLOP/s | {c['copy']['tb_per_s']:.2f} TB/s |")
    return lines


def tests() -> list[str]:
    lines = ["| run | tests/test_cuda.py |", "|---|---|"]
    for i in (1, 3, 4, 5, 7):
        lines.append(f"| {i} | {load(i)['tests']['summary']} |")
    return lines


def profiles() -> list[str]:
    """Per module over 1 ms: CUDA-event latency (before and after the queue ahead) against torch.profiler's
    kernel time for the same module, each run's events against that run's own kernel time."""
    lines = ["| model | module | kernels (torch.profiler), run 3 / run 5 | events, host-paced (run 3) | "
             "events, queue ahead (run 5) |", "|---|---|---:|---:|---:|"]
    before, after = load(3)["profile"], load(5)["profile"]
    for model in ("gpt2", "resnet50"):
        for name, stats in after[model]["modules"].items():
            kernels = stats["kernel_seconds"]
            if not kernels or max(stats["latency"] or 0, kernels) < 1e-3:
                continue
            old, old_kernels = before[model]["modules"][name]["latency"], before[model]["modules"][name]["kernel_seconds"]
            lines.append(f"| {after[model]['model'].split(',')[0]} | {name} ({stats['type']}) | "
                         f"{old_kernels * 1e3:.3f} / {kernels * 1e3:.3f} ms | "
                         f"{old * 1e3:.3f} ms ({error(old, old_kernels):+.0%}) | "
                         f"{stats['latency'] * 1e3:.3f} ms ({error(stats['latency'], kernels):+.0%}) |")
    lines += ["", "| model | plain forward, run 3 / run 5 | hooked (run 3, over its plain) | hooked, queue ahead (run 5) | "
                  "host launch plain / hooked (run 5) | roofline prediction | utilization (run 5) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for model in ("gpt2", "resnet50"):
        b, a = before[model], after[model]
        lines.append(f"| {a['model']} | {b['fwd_latency'] * 1e3:.2f} / {a['fwd_latency'] * 1e3:.2f} ms | "
                     f"{b['hooked_fwd_latency'] * 1e3:.2f} ms "
                     f"({b['hook_overhead']:.2f}x) | {a['hooked_fwd_latency'] * 1e3:.2f} ms | "
                     f"{a['extra']['host_launch_plain'] * 1e3:.2f} / {a['extra']['host_launch_hooked'] * 1e3:.2f} ms | "
                     f"{a['predicted_latency'] * 1e3:.2f} ms | {a['utilization']:.1%} |")
    return lines


def meter() -> list[str]:
    lines = ["| run | model | FLOPs: meter / FlopCounterMode (real step) | step time, bare / metered (median) | "
             "logged MFU (median) | FLOPs / bare step / peak |", "|---|---|---|---:|---:|---:|"]
    for i in (2, 3):
        m = load(i)["meter"]
        logged = [step["mfu"] for step in m["logged"]]
        flops = m["logged"][-1]["flops"]
        same = "equal" if flops == m["oracle_flops"] else "differ"
        lines.append(f"| {i} | {m['model']} | {flops:,} / {m['oracle_flops']:,} ({same}) | "
                     f"{statistics.median(m['bare_step_seconds']) * 1e3:.2f} / "
                     f"{statistics.median(m['metered_step_seconds']) * 1e3:.2f} ms | {statistics.median(logged):.2%} | "
                     f"{m['mfu_from_oracle']:.2%} |")
    return lines


def spread() -> list[str]:
    """The same ops timed in runs 1 and 3 (CUDA events, L2 flushed): how much a measurement moves."""
    first, third = load(1)["ops"], load(3)["ops"]
    diffs = []
    for part in ("gemm", "memory", "gemm_grid"):
        for a, b in zip(first[part], third[part]):
            if a.get("shape") == b.get("shape") and a.get("op") == b.get("op") and a["seconds"] > 20e-6 \
                    and not a["op"].endswith("_backward"):  # those time the autograd engine's host work
                diffs.append(abs(b["seconds"] / a["seconds"] - 1))
    return [f"Forward ops over 20 us timed in both runs 1 and 3: {len(diffs)}; run-to-run difference median "
            f"{statistics.median(diffs):.1%}, 90th percentile {sorted(diffs)[int(0.9 * len(diffs))]:.1%}, "
            f"largest {max(diffs):.1%}."]


PER_OP_INTRO = ("Median absolute error and how many ops fall within 25%, per op class; `roofline` is FLOPs at the "
                "datasheet peak or bytes at the datasheet bandwidth; the preset uses published constants only; the "
                "measured file was fitted to the other half of the ops (see the script's docstring).")


def report(devices: dict[str, Any]) -> str:
    _, validate = split_rows()
    parts = [
        "# On a lent GPU: measured vs predicted (issue 42)", "",
        "Written by `python benchmarks/gpu_tables.py --output benchmarks/results/gpu_h200.md` from the runs of "
        "`benchmarks/gpu_check.py` kept in `benchmarks/results/gpu/`.", "",
        "## Runs", "", *header(), "",
        "## Ceilings", "", *ceilings(), "",
        "## CUDA tests", "", *tests(), "",
        "## profile(): module latency against the kernels torch.profiler attributes to the module", "", *profiles(), "",
        "## The meter on real bf16 training steps", "", *meter(), "",
        "## Per op: predicted vs measured, on ops the measured device file was not fitted to", "",
        PER_OP_INTRO, "",
        *summary(validate, devices), "", *spread(), "",
        "## Whole models (never fitted)", "", *whole_models(devices), "", *unseen_step_rows(devices), "",
        "## The optimizer step: measured multi-tensor kernels against fused and foreach predictions", "",
        "torch.optim.AdamW's default on CUDA is its foreach implementation: eight multi-tensor kernels a step "
        "(fxflops.predict.optimizer_time), not one fused pass.", "",
        *optimizer_step_rows(RESULTS / "h200_run7.json", devices), "",
        "## Every validation op", "", *detail(validate, devices), "",
    ]
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-device", action="store_true", help="(re)write the measured device file")
    parser.add_argument("--detail", action="store_true", help="every validation op, not only the summary")
    parser.add_argument("--output", type=Path, help="write the whole report there")
    args = parser.parse_args()
    fitted_device(args.write_device)
    devices = {"roofline": "roofline", "H200 SXM preset": device_model("H200 SXM"),
               "H200 SXM measured": device_model(str(DEVICE_FILE))}
    if args.output:
        args.output.write_text(report(devices), encoding="utf-8")
        return
    _, validate = split_rows()
    print("\n".join(summary(validate, devices)))
    print()
    print("\n".join(whole_models(devices)))
    print()
    print("\n".join(unseen_step_rows(devices)))
    print()
    print("\n".join(optimizer_step_rows(RESULTS / "h200_run7.json", devices)))
    if args.detail:
        print()
        print("\n".join(detail(validate, devices)))


if __name__ == "__main__":
    main()
