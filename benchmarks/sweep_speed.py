"""100 points from one sweep against 100 estimate() calls, on the same models in the same process;
and a 10,000-point grid of one sweep.

    python benchmarks/sweep_speed.py [--points 100] [--repeats 3] [--models ...] [--output FILE]

For each model, in a fresh process: a first estimate(), timed (fxflops' lazy imports, first-use costs), and a
full garbage collection (one is due after the imports; each timed phase below starts from a collected heap),
a second estimate() (the warm one the ratios take), then the sweep
(its capture, then `at()` at every point, reading the totals), then estimate() at every point; every
point's total MACs, FLOPs and params must agree exactly. Then, on the warm sweep, `at()` again per
point (totals alone, and with the per-module table read), `points()` per point (totals and the top 3
modules at depth 1, what `result()` and the reports take), and a second sweep capture. The capture is set
against one estimate() of the same model three ways: the process's first capture over the warm estimate(), over
the first estimate() (each the first of its kind), and the second capture over the warm estimate(). The GQA Llama also runs `Sweep.grid` over 100 batch x 100 seq values
(points no piece holds for are captured inside it; the time without them is shown too), checked
against `at()` at 100 sampled points. Each model is measured in `--repeats` fresh processes, and each
time shown is the least of them (process CPU seconds: another job on the machine moves one sample by
tens of percent). The reference is measured in the same process, and each ratio shown is the median of the
processes' own ratios with their range (the least of ratios would pick the process whose reference was slowed);
nothing here is asserted by the test suite.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxflops  # noqa: E402
from benchmarks.common import environment  # noqa: E402
from fxflops.sweeps import sweep  # noqa: E402


def gpt2_small():
    import transformers

    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    return model, lambda seq: (torch.zeros(1, seq, dtype=torch.long, device="meta"),), {"seq": 1}, \
        lambda i: {"seq": 64 + 37 * i}


def llama3_8b_shape():
    """A GQA Llama: Llama-3-8B's shape (32 query heads, 8 key-value heads)."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                      max_position_embeddings=8192)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    # batch 1..4 and seq 128..6167 together
    return model, lambda batch, seq: (torch.zeros(batch, seq, dtype=torch.long, device="meta"),), \
        {"batch": 0, "seq": 1}, lambda i: {"batch": 1 + 3 * i // 99, "seq": 128 + 61 * i}


def resnet50():
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.resnet50().eval()
    # batch 1..6 and image size 33..517 together: point i of 100 has batch 1 + 5i/99, size 33 + 484i/99
    return model, lambda batch, size: (torch.empty(batch, 3, size, size, device="meta"),), \
        {"batch": 0, "size": (2, 3)}, lambda i: {"batch": 1 + 5 * i // 99, "size": 33 + 484 * i // 99}


MODELS = {"gpt2 (small), seq": gpt2_small, "Llama-3-8B shape (GQA), batch and seq": llama3_8b_shape,
          "resnet50, batch and image size": resnet50}
GRID_MODEL = "Llama-3-8B shape (GQA), batch and seq"


def measure(name: str, build, points: int) -> dict:
    model, inputs, dims, point_of = build()
    grid = [point_of(i) for i in range(points)]
    totals = lambda e: (e.total_macs, e.total_flops, e.total_params)  # noqa: E731
    gc.collect()
    start = time.process_time()
    fxflops.estimate(model, inputs(*grid[0].values()))  # the first: fxflops' lazy imports and first-use costs
    first_estimate = time.process_time() - start
    # each timed phase starts from a collected heap: a full collection the imports and the model's
    # construction left due (0.2-0.5 s on this heap) falls on whichever phase allocates first otherwise
    gc.collect()
    start = time.process_time()
    fxflops.estimate(model, inputs(*grid[0].values()))
    one_estimate = time.process_time() - start
    gc.collect()
    start = time.process_time()
    swept = sweep(model, inputs(*grid[0].values()), dims=dims)
    captured = time.process_time() - start
    swept_totals = [totals(swept.at(**point)) for point in grid]
    swept_time = time.process_time() - start
    gc.collect()
    start = time.process_time()
    fresh_totals = [totals(fxflops.estimate(model, inputs(*point.values()))) for point in grid]
    fresh_time = time.process_time() - start
    if swept_totals != fresh_totals:
        raise AssertionError(f"{name}: sweep and estimate() disagree")
    # the warm sweep: at() per point, totals alone and with the per-module table
    repeats = 20
    gc.collect()  # the estimates' garbage is not at()'s cost
    start = time.process_time()
    for _ in range(repeats):
        for point in grid:
            swept.at(**point).total_macs
    at_totals = (time.process_time() - start) / (repeats * len(grid))
    start = time.process_time()
    for point in grid:
        swept.at(**point).modules
    at_modules = (time.process_time() - start) / len(grid)
    start = time.process_time()
    for _ in range(repeats):
        list(swept.points(grid))  # totals and the top 3 modules at depth 1, as result() and the reports take them
    points_each = (time.process_time() - start) / (repeats * len(grid))
    gc.collect()
    start = time.process_time()
    sweep(model, inputs(*grid[0].values()), dims=dims)  # a second capture: sympy's first-use work done
    second_capture = time.process_time() - start
    found = {"name": name, "points": points, "capture": captured, "second_capture": second_capture,
             "first_estimate": first_estimate, "sweep": swept_time, "estimates": fresh_time,
             "one_estimate": one_estimate, "at_totals_us": 1e6 * at_totals, "at_modules_ms": 1e3 * at_modules,
             "points_us": 1e6 * points_each,
             "pieces": len(swept.pieces), "first": grid[0], "last": grid[-1], "holds_for": swept.holds_for}
    if name == GRID_MODEL:
        found.update(grid_10k(swept))
    return found


def grid_10k(swept) -> dict:
    """Sweep.grid over 100 batch x 100 seq values (10,000 points), checked against at() at 100 of them."""
    import random

    values = {"batch": range(1, 101), "seq": range(128, 128 + 61 * 100, 61)}
    before = len(swept.pieces)
    start = time.process_time()
    first = swept.grid(**values)
    with_captures = time.process_time() - start
    start = time.process_time()
    again = swept.grid(**values)
    warm = time.process_time() - start
    sampler = random.Random(0)
    for _ in range(100):
        i, j = sampler.randrange(100), sampler.randrange(100)
        at = swept.at(batch=int(first["batch"][i, j]), seq=int(first["seq"][i, j]))
        if (at.total_macs, at.total_flops, at.total_params) != (first["macs"][i, j], first["flops"][i, j],
                                                                 first["params"][i, j]):
            raise AssertionError("grid and at() disagree")
    if not (first["macs"] == again["macs"]).all():
        raise AssertionError("grid differs between runs")
    return {"grid_points": int(first["macs"].size), "grid_s": with_captures, "grid_warm_s": warm,
            "grid_new_pieces": len(swept.pieces) - before}


def in_fresh_process(name: str, points: int) -> dict:
    """measure() in a new Python process (this checkout first on its path)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, __file__, "--worker", name, "--points", str(points)], capture_output=True,
                          text=True, cwd=root, env=env, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name}: the measuring process failed: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return json.loads(lines[-1])


def least(runs: list[dict]) -> dict:
    """The runs' common facts, each time the least of the runs', each ratio the median of the runs' own ratios
    (a process's capture over its own estimate: the least of ratios would pick the process whose estimate another
    job slowed) with their range."""
    keys = ("capture", "second_capture", "first_estimate", "sweep", "estimates", "one_estimate", "at_totals_us", "at_modules_ms", "points_us", "grid_s",
            "grid_warm_s")
    ratios = {"capture_ratio": ("capture", "one_estimate"), "first_ratio": ("capture", "first_estimate"),
              "warm_ratio": ("second_capture", "one_estimate")}
    out = {**runs[0], **{key: min(run[key] for run in runs) for key in keys if key in runs[0]},
           "at": min(run["sweep"] - run["capture"] for run in runs)}
    for name, (over, under) in ratios.items():
        values = sorted(run[over] / run[under] for run in runs)
        out[name], out[name + "_range"] = statistics.median(values), (values[0], values[-1])
    return out


def shown(row: dict, name: str) -> str:
    low, high = row[name + "_range"]
    return f"{row[name]:.2f}x ({low:.2f}-{high:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per model; the least time is shown")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--output", type=Path)
    parser.add_argument("--worker", choices=list(MODELS), help=argparse.SUPPRESS)
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    if options.worker:
        print(json.dumps(measure(options.worker, MODELS[options.worker], options.points)))
        return
    rows = [least([in_fresh_process(name, options.points) for _ in range(options.repeats)]) for name in options.models]
    lines = [
        "# Sweep speed: one sweep's points against estimate() at each point", "",
        environment(("torch", "transformers", "torchvision")), "",
        f"Process CPU seconds, each time the least of {options.repeats} fresh processes.", "",
        "| model, swept sizes | points (first .. last) | sweep capture | ÷ one estimate() | first ÷ first | "
        "second ÷ warm | points (at()) | sweep total | "
        f"{options.points} estimate() calls | speed-up | at(): totals | at(): + module table | points(): a point | "
        "captures |",
        "|---|---|---|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | {r['points']} ({r['first']} .. {r['last']}) | {r['capture']:.2f} s | "
                     f"{shown(r, 'capture_ratio')} | {shown(r, 'first_ratio')} | {shown(r, 'warm_ratio')} | "
                     f"{r['at']:.3f} s | {r['sweep']:.2f} s | {r['estimates']:.2f} s | "
                     f"{r['estimates'] / r['sweep']:.1f}x | {r['at_totals_us']:.0f} µs | {r['at_modules_ms']:.2f} ms | "
                     f"{r['points_us']:.0f} µs | {r['pieces']} |")
    lines += ["", "Every point's total MACs, FLOPs and params agreed exactly between the sweep and estimate(). "
              "`÷ one estimate()`: the process's first sweep capture over one warm estimate() of the same model (first "
              "point's sizes, after a first one). `first ÷ first`: that capture over the process's first estimate() "
              "(each the first of its kind after the imports: the estimate pays fxflops' lazy imports, the capture "
              "sympy's first use). `second ÷ warm`: a second sweep capture in the process over the warm estimate(). "
              "Each ratio is the median of the processes' own ratios (each process's times over its own), their range in "
              "brackets."]
    for r in rows:
        if "grid_points" in r:
            lines += ["", f"`Sweep.grid` of {r['name']} over batch 1..100 x seq 128..6167 ({r['grid_points']:,} points): "
                      f"{r['grid_s']:.3f} s the first time ({r['grid_new_pieces']} new piece(s) captured inside it), "
                      f"{r['grid_warm_s']:.3f} s on the warm sweep; equal to at() at 100 sampled points."]
    text = "\n".join(lines) + "\n"
    print(text)
    if options.output:
        options.output.write_text(text)


if __name__ == "__main__":
    main()
