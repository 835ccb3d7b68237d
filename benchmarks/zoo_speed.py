"""How long one counting call takes: fxflops.estimate() vs FlopCounterMode on fake tensors, over a model zoo.

For each model of the zoo (8 torchvision CNNs/ViTs at 1x3x224x224, 6 Hugging Face models at batch 1,
seq 128, built from config classes: nothing is downloaded) this times, each in a fresh subprocess:

  fxflops      fxflops.estimate(model, args, kwargs), default options, on the real model (random
               weights, eval mode) and real inputs; afterwards, untimed, the same call with
               conventions="torch" for the equality check (first round only)
  flopcounter  the reference: model and inputs built inside FakeTensorMode(), then one forward under
               torch.no_grad(), sdpa_kernel(SDPBackend.MATH) and FlopCounterMode(display=False), with
               torch.backends.mha.set_fastpath_enabled(False)
  forward      one plain forward of the real model under torch.no_grad() (context only)

Only the call is timed (wall and process CPU time); model construction is not. Rounds interleave the
models and tools, and the table shows medians. `--startup` instead times `python -c "import torch"`
against the `fxflops lenet5` console script (5 runs each, interleaved).

    python benchmarks/zoo_speed.py                                      # whole zoo, writes results/zoo_speed.md
    python benchmarks/zoo_speed.py --models resnet18,gpt2 --repeat 1 --output ''   # quick look
    python benchmarks/zoo_speed.py --startup                            # writes results/zoo_startup.md

Every subprocess gets PYTHONPATH=<this checkout>, so it imports this checkout's fxflops whatever is
installed. Only fxflops' public API (estimate, the CLI) is used.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from common import environment, status_kib
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "zoo_speed.md")
STARTUP_RESULTS = os.path.join(HERE, "results", "zoo_startup.md")
TOOLS = ("fxflops", "flopcounter", "forward")
BATCH, SEQ, IMAGE = 1, 128, 224
STARTUP_RUNS = 5


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo: how to build it and what it is fed."""

    name: str
    source: str  # "torchvision" or "transformers"
    model_class: str  # torchvision.models builder, or transformers model class
    config_class: str = ""  # transformers config class
    config: tuple[tuple[str, Any], ...] = ()  # explicit config fields; () = library defaults
    inputs: str = "image"  # "image" (positional), "pixel_values", "tokens", "seq2seq"
    note: str = ""


ZOO: tuple[ZooModel, ...] = (
    *(ZooModel(name, "torchvision", name) for name in (
        "resnet18", "resnet50", "mobilenet_v2", "efficientnet_b0", "vit_b_16", "convnext_tiny", "swin_t",
        "densenet121")),
    ZooModel("gpt2", "transformers", "GPT2LMHeadModel", "GPT2Config", inputs="tokens",
             note="default GPT2Config: 12 layers, hidden 768, vocab 50257 (124M)"),
    ZooModel("bert", "transformers", "BertModel", "BertConfig", inputs="tokens",
             note="default BertConfig: BERT-base, 12 layers, hidden 768 (110M)"),
    ZooModel("llama", "transformers", "LlamaForCausalLM", "LlamaConfig",
             (("hidden_size", 1024), ("intermediate_size", 2816), ("num_hidden_layers", 8),
              ("num_attention_heads", 16), ("num_key_value_heads", 4), ("vocab_size", 32000)),
             inputs="tokens", note="hidden 1024, 8 layers, 16 heads, 4 KV heads, intermediate 2816, vocab 32000 (156M)"),
    ZooModel("t5", "transformers", "T5ForConditionalGeneration", "T5Config", inputs="seq2seq",
             note="default T5Config: t5-small, 6+6 layers, d_model 512 (60M); decoder_input_ids of seq 128"),
    ZooModel("qwen2", "transformers", "Qwen2ForCausalLM", "Qwen2Config",
             (("hidden_size", 512), ("intermediate_size", 1408), ("num_hidden_layers", 4),
              ("num_attention_heads", 8), ("num_key_value_heads", 2), ("vocab_size", 32000)),
             inputs="tokens", note="tiny: hidden 512, 4 layers, 8 heads, 2 KV heads, intermediate 1408, vocab 32000 (44M)"),
    ZooModel("hf_vit", "transformers", "ViTModel", "ViTConfig", inputs="pixel_values",
             note="default ViTConfig: ViT-base, patch 16, 224x224 (86M)"),
)


