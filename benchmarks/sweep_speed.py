"""100 points from one sweep against 100 estimate() calls, on the same models in the same process.

    python benchmarks/sweep_speed.py [--points 100] [--repeats 3] [--models ...] [--output FILE]

For each model, in a fresh process: one warm-up estimate() (imports, first-use costs), then the sweep
(its capture, then `at()` at every point), then estimate() at every point; every point's totals
must agree exactly. Each model is measured in `--repeats` fresh processes, and each time shown is the
least of them (process CPU seconds: another job on the machine moves one sample by tens of percent).
The reference is measured in the same process, so the ratio is what it is on this machine; nothing
here is asserted by the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
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


def llama_7b_shape():
    import transformers

    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                      num_attention_heads=32, vocab_size=32000, max_position_embeddings=8192)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    return model, lambda seq: (torch.zeros(1, seq, dtype=torch.long, device="meta"),), {"seq": 1}, \
        lambda i: {"seq": 128 + 61 * i}


def resnet50():
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.resnet50().eval()
    # batch 1..64 and image size 33..517 together: point i of 100 has batch 1 + 63i/99, size 33 + 484i/99
    return model, lambda batch, size: (torch.empty(batch, 3, size, size, device="meta"),), \
        {"batch": 0, "size": (2, 3)}, lambda i: {"batch": 1 + 63 * i // 99, "size": 33 + 484 * i // 99}


MODELS = {"gpt2 (small), seq": gpt2_small, "Llama-2-7B shape, seq": llama_7b_shape,
          "resnet50, batch and image size": resnet50}


def measure(name: str, build, points: int) -> dict:
    model, inputs, dims, point_of = build()
    grid = [point_of(i) for i in range(points)]
    fxflops.estimate(model, inputs(*grid[0].values()))  # warm-up: imports and first-use costs
    start = time.process_time()
    swept = sweep(model, inputs(*grid[0].values()), dims=dims)
    captured = time.process_time() - start
    swept_totals = [swept.at(**point).total_macs for point in grid]
    swept_time = time.process_time() - start
    start = time.process_time()
    fresh_totals = [fxflops.estimate(model, inputs(*point.values())).total_macs for point in grid]
    fresh_time = time.process_time() - start
    if swept_totals != fresh_totals:
        raise AssertionError(f"{name}: sweep and estimate() disagree")
    return {"name": name, "points": points, "capture": captured, "sweep": swept_time, "estimates": fresh_time,
            "pieces": len(swept.pieces), "first": grid[0], "last": grid[-1], "holds_for": swept.holds_for}


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
    """The runs' common facts, each time the least of the runs'."""
    return {**runs[0], **{key: min(run[key] for run in runs) for key in ("capture", "sweep", "estimates")},
            "at": min(run["sweep"] - run["capture"] for run in runs)}


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
        f"Process CPU seconds, each the least of {options.repeats} fresh processes.", "",
        "| model, swept size | points (first .. last) | sweep capture | points (at()) | sweep total | "
        f"{options.points} estimate() calls | speed-up | captures | first capture holds for |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | {r['points']} ({r['first']} .. {r['last']}) | {r['capture']:.2f} s | "
                     f"{r['at']:.2f} s | {r['sweep']:.2f} s | {r['estimates']:.2f} s | "
                     f"{r['estimates'] / r['sweep']:.1f}x | {r['pieces']} | {r['holds_for']} |")
    lines += ["", "Every point's total MACs agreed exactly between the sweep and estimate()."]
    text = "\n".join(lines) + "\n"
    print(text)
    if options.output:
        options.output.write_text(text)


if __name__ == "__main__":
    main()
