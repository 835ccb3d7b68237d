"""What the per-module timing hooks cost: hooked vs plain forward, resnet50 and a GPT-2-shaped model.

Both models are built with random weights (nothing is downloaded) and run on CPU by default.
Plain and hooked forwards alternate step by step (fxflops.timing.profiling.measure_forward), so drift
in clocks or load hits both alike. The ratio is mean hooked / mean plain forward latency (the
target on CPU is <= 1.15); median and min ratios are printed too, since on a loaded machine the
minimum is the least noisy. A microbenchmark adds the hooks' own cost per module call, measured
on a chain of 200 nn.Identity modules, where nothing else takes time.

    .venv/bin/python benchmarks/hook_overhead.py [--steps 10] [--warm-up 3] [--device cpu]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hook_overhead.py   # steadier on a shared machine

The markdown table goes to stdout and to benchmarks/results/hook_overhead.md (--out to change).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from fxflops.timing.clocks import time_calls
from fxflops.timing.placement import device_name
from fxflops.timing.profiling import measure_forward

TARGET = 1.15


def resnet50(device: torch.device) -> tuple[torch.nn.Module, tuple, dict]:
    import torchvision

    model = torchvision.models.resnet50(weights=None).eval().to(device)
    return model, (torch.randn(1, 3, 224, 224, device=device),), {}


def gpt2_shaped(device: torch.device) -> tuple[torch.nn.Module, tuple, dict]:
    """GPT-2 small's shape (12 layers, width 768, 12 heads) from its config class, random weights."""
    import transformers

    config = transformers.GPT2Config(bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval().to(device)
    ids = torch.randint(0, config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0)).to(device)
    return model, (ids,), {"use_cache": False}


MODELS: dict[str, Callable[[torch.device], tuple[torch.nn.Module, tuple, dict]]] = {
    "resnet50 (1x3x224x224)": resnet50,
    "gpt2-shaped (1x128 tokens)": gpt2_shaped,
}


def measure(name: str, build: Callable, device: torch.device, warm_up: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, args, kwargs = build(device)
    plain, records, host = measure_forward(model, args, kwargs, device=device, warm_up=warm_up, steps=steps)
    hooked = [r.latency for r in records]
    if host is not None:
        # on a GPU the hooked pass runs with the host queued ahead (device time) and the plain one host-paced:
        # their latencies' ratio is not the hooks' cost; the host's time to launch each is (medians)
        plain, hooked = [host[0]], [host[1]]
    return {
        "model": name,
        "modules_hooked": sum(1 for _ in model.modules()),
        "plain_mean_s": statistics.fmean(plain),
        "hooked_mean_s": statistics.fmean(hooked),
        "plain_median_s": statistics.median(plain),
        "hooked_median_s": statistics.median(hooked),
        "ratio_mean": statistics.fmean(hooked) / statistics.fmean(plain),
        "ratio_median": statistics.median(hooked) / statistics.median(plain),
        "ratio_min": min(hooked) / min(plain),
    }


def hook_cost_per_call(device: torch.device, modules: int = 200, repeats: int = 300) -> float:
    """Seconds the hooks add to one module call: best hooked minus best plain forward of an
    Identity chain, divided by the number of modules (replay and root bookkeeping included)."""
    from fxflops.timing.clocks import make_clock
    from fxflops.timing.latency import ModuleTimer

    chain = torch.nn.Sequential(*[torch.nn.Identity() for _ in range(modules)])
    x = torch.zeros(1, device=device)
    clock = make_clock(device)

    def best() -> float:
        return min(time_calls(lambda: chain(x), 1, clock)[0] for _ in range(repeats))

    plain = best()
    with ModuleTimer(chain, clock):
        hooked = best()
    return (hooked - plain) / modules


def markdown(rows: list[dict[str, Any]], per_call: float, device: torch.device, warm_up: int, steps: int) -> str:
    import transformers

    lines = [
        "# Hook overhead of fxflops' timed pass: hooked vs plain forward",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}, "
        f"{device} ({device_name(device)}), threads: {torch.get_num_threads()}; {datetime.date.today()}; "
        f"{warm_up} warm-up + {steps} steps, plain and hooked forwards alternating.",
        "",
        "ratio = hooked / plain forward latency (mean; median and min beside it). Target on CPU: "
        f"<= {TARGET}." + (" On a GPU: the host's median time to launch each forward (the hooked pass's latency is "
                           "device time there, fxflops.timing.clocks.QueueAhead)." if device.type == "cuda" else ""),
        "",
        "| model | modules | plain (ms) | hooked (ms) | ratio | median ratio | min ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['model']} | {r['modules_hooked']} | {r['plain_mean_s'] * 1e3:.2f} | {r['hooked_mean_s'] * 1e3:.2f} "
        f"| {r['ratio_mean']:.3f} | {r['ratio_median']:.3f} | {r['ratio_min']:.3f} |"
        for r in rows
    ]
    lines += ["", f"Hook cost per module call (200 x nn.Identity, best of 300): {per_call * 1e6:.2f} us.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warm-up", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="benchmarks/results/hook_overhead.md", help="markdown file ('' = none)")
    options = parser.parse_args(argv)
    device = torch.device(options.device)
    rows = [measure(name, build, device, options.warm_up, options.steps) for name, build in MODELS.items()]
    report = markdown(rows, hook_cost_per_call(device), device, options.warm_up, options.steps)
    print(report)
    if options.out:
        with open(options.out, "w", encoding="utf-8") as out:
            out.write(report)
    return 0 if all(row["ratio_mean"] <= TARGET for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
