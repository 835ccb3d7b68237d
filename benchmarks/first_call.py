"""The first counting call in a fresh process, as a user meets it: fxflops vs FlopCounterMode (issue 23).

    python benchmarks/first_call.py                     # zoo + Llama-2 shapes, writes results/first_call.md
    python benchmarks/first_call.py --zoo resnet18,gpt2 --llama 7b --output ''   # quick look, print only

Every measurement is its own Python subprocess (this checkout first on PYTHONPATH); only the counting
call is timed (wall and process CPU), and it is the first of its kind in that process; each cell is the
fastest of `--repeats` such processes (3), since one sample moves by ±30% on a shared 2-core machine. Before it, in
every process and untimed: imports, model construction, and torch's own first use of FakeTensorMode
(it imports torch._dynamo, ~1 s, which any fake-tensor tool pays once per process).

  fxflops       the model built on the meta device (`with torch.device("meta")`), meta inputs;
                timed: fxflops.estimate(model, args, kwargs), default options
  fcm_math      the model and inputs built under FakeTensorMode(); timed, outside that mode:
                torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False), one
                forward (MATH so that FlopCounterMode sees attention; MHA fast path off)
  fcm_default   the same with torch's default SDPA backend (what wrapping a forward in
                FlopCounterMode gives; on CPU it counts no attention)

The zoo is benchmarks/zoo_speed.py's (torchvision at 1x3x224x224, transformers at batch 1, seq 128);
the Llama-2-7B and -70B shapes (benchmarks/estimate_llama.py's configs) run at batch 1, `--seq`
tokens, with use_cache=False and True. The tiny row is a 3-layer MLP's first estimate().
Ratios are fxflops / FlopCounterMode of the same run; the machine's load moves both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

from common import ROOT, environment, status_kib

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "first_call.md")
TOOLS = ("fxflops", "fcm_math", "fcm_default")
ZOO_DEFAULT = ("resnet18", "resnet50", "mobilenet_v2", "efficientnet_b0", "densenet121",
               "gpt2", "bert", "llama", "t5", "qwen2")  # those FlopCounterMode can build on fake tensors


def _pay_fake_first_use() -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        torch.empty(2, 3) @ torch.empty(3, 4)


def _build(model: str, use_cache: bool | None, seq: int):
    """(model, args, kwargs) under whatever device/mode is active."""
    import torch

    if model == "tiny":
        net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        return net.eval(), (torch.randn(2, 64),), {}
    if model in ("7b", "70b"):
        from estimate_llama import SHAPES, _config
        from transformers import LlamaForCausalLM

        net = LlamaForCausalLM(_config(SHAPES[model])).eval()
        return net, (), {"input_ids": torch.zeros(1, seq, dtype=torch.long), "use_cache": use_cache}
    from zoo_speed import build, zoo_model

    return build(zoo_model(model))


def worker(tool: str, model: str, use_cache: bool | None, seq: int) -> dict:
    import contextlib
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.backends.mha.set_fastpath_enabled(tool == "fxflops")  # FlopCounterMode does not count the fused kernel
    _pay_fake_first_use()
    result: dict = {"tool": tool, "model": model, "use_cache": use_cache}
    if tool == "fxflops":
        from fxflops import estimate  # `import fxflops` is lazy: the import is untimed, as for FlopCounterMode

        with torch.device("meta"):
            net, args, kwargs = _build(model, use_cache, seq)
        before = status_kib("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        est = estimate(net, args, kwargs)
        result["wall_s"], result["cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
        result["macs"], result["flops"] = est.total_macs, est.total_flops
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.utils.flop_counter import FlopCounterMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            net, args, kwargs = _build(model, use_cache, seq)
        backend = sdpa_kernel(SDPBackend.MATH) if tool == "fcm_math" else contextlib.nullcontext()
        before = status_kib("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad(), backend, FlopCounterMode(display=False) as counter:
            net(*args, **kwargs)
        result["wall_s"], result["cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
        result["flops_torch"] = counter.get_total_flops()
    result["rss_before_mib"], result["peak_mib"] = before / 1024, status_kib("VmHWM") / 1024
    return result


def run_worker(tool: str, model: str, use_cache: bool | None, seq: int, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", tool, model, str(use_cache), str(seq)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, HERE, os.environ.get("PYTHONPATH", "")) if p))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        return {"error": f"rc={proc.returncode}: {tail[-1] if tail else '(no output)'}"}
    return json.loads(lines[-1])


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _f(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def fastest(runs: list[dict]) -> dict:
    """The run with the least CPU time (each a fresh process; the others differ by the machine's noise)."""
    done = [run for run in runs if "error" not in run]
    return min(done, key=lambda run: run["cpu_s"]) if done else runs[0]


def render(rows: list[tuple[str, dict[str, dict]]], env: str, seconds: float, repeats: int = 1) -> str:
    out = ["# First counting call in a fresh process: fxflops vs FlopCounterMode", "", env, "",
           "Seconds of the call alone (wall; CPU in the ratio columns' brackets); each cell the fastest (in CPU) "
           f"of {repeats} fresh processes, ",
           "model built before timing (meta for fxflops, FakeTensorMode for FlopCounterMode, counted outside it).",
           "", "| model | fxflops s | FCM math s | FCM default s | ÷ FCM math (CPU) | ÷ FCM default (CPU) "
           "| fxflops peak RSS MiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    ratios: dict[str, list[float]] = {"math": [], "default": [], "math_cpu": [], "default_cpu": []}
    for label, cells in rows:
        fx = cells["fxflops"]
        cols = []
        for tool, key in (("fcm_math", "math"), ("fcm_default", "default")):
            fc = cells.get(tool, {})
            if "wall_s" in fx and "wall_s" in fc:
                wall, cpu = fx["wall_s"] / fc["wall_s"], fx["cpu_s"] / fc["cpu_s"]
                if not label.startswith(("Llama", "tiny")):
                    ratios[key].append(wall)
                    ratios[key + "_cpu"].append(cpu)
                cols.append(f"{wall:.2f} ({cpu:.2f})")
            else:
                cols.append("—")
        times = [_f(c.get("wall_s")) if "error" not in c else c["error"][:60] for c in
                 (fx, cells.get("fcm_math", {}), cells.get("fcm_default", {}))]
        out.append(f"| {label} | {' | '.join(times)} | {' | '.join(cols)} | {_f(fx.get('peak_mib'), ',.0f')} |")
    out += ["", f"Geometric mean over the {len(ratios['math'])} zoo models: fxflops ÷ FlopCounterMode = "
                f"{_f(_geomean(ratios['math']))} wall ({_f(_geomean(ratios['math_cpu']))} CPU) with MATH SDPA, "
                f"{_f(_geomean(ratios['default']))} wall ({_f(_geomean(ratios['default_cpu']))} CPU) with the default SDPA.",
            "", f"Whole run: {seconds:.0f} s.", ""]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", default=",".join(ZOO_DEFAULT), help="comma-separated zoo models ('' for none)")
    parser.add_argument("--llama", default="7b,70b", help="comma-separated Llama-2 shapes ('' for none)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens for the Llama-2 shapes")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per cell; the fastest is shown")
    parser.add_argument("--output", default=RESULTS, help="markdown file to write ('' to print only)")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        tool, model, cache, seq = options.worker
        print(json.dumps(worker(tool, model, {"None": None, "True": True, "False": False}[cache], int(seq))))
        return
    configs: list[tuple[str, str, bool | None]] = [("tiny (3-layer MLP)", "tiny", None)]
    configs += [(name, name, None) for name in options.zoo.split(",") if name]
    configs += [(f"Llama-2-{key.upper()} seq {options.seq} use_cache={cache}", key, cache)
                for key in options.llama.split(",") if key for cache in (False, True)]
    start = time.perf_counter()
    rows = []
    for label, model, cache in configs:
        cells = {}
        for tool in TOOLS:
            cells[tool] = fastest([run_worker(tool, model, cache, options.seq, options.timeout)
                                   for _ in range(options.repeats)])
            shown = cells[tool].get("error") or f"{cells[tool]['wall_s']:.2f} s wall, {cells[tool]['cpu_s']:.2f} s CPU"
            print(f"[{time.perf_counter() - start:5.0f} s] {label} {tool}: {shown}", file=sys.stderr, flush=True)
        rows.append((label, cells))
    report = render(rows, environment(("torch", "torchvision", "transformers")), time.perf_counter() - start,
                    options.repeats)
    print(report)
    if options.output:
        with open(options.output, "w") as handle:
            handle.write(report)


if __name__ == "__main__":
    main()
