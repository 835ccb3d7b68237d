"""The first counting call in a fresh process, as a user meets it: fxflops vs FlopCounterMode (issues 23, 37).

    python benchmarks/first_call.py                     # zoo + Llama-2 shapes, writes results/first_call.md
    python benchmarks/first_call.py --zoo resnet18,gpt2 --llama 7b --output ''   # quick look, print only

Every measurement is its own Python subprocess (this checkout first on PYTHONPATH); it is the first
call of its kind in that process; each cell is the fastest of `--repeats` such processes (3), since one
sample moves by ±30% on a shared 2-core machine. Two columns per tool, each from its own processes:

  call alone        only the counting call is timed (wall and process CPU). Before it, untimed: imports,
                    model construction, and torch's own first use of FakeTensorMode (it imports
                    torch._dynamo, ~1 s, which any fake-tensor tool pays once per process).
  imports included  what a user's first call in a fresh process costs: the tool's imports, torch's first
                    use of FakeTensorMode and the first call, timed together (`import torch`, the
                    model's library and the model's construction stay untimed, and before anything a
                    meta copy of the model is built, so that both tools find the modules its
                    construction imports loaded: torchvision and transformers' model modules import
                    torch._dynamo, so on those rows the ~1 s first-use cost is paid by them, outside
                    both tools' times; the tiny row, torch alone, pays it). fxflops: `import fxflops` + estimate() (which
                    makes the first fake tensors). FlopCounterMode: importing it and FakeTensorMode and
                    a first op under FakeTensorMode (timed), the model built under that mode (untimed),
                    then the counting call (timed).

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
Ratios are fxflops / FlopCounterMode of the same run; the machine's load moves both. fxflops' own
modules are byte-compiled first (`compileall`, as pip does on install) and the workers may write
bytecode: a checkout run with PYTHONDONTWRITEBYTECODE=1 would otherwise compile fxflops' sources in
every process (~0.1 s), which no installed copy does.
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


def _import_builder(model: str, use_cache: bool | None, seq: int) -> None:
    """Everything the model's construction imports, as a user has before any count (untimed): the
    model built once on the meta device and dropped. (`import transformers` alone is lazy: the model
    class' module, imported on construction, is what pays torch's first fake-tensor cost there.)"""
    import torch

    with torch.device("meta"):
        _build(model, use_cache, seq)


def worker(tool: str, model: str, use_cache: bool | None, seq: int, imports: bool = False) -> dict:
    """One first call in this process; `imports`: the tool's imports and torch's first fake-tensor use timed too."""
    import contextlib
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.backends.mha.set_fastpath_enabled(tool == "fxflops")  # FlopCounterMode does not count the fused kernel
    _import_builder(model, use_cache, seq)
    if not imports:
        _pay_fake_first_use()
    result: dict = {"tool": tool, "model": model, "use_cache": use_cache, "imports": imports}
    if tool == "fxflops":
        with torch.device("meta"):
            net, args, kwargs = _build(model, use_cache, seq)
        if not imports:
            from fxflops import estimate  # `import fxflops` is lazy: the import is untimed, as for FlopCounterMode
        before = status_kib("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        if imports:
            from fxflops import estimate
        est = estimate(net, args, kwargs)
        result["wall_s"], result["cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
        result["macs"], result["flops"] = est.total_macs, est.total_flops
    else:
        wall, cpu = time.perf_counter(), time.process_time()
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.utils.flop_counter import FlopCounterMode

        if imports:
            _pay_fake_first_use()
        setup_wall, setup_cpu = time.perf_counter() - wall, time.process_time() - cpu
        with FakeTensorMode(allow_non_fake_inputs=True):
            net, args, kwargs = _build(model, use_cache, seq)
        backend = sdpa_kernel(SDPBackend.MATH) if tool == "fcm_math" else contextlib.nullcontext()
        before = status_kib("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad(), backend, FlopCounterMode(display=False) as counter:
            net(*args, **kwargs)
        result["wall_s"], result["cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
        if imports:
            result["wall_s"] += setup_wall
            result["cpu_s"] += setup_cpu
        result["flops_torch"] = counter.get_total_flops()
    result["rss_before_mib"], result["peak_mib"] = before / 1024, status_kib("VmHWM") / 1024
    return result


def run_worker(tool: str, model: str, use_cache: bool | None, seq: int, timeout: float, imports: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", tool, model, str(use_cache), str(seq), str(imports)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, HERE, os.environ.get("PYTHONPATH", "")) if p))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as an installed copy: fxflops' modules load from bytecode
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


COLUMNS = {"call": "call alone", "imports": "imports included"}


def render(rows: list[tuple[str, dict[str, dict]]], env: str, seconds: float, repeats: int = 1,
           columns: tuple[str, ...] = ("call",)) -> str:
    out = ["# First counting call in a fresh process: fxflops vs FlopCounterMode", "", env, "",
           f"Each cell the fastest (in CPU) of {repeats} fresh processes; wall seconds, CPU in the ratio columns' "
           "brackets. The model is built before timing (meta for fxflops, FakeTensorMode for FlopCounterMode, "
           "counted outside it). *Call alone*: imports and torch's first FakeTensorMode use (~1 s) paid before "
           "timing. *Imports included*: the tool's imports, torch's first FakeTensorMode use and the call, "
           "what a user's first call in a fresh process takes (see the script's docstring).", ""]
    summary = []
    for column in columns:
        table, means = _table(rows, column)
        out += [f"## {COLUMNS[column]}", "", *table, ""]
        summary.append(f"{COLUMNS[column]}: {means}")
    out += [f"Geometric mean over the zoo models, fxflops ÷ FlopCounterMode — {'; '.join(summary)}.", "",
            f"Whole run: {seconds:.0f} s.", ""]
    return "\n".join(out)


def _table(rows: list[tuple[str, dict[str, dict]]], column: str) -> tuple[list[str], str]:
    suffix = "" if column == "call" else f"+{column}"
    out = ["| model | fxflops s | FCM math s | FCM default s | ÷ FCM math (CPU) | ÷ FCM default (CPU) "
           "| fxflops peak RSS MiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    ratios: dict[str, list[float]] = {"math": [], "default": [], "math_cpu": [], "default_cpu": []}
    for label, all_cells in rows:
        cells = {tool: all_cells.get(tool + suffix, {}) for tool in TOOLS}
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
    means = (f"{_f(_geomean(ratios['math']))} wall ({_f(_geomean(ratios['math_cpu']))} CPU) with MATH SDPA, "
             f"{_f(_geomean(ratios['default']))} wall ({_f(_geomean(ratios['default_cpu']))} CPU) with the default SDPA "
             f"({len(ratios['math'])} models)")
    return out, means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", default=",".join(ZOO_DEFAULT), help="comma-separated zoo models ('' for none)")
    parser.add_argument("--llama", default="7b,70b", help="comma-separated Llama-2 shapes ('' for none)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens for the Llama-2 shapes")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per cell; the fastest is shown")
    parser.add_argument("--output", default=RESULTS, help="markdown file to write ('' to print only)")
    parser.add_argument("--columns", default="call,imports",
                        help="comma-separated: call (the call alone), imports (imports and first fake use included)")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        tool, model, cache, seq, imports = options.worker
        print(json.dumps(worker(tool, model, {"None": None, "True": True, "False": False}[cache], int(seq),
                                imports == "True")))
        return
    columns = tuple(column for column in options.columns.split(",") if column)
    unknown = [column for column in columns if column not in COLUMNS]
    if unknown:
        parser.error(f"unknown column {unknown[0]!r}; choose from {', '.join(COLUMNS)}")
    # fxflops byte-compiled as pip compiles an installed copy (a checkout may run with PYTHONDONTWRITEBYTECODE)
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(ROOT, "fxflops")], check=False,
                   env={key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"})
    configs: list[tuple[str, str, bool | None]] = [("tiny (3-layer MLP)", "tiny", None)]
    configs += [(name, name, None) for name in options.zoo.split(",") if name]
    configs += [(f"Llama-2-{key.upper()} seq {options.seq} use_cache={cache}", key, cache)
                for key in options.llama.split(",") if key for cache in (False, True)]
    start = time.perf_counter()
    rows = []
    for label, model, cache in configs:
        cells = {}
        for column in columns:
            suffix = "" if column == "call" else f"+{column}"
            for tool in TOOLS:
                cells[tool + suffix] = fastest([run_worker(tool, model, cache, options.seq, options.timeout,
                                                           imports=column == "imports")
                                                for _ in range(options.repeats)])
                cell = cells[tool + suffix]
                shown = cell.get("error") or f"{cell['wall_s']:.2f} s wall, {cell['cpu_s']:.2f} s CPU"
                print(f"[{time.perf_counter() - start:5.0f} s] {label} {tool} {COLUMNS[column]}: {shown}",
                      file=sys.stderr, flush=True)
        rows.append((label, cells))
    report = render(rows, environment(("torch", "torchvision", "transformers")), time.perf_counter() - start,
                    options.repeats, columns)
    print(report)
    if options.output:
        with open(options.output, "w") as handle:
            handle.write(report)


if __name__ == "__main__":
    main()
