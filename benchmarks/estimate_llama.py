"""Speed and memory of fxflops.estimate() on Llama-2-shaped models (issues 2 and 7).

For a Llama-2-7B- and a Llama-2-70B-shaped `LlamaForCausalLM` (transformers `LlamaConfig`, built on
the meta device, batch 1, seq 2048 and 4096) this measures, each in a fresh subprocess:

  estimate      fxflops.estimate(model, kwargs={"input_ids": ids})            (deepspeed conventions)
  export        torch.export.export(Logits(model), (), {"input_ids": ids}, strict=False)
                -- the bare baseline; `Logits` only returns `.logits`, because export refuses the
                   DynamicCache inside the HF output (fxflops' own wrapper returns every output tensor)
  flopcounter   FlopCounterMode over one forward of the model built under FakeTensorMode, with
                sdpa_kernel(SDPBackend.MATH) (on the meta device the masking code calls .item())

and reports wall time of the call alone, the process' peak RSS (VmHWM), FLOP totals checked
against each other and against a hand formula for a Llama forward. The target (issue 7) is estimate
÷ FlopCounterMode-on-fake-tensors ≤ 1.0 and 70B peak RSS ≤ 1.2 GB; bare export is shown for context.

    .venv/bin/python benchmarks/estimate_llama.py                    # everything (7-15 min on 2 cores)
    .venv/bin/python benchmarks/estimate_llama.py --models 7b --seqs 2048
    .venv/bin/python benchmarks/estimate_llama.py --profile 70b 2048 # where estimate() spends its time

The markdown table goes to stdout and to benchmarks/results/estimate_llama.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from common import environment, status_kib

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "estimate_llama.md")
KINDS = ("estimate", "export", "flopcounter")
BASELINE = "flopcounter"  # the reference the ratio target is checked against
TARGET_RATIO = 1.0  # estimate time / FlopCounterMode time on fake tensors
TARGET_RSS_BYTES = 1.2e9  # peak RSS for the 70B shape


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 32000


SHAPES = {
    "7b": Shape(hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008),
    "70b": Shape(hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672),
}
LABELS = {"7b": "Llama-2-7B", "70b": "Llama-2-70B"}


# --- the hand formula -------------------------------------------------------------------------


def hand_count(shape: Shape, seq: int, batch: int = 1) -> tuple[int, int]:
    """MACs and FLOPs (deepspeed conventions) of one LlamaForCausalLM forward, worked out by hand.

    s = batch*seq tokens, h = hidden, d = head_dim, kv = kv_heads*d, i = intermediate, V = vocab.
    MACs per decoder layer:
      q_proj s*h*h + k_proj s*h*kv + v_proj s*h*kv + o_proj s*h*h     (attention projections)
      gate/up/down s*h*i each                                         (SwiGLU MLP)
      SDPA batch*heads*seq*seq*(d + d) = 2*batch*seq^2*h              (full QK^T and PV, as
                                                                       FlopCounterMode counts it)
    plus the lm_head s*h*V. FLOPs = 2*MACs + the non-MAC work, one FLOP per output element of
    each elementwise op (per input element of a reduction), as DeepSpeed counts it:
      RMSNorm (decomposed by HF: pow, mean, +eps, rsqrt, *, *weight)   4*s*h + 2*s
      RoPE on q: q*cos, -x2 (half), *sin, +                            3.5*s*h
      RoPE on k: the same on kv columns                                3.5*s*kv
      two residual adds                                                2*s*h
      SiLU(gate) and * up                                              2*s*i
      SDPA's softmax: not added (DeepSpeed convention)                 0
    per layer: 2 RMSNorms + the rest = 13.5*s*h + 3.5*s*kv + 2*s*i + 4*s. Once per model:
      final RMSNorm 4*s*h + 2*s; rotary table: positions*inv_freq s*d/2, cos and sin s*d each,
      two *attention_scaling s*d each -> 4.5*s*d.
    Not FLOPs (integer and bool work, which fxflops does not count): the causal mask's
    kv_idx <= q_idx over (1, 1, seq, seq) and the three length-seq index adds for position_ids and
    the mask offsets.
    """
    s, h, i, v = batch * seq, shape.hidden, shape.intermediate, shape.vocab
    d = h // shape.heads
    kv = shape.kv_heads * d
    layer_macs = s * (2 * h * h + 2 * h * kv + 3 * h * i) + 2 * batch * seq * seq * h
    macs = shape.layers * layer_macs + s * h * v
    layer_nonmac2 = 27 * s * h + 7 * s * kv + 4 * s * i + 8 * s  # twice the per-layer non-MAC FLOPs
    model_nonmac2 = 8 * s * h + 4 * s + 9 * s * d
    flops = 2 * macs + (shape.layers * layer_nonmac2 + model_nonmac2) // 2
    return macs, flops


# --- one measurement, in its own process ----------------------------------------------------------


def _config(shape: Shape):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, intermediate_size=shape.intermediate,
                       vocab_size=shape.vocab, max_position_embeddings=4096)


def worker(kind: str, model_key: str, seq: int, totals: bool) -> dict:
    import warnings

    import resource

    import torch
    from transformers import LlamaForCausalLM

    warnings.filterwarnings("ignore")
    shape = SHAPES[model_key]
    config = _config(shape)
    result: dict = {"kind": kind, "model": model_key, "seq": seq}
    t0 = time.perf_counter()

    if kind in ("estimate", "export"):
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model.eval()
        ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
        result["setup_s"] = time.perf_counter() - t0
        result["rss_before_kib"] = status_kib("VmRSS")
        if kind == "estimate":
            import fxflops

            t, c = time.perf_counter(), time.process_time()
            est = fxflops.estimate(model, kwargs={"input_ids": ids})
            result["time_s"], result["cpu_s"] = time.perf_counter() - t, time.process_time() - c
            result["peak_kib"] = status_kib("VmHWM")
            result["method"] = est.method
            result["macs"], result["flops"] = est.total_macs, est.total_flops
            result["params"] = est.total_params
            result["unknown"] = [(u.op, u.count) for u in est.unknown]
            result["nodes"] = len(est.nodes)
            if totals:  # not timed, after the peak was read: the torch preset's total, for the oracle check
                del est
                result["flops_torch"] = fxflops.estimate(model, kwargs={"input_ids": ids},
                                                         conventions="torch").total_flops
        else:

            class Logits(torch.nn.Module):
                # export refuses the DynamicCache inside CausalLMOutputWithPast: return the logits only
                def __init__(self, model):
                    super().__init__()
                    self.model = model

                def forward(self, input_ids):
                    return self.model(input_ids=input_ids).logits

            t, c = time.perf_counter(), time.process_time()
            program = torch.export.export(Logits(model), (), {"input_ids": ids}, strict=False)
            result["time_s"], result["cpu_s"] = time.perf_counter() - t, time.process_time() - c
            result["peak_kib"] = status_kib("VmHWM")
            result["nodes"] = len(program.graph_module.graph.nodes)

    elif kind == "flopcounter":
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.utils.flop_counter import FlopCounterMode

        with FakeTensorMode():
            model = LlamaForCausalLM(config)
            model.eval()
            ids = torch.zeros(1, seq, dtype=torch.long)
            result["setup_s"] = time.perf_counter() - t0
            result["rss_before_kib"] = status_kib("VmRSS")
            counter = FlopCounterMode(display=False)
            t, c = time.perf_counter(), time.process_time()
            with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
                model(input_ids=ids)
            result["time_s"], result["cpu_s"] = time.perf_counter() - t, time.process_time() - c
            result["peak_kib"] = status_kib("VmHWM")
            result["flops_torch"] = counter.get_total_flops()
            result["by_op"] = {str(k): v for k, v in counter.get_flop_counts().get("Global", {}).items()}
            if totals:  # not timed: the default SDPA backend on fake CPU tensors, to show what it misses
                plain = FlopCounterMode(display=False)
                with torch.no_grad(), plain:
                    model(input_ids=ids)
                result["flops_torch_default_sdpa"] = plain.get_total_flops()
    else:
        raise ValueError(kind)

    result["ru_maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return result


def run_worker(kind: str, model_key: str, seq: int, timeout: float, totals: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, model_key, str(seq)]
    cmd += ["--totals"] if totals else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"kind": kind, "model": model_key, "seq": seq, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"kind": kind, "model": model_key, "seq": seq, "error": f"rc={proc.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


# --- the report -------------------------------------------------------------------------------------


def _mib(kib: float | None) -> str:
    return "—" if kib is None else f"{kib / 1024:,.0f}"


def _num(value: int | None) -> str:
    return "—" if value is None else f"{value:,}"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def summarize(runs: list[dict]) -> dict:
    """Median times, the highest peak RSS, and the totals of whichever run computed them."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"] if runs else "not run"}
    summary = {k: v for r in ok for k, v in r.items()}  # totals etc. from any run
    summary["runs"] = len(ok)
    summary["failed_runs"] = [r["error"] for r in runs if "error" in r]
    for key in ("time_s", "cpu_s", "setup_s"):
        summary[key] = _median([r[key] for r in ok])
    summary["time_range"] = (min(r["time_s"] for r in ok), max(r["time_s"] for r in ok))
    summary["cpu_min"] = min(r["cpu_s"] for r in ok)
    summary["peak_kib"] = max(r["peak_kib"] for r in ok)
    summary["rss_before_kib"] = max(r["rss_before_kib"] for r in ok)
    return summary