def zoo_model(name: str) -> ZooModel:
    """The zoo entry called `name`."""
    for model in ZOO:
        if model.name == name:
            return model
    raise KeyError(f"unknown model {name!r}; known: {', '.join(m.name for m in ZOO)}")


# --- building a model and its inputs (under whatever tensor mode is active) ---------------------------


def build(spec: ZooModel) -> tuple[Any, tuple, dict]:
    """(model in eval mode, args, kwargs) for `spec`; tensors follow the active mode (real or fake)."""
    import torch

    if spec.source == "torchvision":
        import torchvision

        model = getattr(torchvision.models, spec.model_class)(weights=None)
        return model.eval(), (torch.randn(BATCH, 3, IMAGE, IMAGE),), {}
    import transformers

    config = getattr(transformers, spec.config_class)(**dict(spec.config))
    model = getattr(transformers, spec.model_class)(config).eval()
    if spec.inputs == "pixel_values":
        return model, (), {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE)}
    kwargs = {"input_ids": torch.randint(0, config.vocab_size, (BATCH, SEQ))}
    if spec.inputs == "seq2seq":
        kwargs["decoder_input_ids"] = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    return model, (), kwargs


# --- one measurement, in its own process ----------------------------------------------------------------


@contextlib.contextmanager
def stopwatch(result: dict) -> Iterator[None]:
    """Record the block's wall and process CPU seconds, and the peak RSS after it, into `result`."""
    result["rss_before_kib"] = status_kib("VmRSS")
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    result["wall_s"], result["cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
    result["peak_kib"] = status_kib("VmHWM")


def first_line(error: BaseException | str) -> str:
    """`Type: first line of the message`, for a table cell."""
    if isinstance(error, BaseException):
        text = str(error).strip().splitlines()
        return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
    return error.strip().splitlines()[0] if error.strip() else "(no message)"


def measure_fxflops(spec: ZooModel, totals: bool) -> dict:
    """Time fxflops.estimate() on the real model; then, untimed, its torch-convention total."""
    import fxflops

    result: dict = {"fxflops_file": fxflops.__file__}
    start = time.perf_counter()
    model, args, kwargs = build(spec)
    result["setup_s"] = time.perf_counter() - start
    with stopwatch(result):
        est = fxflops.estimate(model, args, kwargs)
    result["macs"], result["flops"] = est.total_macs, est.total_flops
    result["params"] = est.total_params
    result["method"] = getattr(est, "method", None)
    result["nodes"] = len(getattr(est, "nodes", ()))
    result["unknown"] = [u.op for u in getattr(est, "unknown", ())]
    if totals:
        del est
        try:
            result["flops_torch"] = fxflops.estimate(model, args, kwargs, conventions="torch").total_flops
        except Exception as error:  # noqa: BLE001 - reported in the table
            result["torch_error"] = first_line(error)
    return result


def measure_flopcounter(spec: ZooModel) -> dict:
    """Time FlopCounterMode over one forward of the model built on fake tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    torch.backends.mha.set_fastpath_enabled(False)  # nn.MultiheadAttention's fused kernel is not counted
    result: dict = {}
    start = time.perf_counter()
    with FakeTensorMode():
        model, args, kwargs = build(spec)
        result["setup_s"] = time.perf_counter() - start
        with stopwatch(result):
            with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
                model(*args, **kwargs)
    result["flops_torch"] = counter.get_total_flops()
    return result


def measure_forward(spec: ZooModel) -> dict:
    """Time one plain forward of the real model (the first in this process)."""
    import torch

    result: dict = {}
    start = time.perf_counter()
    model, args, kwargs = build(spec)
    result["setup_s"] = time.perf_counter() - start
    with stopwatch(result), torch.no_grad():
        model(*args, **kwargs)
    return result


def worker(tool: str, name: str, totals: bool) -> dict:
    """One measurement of `tool` on model `name`; an exception becomes result["error"]."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    spec = zoo_model(name)
    result: dict = {"tool": tool, "model": name, "threads": torch.get_num_threads()}
    try:
        if tool == "fxflops":
            result.update(measure_fxflops(spec, totals))
        elif tool == "flopcounter":
            result.update(measure_flopcounter(spec))
        elif tool == "forward":
            result.update(measure_forward(spec))
        else:
            raise ValueError(f"unknown tool {tool!r}")
    except Exception as error:  # noqa: BLE001 - a failing tool is a table cell, not a crash
        result["error"] = first_line(error)
    return result


def child_env() -> dict[str, str]:
    """The environment of every subprocess: this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def run_worker(tool: str, name: str, totals: bool, timeout: float) -> dict:
    """Run worker() in a fresh Python process and return its JSON result (or an error)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", tool, name] + (["--totals"] if totals else [])
    base = {"tool": tool, "model": name}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=child_env())
    except subprocess.TimeoutExpired:
        return {**base, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        return {**base, "error": f"rc={proc.returncode}: {tail[-1] if tail else '(no output)'}"}
    return json.loads(lines[-1])


# --- the report -------------------------------------------------------------------------------------------


def summarize(runs: list[dict]) -> dict:
    """Median wall/CPU/setup over the successful runs, their range, the highest peak RSS, and the totals."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"] if runs else "not run"}
    summary = {k: v for r in ok for k, v in r.items()}
    summary["runs"], summary["failed"] = len(ok), len(runs) - len(ok)
    for key in ("wall_s", "cpu_s", "setup_s"):
        summary[key] = statistics.median(r[key] for r in ok)
    summary["wall_range"] = (min(r["wall_s"] for r in ok), max(r["wall_s"] for r in ok))
    summary["peak_kib"] = max(r["peak_kib"] for r in ok)
    return summary


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _time(r: dict) -> str:
    """Median wall seconds, with the range when there were several runs, or the error."""
    if "wall_s" not in r:
        return _cell(r["error"])
    lo, hi = r["wall_range"]
    spread = f" [{lo:.2f}–{hi:.2f}]" if r["runs"] > 1 else ""
    failed = f" ({r['failed']} failed)" if r["failed"] else ""
    return f"{r['wall_s']:.2f}{spread}{failed}"


def _ratio(a: dict, b: dict, key: str) -> float | None:
    return a[key] / b[key] if key in a and key in b and b[key] > 0 else None


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _equal(fx: dict, fc: dict) -> str:
    """Whether fxflops' torch-preset FLOPs equal FlopCounterMode's total."""
    if "torch_error" in fx:
        return _cell(fx["torch_error"])
    if "flops_torch" not in fx or "flops_torch" not in fc:
        return "—"
    delta = fx["flops_torch"] - fc["flops_torch"]
    return "yes" if delta == 0 else f"NO (Δ {delta:+,}, {delta / fc['flops_torch']:+.2%})"


def geomean(values: Sequence[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def render(runs: dict[tuple[str, str], list[dict]], names: Sequence[str], env: str) -> str:
    """The markdown report: the speed table, its geometric mean, and a details table."""
    cells = {key: summarize(value) for key, value in runs.items()}
    out = [
        "# One counting call: fxflops.estimate() vs FlopCounterMode on fake tensors", "", env, "",
        "Wall seconds of the call alone, median over the runs [range]; each run is a fresh Python process and",
        "the call is the first of its kind in it. Model construction is not timed. ratio = fxflops median /",
        "FlopCounterMode median. torch totals equal: fxflops with `conventions=\"torch\"` == FlopCounterMode's total.",
        "",
        "| model | fxflops s | FlopCounterMode-fake s | fxflops / FlopCounterMode | forward s | torch totals equal |",
        "|---|---:|---:|---:|---:|---|",
    ]
    wall_ratios, cpu_ratios = [], []
    for name in names:
        fx, fc, fw = (cells.get((name, tool), {"error": "not run"}) for tool in TOOLS)
        ratio = _ratio(fx, fc, "wall_s")
        cpu_ratio = _ratio(fx, fc, "cpu_s")
        wall_ratios += [ratio] if ratio else []
        cpu_ratios += [cpu_ratio] if cpu_ratio else []
        out.append(f"| {name} | {_time(fx)} | {_time(fc)} | {_fmt(ratio)} | {_time(fw)} | {_equal(fx, fc)} |")
    out += ["", f"Geometric mean of fxflops / FlopCounterMode over {len(wall_ratios)} models: "
                f"{_fmt(geomean(wall_ratios))} (median wall), {_fmt(geomean(cpu_ratios))} (median CPU).", ""]

    out += [
        "## Details", "",
        "CPU = process CPU seconds of the call (median); setup = model construction (median, not timed above);",
        "peak RSS = the subprocess' VmHWM (highest over runs, imports and model included). MACs and FLOPs are",
        "fxflops' default (deepspeed) conventions; FLOPs torch = the same call with `conventions=\"torch\"`.",
        "",
        "| model | fxflops CPU s | FCM CPU s | CPU ratio | forward CPU s | setup s (fx / FCM / fwd) "
        "| peak RSS MiB (fx / FCM / fwd) | method | nodes | MACs | FLOPs | FLOPs torch (fxflops) "
        "| FlopCounterMode | unknown ops |",
        "|---|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name in names:
        fx, fc, fw = (cells.get((name, tool), {}) for tool in TOOLS)
        setup = " / ".join(_fmt(r.get("setup_s")) for r in (fx, fc, fw))
        peak = " / ".join(_fmt(r["peak_kib"] / 1024, ",.0f") if "peak_kib" in r else "—" for r in (fx, fc, fw))
        out.append(
            f"| {name} | {_fmt(fx.get('cpu_s'))} | {_fmt(fc.get('cpu_s'))} | {_fmt(_ratio(fx, fc, 'cpu_s'))} | "
            f"{_fmt(fw.get('cpu_s'))} | {setup} | {peak} | {fx.get('method') or '—'} | {fx.get('nodes', '—')} | "
            f"{_fmt(fx.get('macs'), ',')} | {_fmt(fx.get('flops'), ',')} | {_fmt(fx.get('flops_torch'), ',')} | "
            f"{_fmt(fc.get('flops_torch'), ',')} | {_cell(', '.join(sorted(set(fx.get('unknown', [])))) or '—')} |"
        )
    return "\n".join(out) + "\n"


def run_zoo(names: Sequence[str], repeat: int, timeout: float) -> dict[tuple[str, str], list[dict]]:
    """All measurements, in rounds that interleave models and tools; progress goes to stderr."""
    runs: dict[tuple[str, str], list[dict]] = {}
    start = time.perf_counter()
    for round_ in range(max(1, repeat)):
        for name in names:
            for tool in TOOLS:
                r = run_worker(tool, name, totals=round_ == 0, timeout=timeout)
                runs.setdefault((name, tool), []).append(r)
                shown = r.get("error") or f"{r['wall_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU"
                print(f"[{time.perf_counter() - start:6.0f} s] round {round_ + 1}: {name} {tool}: {shown}",
                      file=sys.stderr, flush=True)
    return runs


# --- --startup: process start of `import torch` vs the fxflops CLI ---------------------------------------


def fxflops_command() -> list[str]:
    """The installed `fxflops` console script next to this Python, on PATH, or else `python -m fxflops.cli`.

    The one next to sys.executable comes first: a PATH entry may be a wrapper (pyenv's shim is a shell
    script that starts `pyenv exec`), which would add its own start-up time to the CLI's.
    """
    script = os.path.join(sysconfig.get_path("scripts"), "fxflops")
    if os.access(script, os.X_OK):
        return [script]
    found = shutil.which("fxflops")
    return [found] if found else [sys.executable, "-m", "fxflops.cli"]


def time_command(cmd: Sequence[str]) -> tuple[float, float]:
    """Wall and CPU (user + sys of the child) seconds of one run of `cmd`; fails if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT, env=child_env())
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run_startup(runs: int) -> str:
    """Median wall/CPU of `python -c "import torch"` and `fxflops lenet5`, interleaved; a markdown report."""
    commands = {"import torch": [sys.executable, "-c", "import torch"], "fxflops lenet5": fxflops_command() + ["lenet5"]}
    which = subprocess.run([sys.executable, "-c", "import fxflops; print(fxflops.__file__)"], capture_output=True,
                           text=True, cwd="/", env=child_env()).stdout.strip()
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in commands}
    for _ in range(runs):
        for label, cmd in commands.items():
            times[label].append(time_command(cmd))
    med = {label: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for label, t in times.items()}
    out = [
        "# Start-up: `python -c \"import torch\"` vs the fxflops CLI", "", environment(("torch", "torchvision", "transformers")), "",
        f"Median over {runs} runs each, interleaved; wall seconds [range] and the child's CPU seconds (user + sys).",
        f"fxflops imported from `{which}`.", "",
        "| command | wall s | CPU s |", "|---|---:|---:|",
    ]
    for label, cmd in commands.items():
        walls = [w for w, _ in times[label]]
        shown = shlex.join(cmd)
        out.append(f"| {label}: `{shown}` | {med[label][0]:.2f} [{min(walls):.2f}–{max(walls):.2f}] "
                   f"| {med[label][1]:.2f} |")
    ratio_wall = med["fxflops lenet5"][0] / med["import torch"][0]
    ratio_cpu = med["fxflops lenet5"][1] / med["import torch"][1]
    out += ["", f"fxflops lenet5 / import torch: {ratio_wall:.2f} (median wall), {ratio_cpu:.2f} (median CPU)."]
    return "\n".join(out) + "\n"