def render(runs: dict, models: list[str], seqs: list[int], env: str) -> str:
    cells = {key: summarize(value) for key, value in runs.items()}
    out = ["# fxflops.estimate() on Llama-2 shapes: speed and memory", "", env, ""]
    out += [
        "Time of the measured call alone, median over the runs (wall range in brackets), model",
        "construction excluded (shown as setup). CPU = process CPU time of the call, median [min]; it is",
        "less sensitive to other load on the machine than wall time. × FCM = ratio of the medians against",
        "FlopCounterMode on fake tensors (the target's reference).",
        "Peak RSS = the subprocess' VmHWM, the highest over the runs (imports and the meta/fake model",
        "included); \"before\" = VmRSS just before the call. Every run is its own fresh Python process.",
        "",
        "| model | seq | measured | runs | wall (s) | CPU (s) | wall × FCM | CPU × FCM | setup (s) | RSS before (MiB) | peak RSS (MiB) | graph nodes |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for m in models:
        for seq in seqs:
            export = cells.get((m, seq, BASELINE), {})
            for kind in KINDS:
                r = cells.get((m, seq, kind))
                if r is None:
                    continue
                if "time_s" not in r:
                    out.append(f"| {LABELS[m]} | {seq} | {kind} | 0 | failed: {r['error']} | | | | | | | |")
                    continue
                wall = r["time_s"] / export["time_s"] if "time_s" in export else None
                cpu = r["cpu_s"] / export["cpu_s"] if "cpu_s" in export else None
                lo, hi = r["time_range"]
                spread = f" [{lo:.1f}–{hi:.1f}]" if r["runs"] > 1 else ""
                cpu_spread = f" [{r['cpu_min']:.2f}]" if r["runs"] > 1 else ""
                fails = f" ({len(r['failed_runs'])} failed)" if r["failed_runs"] else ""
                out.append(
                    f"| {LABELS[m]} | {seq} | {kind} | {r['runs']}{fails} | {r['time_s']:.2f}{spread} | {r['cpu_s']:.2f}{cpu_spread} | "
                    f"{'—' if wall is None else f'{wall:.2f}'} | {'—' if cpu is None else f'{cpu:.2f}'} | "
                    f"{r['setup_s']:.2f} | {_mib(r['rss_before_kib'])} | {_mib(r['peak_kib'])} | {r.get('nodes', '—')} |"
                )
                if kind == "estimate" and wall is not None:
                    best = r["cpu_min"] / export["cpu_min"]
                    met = [name for name, x in (("wall", wall), ("CPU", cpu), ("best CPU", best)) if x <= TARGET_RATIO]
                    verdict = "met" if len(met) == 3 else "NOT met" if not met else f"met on {', '.join(met)} only"
                    verdicts.append(f"- {LABELS[m]} seq {seq}: estimate / FlopCounterMode = {wall:.2f} (median wall), "
                                    f"{cpu:.2f} (median CPU), {best:.2f} (best CPU vs best CPU); "
                                    f"target ≤ {TARGET_RATIO}: {verdict}")
                if kind == "estimate" and m == "70b":
                    ok = r["peak_kib"] * 1024 <= TARGET_RSS_BYTES
                    verdicts.append(f"- {LABELS[m]} seq {seq}: estimate peak RSS = {r['peak_kib'] * 1024 / 1e9:.2f} GB "
                                    f"({r['peak_kib'] / 1024:,.0f} MiB; target ≤ {TARGET_RSS_BYTES / 1e9} GB): "
                                    f"{'met' if ok else 'NOT met'}")
    out += ["", "Targets:", "", *verdicts, ""]

    out += [
        "## FLOP totals",
        "",
        "MACs and FLOPs of one forward. deepspeed = fxflops' default conventions; torch = fxflops with",
        "`conventions=\"torch\"`; FlopCounterMode ran on fake tensors under `sdpa_kernel(SDPBackend.MATH)`",
        "(with the default SDPA backend on fake CPU tensors it sees no attention op and counts only the",
        "matmuls: last column); hand = `hand_count()` in this script (the formula is in its docstring).",
        "",
        "| model | seq | MACs (fxflops) | MACs (hand) | FLOPs deepspeed (fxflops) | FLOPs deepspeed (hand) | FLOPs torch (fxflops) | FlopCounterMode (MATH) | torch = FlopCounterMode | FlopCounterMode (default SDPA) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for m in models:
        for seq in seqs:
            est = cells.get((m, seq, "estimate"), {})
            fcm = cells.get((m, seq, "flopcounter"), {})
            hand_macs, hand_flops = hand_count(SHAPES[m], seq)
            equal = "—"
            if "flops_torch" in est and "flops_torch" in fcm:
                equal = "yes" if est["flops_torch"] == fcm["flops_torch"] else \
                    f"NO (Δ {est['flops_torch'] - fcm['flops_torch']:,})"
            macs_mark = "" if est.get("macs") in (None, hand_macs) else " (≠ hand)"
            flops_mark = "" if est.get("flops") in (None, hand_flops) else " (≠ hand)"
            out.append(
                f"| {LABELS[m]} | {seq} | {_num(est.get('macs'))}{macs_mark} | {_num(hand_macs)} | "
                f"{_num(est.get('flops'))}{flops_mark} | {_num(hand_flops)} | {_num(est.get('flops_torch'))} | "
                f"{_num(fcm.get('flops_torch'))} | {equal} | {_num(fcm.get('flops_torch_default_sdpa'))} |"
            )
    unknown = {f"{LABELS[m]} seq {s}": r["unknown"] for (m, s, k), r in cells.items() if k == "estimate" and r.get("unknown")}
    if unknown:
        out += ["", f"Unknown ops reported by estimate(): {unknown}"]
    return "\n".join(out) + "\n"


# --- where estimate() spends its time ---------------------------------------------------------------

# (module, attribute) pairs wrapped with a timer in --profile mode; each is looked up at call time by
# its caller, so wrapping the attribute times every call. Only in this diagnostic process.
_STAGES = [
    ("fxflops.api", "load_table"),
    ("fxflops.api", "capture"),
    ("fxflops.capture.eager", "swap_tensors"),
    ("fxflops.capture.eager", "module_infos"),
    ("fxflops.api", "count_nodes"),
    ("fxflops.api", "build_estimate"),
    ("fxflops.api", "_warn_unknown"),
]


def profile(model_key: str, seq: int, top: int) -> None:
    """Time estimate()'s stages (cold, first call in this process), then cProfile a second call."""
    import cProfile
    import importlib
    import pstats
    import warnings

    import torch
    from transformers import LlamaForCausalLM

    import fxflops

    warnings.filterwarnings("ignore")
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(SHAPES[model_key]))
    model.eval()
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")

    spent: dict[str, list[float]] = {}
    originals = []
    for module_name, attr in _STAGES:
        module = importlib.import_module(module_name)
        original = getattr(module, attr, None)
        if original is None:
            continue
        originals.append((module, attr, original))

        def timed(*a, __f=original, __key=f"{module_name}.{attr}", **k):
            t, c = time.perf_counter(), time.process_time()
            try:
                return __f(*a, **k)
            finally:
                entry = spent.setdefault(__key, [0.0, 0.0, 0])
                entry[0] += time.perf_counter() - t
                entry[1] += time.process_time() - c
                entry[2] += 1

        setattr(module, attr, timed)
    try:
        t, c = time.perf_counter(), time.process_time()
        fxflops.estimate(model, kwargs={"input_ids": ids})
        total = (time.perf_counter() - t, time.process_time() - c)
    finally:
        for module, attr, original in originals:
            setattr(module, attr, original)
    print(f"## estimate() stages, {LABELS[model_key]} seq {seq} (first call in the process)\n")
    print("| stage | calls | wall (s) | CPU (s) | % of CPU |\n|---|---:|---:|---:|---:|")
    print(f"| estimate() total | 1 | {total[0]:.2f} | {total[1]:.2f} | 100 |")
    for key, (wall, cpu, calls) in spent.items():
        print(f"| {key} | {calls} | {wall:.2f} | {cpu:.2f} | {100 * cpu / total[1]:.0f} |")
    print("\n(capture includes the fake-twin swap, the model's forward on fake tensors and module_infos.)\n")

    profiler = cProfile.Profile()
    t = time.perf_counter()
    profiler.runcall(fxflops.estimate, model, kwargs={"input_ids": ids})
    print(f"## cProfile of a second estimate() call: {time.perf_counter() - t:.2f} s under the profiler\n")
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(top)
    print("### fxflops' own functions, by internal time")
    stats.sort_stats("tottime").print_stats("fxflops/", top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--seqs", nargs="+", type=int, default=[2048, 4096])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of estimate and export per cell (FlopCounterMode runs once); medians are shown")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per measurement subprocess")
    parser.add_argument("--output", default=RESULTS, help="markdown file to write ('' for none)")
    parser.add_argument("--worker", nargs=3, metavar=("KIND", "MODEL", "SEQ"), help=argparse.SUPPRESS)
    parser.add_argument("--totals", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", nargs=2, metavar=("MODEL", "SEQ"), help="time estimate()'s stages and cProfile it")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()

    if args.worker:
        kind, model_key, seq = args.worker
        with contextlib.redirect_stdout(sys.stderr):  # only the JSON line goes to stdout
            result = worker(kind, model_key, int(seq), args.totals)
        print(json.dumps(result))
        return
    if args.profile:
        profile(args.profile[0], int(args.profile[1]), args.top)
        return

    runs: dict[tuple, list[dict]] = {}
    start = time.perf_counter()
    # rounds interleave the cells, so slow drift in the machine's load spreads over all of them
    for round_ in range(max(1, args.repeat)):
        for m in args.models:
            for seq in args.seqs:
                for kind in args.kinds:
                    if kind == "flopcounter" and round_ > 0:
                        continue
                    r = run_worker(kind, m, seq, args.timeout, totals=round_ == 0)
                    runs.setdefault((m, seq, kind), []).append(r)
                    shown = r.get("error") or f"{r['time_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU, " \
                                              f"peak {_mib(r['peak_kib'])} MiB"
                    print(f"[{time.perf_counter() - start:6.0f} s] round {round_ + 1}: {LABELS[m]} seq {seq} "
                          f"{kind}: {shown}", file=sys.stderr, flush=True)
    table = render(runs, args.models, args.seqs, environment())
    table += f"\nWhole benchmark: {time.perf_counter() - start:.0f} s wall.\n"
    print(table)
    if args.output:
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
        with open(args.output, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