# --- entry point ----------------------------------------------------------------------------------------------


def parse_models(text: str) -> list[str]:
    """Comma-separated zoo names (validated), in the order given; empty = the whole zoo."""
    names = [n.strip() for n in text.split(",") if n.strip()] or [m.name for m in ZOO]
    for name in names:
        zoo_model(name)
    return names


def write(report: str, path: str) -> None:
    """Print the report, and write it to `path` unless that is ''."""
    print(report)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="", help=f"comma-separated subset of: {', '.join(m.name for m in ZOO)}")
    parser.add_argument("--repeat", type=int, default=3, help="runs per model and tool (medians are shown)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per measurement subprocess")
    parser.add_argument("--output", default=None,
                        help=f"markdown file ('' = print only); default {os.path.relpath(RESULTS, ROOT)}, "
                             f"or {os.path.relpath(STARTUP_RESULTS, ROOT)} with --startup")
    parser.add_argument("--startup", action="store_true",
                        help=f"time `python -c 'import torch'` vs `fxflops lenet5` ({STARTUP_RUNS} runs each) instead")
    parser.add_argument("--worker", nargs=2, metavar=("TOOL", "MODEL"), help=argparse.SUPPRESS)
    parser.add_argument("--totals", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        with contextlib.redirect_stdout(sys.stderr):  # only the JSON line goes to stdout
            result = worker(*args.worker, totals=args.totals)
        print(json.dumps(result))
        return
    if args.startup:
        write(run_startup(STARTUP_RUNS), STARTUP_RESULTS if args.output is None else args.output)
        return
    try:
        names = parse_models(args.models)
    except KeyError as error:
        parser.error(str(error.args[0]))
    start = time.perf_counter()
    report = render(run_zoo(names, args.repeat, args.timeout), names, environment(("torch", "torchvision", "transformers")))
    report += f"\nWhole benchmark: {time.perf_counter() - start:.0f} s wall, --repeat {args.repeat}.\n"
    write(report, RESULTS if args.output is None else args.output)


if __name__ == "__main__":
    main()
