"""The DeepSpeed-style text report: summary, aggregated profile per depth, detailed module tree.

The layout follows DeepSpeed's Flops Profiler so its users read it without relearning. Beyond
it: the summary says what share of graph nodes a rule counted, declared zero or did not know,
lists the unknown ops, shows cost per rule, and identical numbered repeats fold into one entry.
Latency lines and columns appear exactly when the estimate carries measurements.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from fxflops.capture.methods import describe, runs_model
from fxflops.report import fold as folding
from fxflops.report.formats import (
    ENCODING_ERRORS,
    bytes_to_string,
    duration_to_string,
    encodable,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    percent,
)
from fxflops.report.tables import op_table
from fxflops.results import COUNTED, RECOMPUTE, ROOT_LABEL, UNKNOWN, ZERO, Estimate, Measurements

TITLE = " fxflops Flops Profiler "
LABEL_WIDTH = 60
MAX_MODULES_PER_UNKNOWN = 3


def text(
    estimate: Estimate,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
    output_file: str | Path | None = None,
    as_string: bool = False,
    fold: bool = True,
    by_rule: bool = True,
) -> str | None:
    """Print the report (DeepSpeed's `print_model_profile` options), write it, or return it.

    module_depth: deepest level shown in both profiles (-1 = all); top_modules: entries per
    depth in the aggregated profile; detailed: include the module tree; output_file: write
    there instead of stdout; as_string: return the text; fold: fold identical numbered repeats;
    by_rule: include the cost-per-rule table under the summary.
    """
    report = render(
        estimate,
        module_depth=module_depth,
        top_modules=top_modules,
        detailed=detailed,
        fold=fold,
        by_rule=by_rule,
    )
    if output_file is not None:
        Path(output_file).write_text(report, encoding="utf-8", errors=ENCODING_ERRORS)
    elif not as_string:
        sys.stdout.write(encodable(report, getattr(sys.stdout, "encoding", None)))
    return report if as_string else None


def render(
    estimate: Estimate,
    *,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
    fold: bool = True,
    by_rule: bool = True,
) -> str:
    """The whole report as one string."""
    lines = summary_lines(estimate)
    if by_rule and (estimate.by_rule or estimate.unknown):
        lines += ["", "Cost per rule:", op_table(estimate, "rule", tablefmt="simple")]
    if top_modules > 0:  # top 0 asks for no aggregated profile, not for empty {} per depth
        lines += [""] + aggregated_lines(estimate, module_depth, top_modules)
    if detailed:
        lines += [""] + detailed_lines(estimate, module_depth, fold)
    lines.append(_rule_line(""))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- helpers


def _rule_line(title: str, width: int = 78) -> str:
    """`----- title -----` centred in `width` dashes, as DeepSpeed separates its sections."""
    if not title:
        return "-" * width
    return title.center(width, "-")


def _row(label: str, value: Any) -> str:
    return f"{label:<{LABEL_WIDTH}}  {value}"


def _device_word(measurements: Measurements | None) -> str:
    """DeepSpeed says "per GPU"; on any other device we say "per device"."""
    if measurements is None:
        return ""
    return "GPU" if measurements.device.startswith("cuda") else "device"


def _per(measurements: Measurements | None) -> str:
    word = _device_word(measurements)
    return f" per {word}" if word else ""


def _shape_text(shapes: Any) -> str:
    """Input shapes as written in Python: `(1024, 1, 32, 32)`, dicts as `name=(...)`."""
    if isinstance(shapes, dict):
        return ", ".join(f"{key}={_shape_text(value)}" for key, value in shapes.items())
    if isinstance(shapes, (list, tuple)) and all(isinstance(dim, int) for dim in shapes):
        return "(" + ", ".join(str(dim) for dim in shapes) + ("," if len(shapes) == 1 else "") + ")"
    if isinstance(shapes, (list, tuple)):
        return ", ".join(_shape_text(item) for item in shapes)
    return str(shapes)


def inputs_text(shapes: Any) -> str:
    """The captured inputs' shapes; the `(args, kwargs)` pair reads as a call's arguments."""
    if (
        isinstance(shapes, (list, tuple))
        and len(shapes) == 2
        and isinstance(shapes[0], (list, tuple))
        and isinstance(shapes[1], dict)
    ):
        parts = [_shape_text(arg) for arg in shapes[0]]
        parts += [f"{key}={_shape_text(value)}" for key, value in shapes[1].items()]
        return ", ".join(parts) or "(none)"
    return _shape_text(shapes)


def _is_measured(estimate: Estimate) -> bool:
    return estimate.measurements is not None or any(
        stats.latency is not None for stats in estimate.modules.values()
    )


# ---------------------------------------------------------------------------------- summary


def _notation_lines(estimate: Estimate) -> list[str]:
    lines = ["Notations:"]
    m = estimate.measurements
    if m is not None and (m.dp_size is not None or m.mp_size is not None):
        lines.append("data parallel size (dp_size), model parallel size(mp_size),")
    lines.append("number of parameters (params), number of multiply-accumulate operations(MACs),")
    if m is None:
        lines.append("number of floating-point operations (flops)")
    else:
        lines += [
            "number of floating-point operations (flops), floating-point operations per second (FLOPS),",
            "fwd latency (forward propagation latency), bwd latency (backward propagation latency),",
            "step (weights update latency), iter latency (sum of fwd, bwd and step latency)",
        ]
    return lines


def _counted(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def summary_lines(estimate: Estimate) -> list[str]:
    """Header, notations, what was estimated how, totals, measurements, unknown ops."""
    m = estimate.measurements
    step = m.extra.get("profile_step") if m is not None else None
    title = (f"Profile Summary at step {step} (measured):" if step is not None else "Profile Summary (measured):") \
        if m is not None else (
        f"Estimate Summary (the model ran once, on {estimate.input_values or 'its real inputs'}):"
        if runs_model(estimate.method)
        else "Estimate Summary (static, nothing run):")
    lines = [_rule_line(TITLE), title] + _notation_lines(estimate) + [""]
    lines += _model_lines(estimate)
    lines += _parallel_lines(m)
    lines += _count_lines(estimate)
    lines += prediction_lines(estimate)
    if m is not None:
        lines += _latency_lines(estimate, m)
    lines += _node_share_lines(estimate)
    lines += unknown_lines(estimate)
    lines += [_row("caution:", caution) for caution in estimate.cautions]
    if m is not None and "generate" in m.extra:
        lines += generation_lines(m.extra["generate"])
    return lines


def generation_lines(info: dict[str, Any]) -> list[str]:
    """Prefill vs decode of a profiled generation (fxflops.timing.generate): summed and per step."""
    lines = ["", _rule_line(" Generation "), _row("forward calls per generation:", info["calls"])]
    for phase in ("prefill", "decode"):
        p = info[phase]
        if not p["calls"]:
            continue
        lines += [
            _row(f"{phase} calls:", p["calls"]),
            _row(f"{phase} MACs (summed / per step):",
                 f"{macs_to_string(p['macs'])} / {macs_to_string(p['macs_per_step'])}"),
            _row(f"{phase} flops (summed / per step):",
                 f"{number_to_string(p['flops'])} / {number_to_string(p['flops_per_step'])}"),
            _row(f"{phase} latency (summed / per step):",
                 f"{duration_to_string(p['latency'])} / {duration_to_string(p['latency_per_step'])}"),
        ]
    return lines


def _model_lines(estimate: Estimate) -> list[str]:
    lines = [_row("model:", estimate.model_type)]
    if estimate.input_shapes:
        lines.append(_row("input shapes:", inputs_text(estimate.input_shapes)))
    method = estimate.method
    if estimate.attempts:
        failed = "; ".join(f"{name} failed: {_first_line(why)}" for name, why in estimate.attempts)
        method = f"{method} (after {failed})"
    lines.append(_row("capture method:", method))
    lines.append(_row("counted path:", describe(estimate.method)))
    if estimate.dtype is not None:
        lines.append(_row("dtype:", estimate.dtype))
    if estimate.training is not None:
        lines.append(_row("mode:", "train (dropout and batch statistics counted)" if estimate.training else "eval"))
    lines.append(_row("conventions:", estimate.conventions))
    return lines


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "(no message)"


def _parallel_lines(m: Measurements | None) -> list[str]:
    if m is None:
        return []
    lines = []
    for label, value in (
        ("world size:", m.world_size),
        ("data parallel size:", m.dp_size),
        ("model parallel size:", m.mp_size),
    ):
        if value is not None:
            lines.append(_row(label, value))
    if m.batch_size is not None:
        lines.append(_row(f"batch size per {_device_word(m)}:", m.batch_size))
    return lines


def _count_lines(estimate: Estimate) -> list[str]:
    m = estimate.measurements
    per = _per(m)
    word = _device_word(m)
    mp_size = m.mp_size if m is not None else None
    lines = [_row(f"params{per}:", params_to_string(estimate.total_params))]
    if mp_size is not None:
        lines.append(
            _row(
                f"params of model = params per {word} * mp_size:",
                params_to_string(estimate.total_params * mp_size),
            )
        )
    lines.append(_row(f"fwd MACs{per}:", macs_to_string(estimate.fwd_macs)))
    lines.append(_row(f"fwd flops{per}:", number_to_string(estimate.fwd_flops)))
    if mp_size is not None:
        lines.append(
            _row(
                f"fwd flops of model = fwd flops per {word} * mp_size:",
                number_to_string(estimate.fwd_flops * mp_size),
            )
        )
    if estimate.backward:
        lines += _backward_lines(estimate, per)
    attention = attention_text(estimate)
    if attention is not None:
        lines.append(_row(f"attention flops{per}{' (fwd+bwd)' if estimate.backward else ''}:", attention))
    lines.append(_row(f"bytes read + written{per}:", f"{bytes_to_string(estimate.total_bytes)} "
                      f"({_intensity_text(estimate.intensity)})"))
    if estimate.optimizer is not None:
        step = estimate.optimizer
        lines.append(_row(f"optimizer step flops{per} ({step.name}, {step.flops_per_param} per parameter):",
                          f"{number_to_string(step.flops)} ({params_to_string(step.params)} trainable)"))
    return lines


def attention_text(estimate: Estimate) -> str | None:
    """"3.2 T dense, 1.7 T effective (causal); totals count dense", when the two readings differ."""
    totals = estimate.attention_totals()
    if totals is None or not totals.differ:
        return None
    patterns = ", ".join(totals.patterns)
    text = (f"{number_to_string(totals.dense_flops)} dense, {number_to_string(totals.effective_flops)} "
            f"effective ({patterns}); totals count {estimate.attention}")
    if totals.unknown:
        text += (f"; {totals.unknown} of {totals.nodes} attention ops keep pairs not known without data, "
                 "counted dense in both")
    return text


def _intensity_text(intensity: float | None) -> str:
    return "nothing moved" if intensity is None else f"{intensity:.2f} flops per byte"


def prediction_lines(estimate: Estimate, top: int = 3) -> list[str]:
    """The roofline summary: predicted latency, how much of it is memory-bound, and where."""
    p = estimate.prediction
    if p is None:
        return []
    m = estimate.measurements
    lines = [
        _row(f"predicted latency ({p.device}, {p.dtype} roofline):", duration_to_string(p.latency)),
        _row("  peak / bandwidth / ridge:", f"{flops_to_string(p.peak_flops)} (ops with MACs), "
             f"{flops_to_string(p.vector_flops)} (others) / {bytes_to_string(p.bandwidth)}/s / "
             f"{p.ridge:.1f} flops per byte"),
        _row("  time in memory-bound ops:", f"{100 * p.memory_bound_share:.2f}%"),
    ]
    worst = p.top_memory_bound(top)
    if worst:
        lines.append(_row("  top memory-bound modules:", ", ".join(
            f"{w.name} ({duration_to_string(w.memory_bound_latency)})" for w in worst)))
    if m is not None and m.fwd_latency and p.latency:
        lines.append(_row("  measured / predicted fwd latency:", f"{m.fwd_latency / p.latency:.2f}x"))
    return lines


def _backward_lines(estimate: Estimate, per: str) -> list[str]:
    """The counted backward: its MACs and FLOPs, their ratio to the forward's, fwd + bwd."""
    recomputed = sum(node.flops for node in estimate.nodes if node.phase == RECOMPUTE)
    note = f" (recomputed forward: {number_to_string(recomputed)})" if recomputed else ""
    ratio = estimate.bwd_fwd_ratio
    return [
        _row(f"bwd MACs{per}:", macs_to_string(estimate.bwd_macs)),
        _row(f"bwd flops{per}:", number_to_string(estimate.bwd_flops) + note),
        _row("bwd / fwd flops:", "n/a (no forward flops)" if ratio is None else f"{ratio:.3f}"),
        _row(f"fwd+bwd MACs{per}:", macs_to_string(estimate.total_macs)),
        _row(f"fwd+bwd flops{per}:", number_to_string(estimate.total_flops)),
    ]


def _latency_lines(estimate: Estimate, m: Measurements) -> list[str]:
    """DeepSpeed's latency/FLOPS/throughput lines, each only when its inputs were measured."""
    word = _device_word(m)
    flops = estimate.fwd_flops
    lines = [_row("device:", f"{m.device} ({m.device_name})" if m.device_name else m.device)]
    lines.append(_row("timer:", f"{m.timer}, {_counted(m.warm_up, 'warm-up')} + {_counted(m.steps, 'timed step')}"))
    lines.append(_row("fwd latency:", duration_to_string(m.fwd_latency)))
    lines.append(
        _row(
            "fwd latency min / median / max:",
            " / ".join(
                duration_to_string(value)
                for value in (m.fwd_latency_min, m.fwd_latency_median, m.fwd_latency_max)
            ),
        )
    )
    if m.fwd_latency:
        lines.append(
            _row(
                f"fwd FLOPS per {word} = fwd flops per {word} / fwd latency:",
                flops_to_string(flops / m.fwd_latency),
            )
        )
    lines += _utilization_lines("fwd", flops / m.fwd_latency if m.fwd_latency else None, m)
    if m.hook_overhead is not None:
        lines.append(
            _row(
                "fwd latency with per-module hooks:",
                f"{duration_to_string(m.hooked_fwd_latency)} ({m.hook_overhead:.2f}x)",
            )
        )
    lines += _bwd_latency_lines(estimate, m)
    lines += _throughput_lines(m)
    return lines


def _bwd_latency_lines(estimate: Estimate, m: Measurements) -> list[str]:
    """bwd latency and FLOPS: from the counted backward, or DeepSpeed's factor x forward FLOPs."""
    word = _device_word(m)
    flops = estimate.fwd_flops
    extra = m.extra.get("recompute_fwd_factor", 0)  # a recomputation the user declares (FlopsProfiler)
    if estimate.backward:
        bwd_flops = estimate.bwd_flops + extra * flops
        added = f" + {extra:g} * fwd flops per {word}" if extra else ""
        bwd_label = f"(bwd flops per {word}{added})" if extra else f"bwd flops per {word}"
        both_label = f"(fwd+bwd flops per {word}{added})"
    else:  # DeepSpeed's rule: 2 x forward FLOPs, plus the declared recomputation
        factor = 2 + extra
        bwd_flops, bwd_label = factor * flops, f"{factor:g} * fwd flops per {word}"
        both_label = f"{1 + factor:g} * fwd flops per {word}"
    lines = []
    if m.bwd_latency is not None:
        lines.append(_row("bwd latency:", duration_to_string(m.bwd_latency)))
        if m.bwd_latency:
            lines.append(_row(f"bwd FLOPS per {word} = {bwd_label} / bwd latency:",
                              flops_to_string(bwd_flops / m.bwd_latency)))
        fwd_bwd = m.fwd_latency + m.bwd_latency
        if fwd_bwd:
            rate = (flops + bwd_flops) / fwd_bwd
            lines.append(_row(f"fwd+bwd FLOPS per {word} = {both_label} / (fwd+bwd latency):", flops_to_string(rate)))
            lines += _utilization_lines("fwd+bwd", rate, m)
    if m.step_latency is not None:
        lines.append(_row("step latency:", duration_to_string(m.step_latency)))
    if m.iter_latency is not None:
        lines.append(_row("iter latency:", duration_to_string(m.iter_latency)))
        if m.iter_latency:
            lines.append(_row(f"FLOPS per {word} = {both_label} / iter latency:",
                              flops_to_string((flops + bwd_flops) / m.iter_latency)))
    return lines


def _utilization_lines(what: str, rate: float | None, m: Measurements) -> list[str]:
    if rate is None or not m.peak_flops:
        return []
    lines = []
    if what == "fwd":
        source = f" ({m.peak_flops_source})" if m.peak_flops_source else ""
        lines.append(_row("peak FLOPS:", flops_to_string(m.peak_flops) + source))
    lines.append(_row(f"{what} FLOPS utilization = {what} FLOPS / peak FLOPS:", utilization_text(rate, m.peak_flops)))
    return lines


def utilization_text(rate: float, peak: float) -> str:
    """`41.27%`; tiny shares keep two significant digits (`0.0035%`) instead of reading 0.00%."""
    share = 100.0 * rate / peak
    return f"{share:.2f}%" if share >= 0.01 or share == 0 else f"{share:.2g}%"


def _throughput_lines(m: Measurements) -> list[str]:
    """samples/second as DeepSpeed: batch per device * dp_size / iter latency."""
    if m.batch_size is None:
        return []
    samples = m.batch_size * (m.dp_size or 1)
    if m.iter_latency:
        return [_row("samples/second:", f"{samples / m.iter_latency:.2f}")]
    if m.fwd_latency:
        return [_row("fwd samples/second:", f"{samples / m.fwd_latency:.2f}")]
    return []


def _node_share_lines(estimate: Estimate) -> list[str]:
    """What share of the graph's nodes a rule counted, the zero list declared, or nobody knew."""
    counts = estimate.node_status_counts()
    total = sum(counts.values())
    if not total:
        return []
    parts = ", ".join(
        f"{label} {counts[status]} = {percent(counts[status], total)}"
        for label, status in (("counted", COUNTED), ("zero", ZERO), ("unknown", UNKNOWN))
    )
    return [_row("graph nodes:", f"{total} ({parts})")]


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def unknown_lines(estimate: Estimate) -> list[str]:
    """The ops no rule knows, with counts and where they sit — never silently 0."""
    if not estimate.unknown:
        return [_row("unknown ops:", "none")]
    nodes = sum(op.count for op in estimate.unknown)
    lines = [
        _row(
            "unknown ops:",
            f"{_plural(len(estimate.unknown), 'kind')}, {_plural(nodes, 'node')}, "
            "counted as 0 (add a rule to count them)",
        )
    ]
    width = max(len(op.op) for op in estimate.unknown)
    for op in sorted(estimate.unknown, key=lambda item: (-item.count, item.op)):
        shown = [name or ROOT_LABEL for name in op.modules[:MAX_MODULES_PER_UNKNOWN]]
        more = len(op.modules) - len(shown)
        where = ", ".join(shown) + (f" and {more} more" if more > 0 else "")
        lines.append(f"    {op.op:<{width}}  x{op.count:<5} in {where}")
    return lines


# ------------------------------------------------------------------------- aggregated profile


def aggregate_by_type(estimate: Estimate) -> dict[int, dict[str, dict[str, float]]]:
    """depth -> module type -> summed params, macs and latency of the modules of that type."""
    table: dict[int, dict[str, dict[str, float]]] = {}
    for stats in estimate.modules.values():
        entry = table.setdefault(stats.depth, {}).setdefault(
            stats.type, {"params": 0, "macs": 0, "bwd_macs": 0, "latency": 0.0, "timed": 0}
        )
        entry["params"] += stats.params
        entry["macs"] += stats.fwd_macs
        entry["bwd_macs"] += stats.bwd_macs
        if stats.latency is not None:
            entry["latency"] += stats.latency
            entry["timed"] += 1
    return table


def _top(entries: dict[str, dict[str, float]], key: str, k: int, fmt) -> str:
    ranked = sorted(entries.items(), key=lambda item: item[1][key], reverse=True)[:k]
    return repr({name: fmt(values[key]) for name, values in ranked})


def aggregated_lines(estimate: Estimate, module_depth: int = -1, top_modules: int = 1) -> list[str]:
    """Top-k module types by params, MACs (and fwd latency when timed) at every depth."""
    per = _per(estimate.measurements)
    by_depth = aggregate_by_type(estimate)
    deepest = max(by_depth) if by_depth else 0
    if module_depth >= 0:
        deepest = min(deepest, module_depth)
    measured = _is_measured(estimate)
    what = "params, MACs or fwd latency" if measured else "params or MACs"
    if estimate.backward:
        what = "params, fwd MACs, bwd MACs or fwd latency" if measured else "params, fwd MACs or bwd MACs"
    lines = [
        _rule_line(f" Aggregated Profile{per} ", 86),
        f"Top {top_modules} modules in terms of {what} at different model depths:",
    ]
    for depth in range(deepest + 1):
        entries = by_depth.get(depth, {})
        lines.append(f"depth {depth}:")
        lines.append(f"    params      - {_top(entries, 'params', top_modules, params_to_string)}")
        label = "fwd MACs" if estimate.backward else "MACs"
        lines.append(f"    {label:<11} - {_top(entries, 'macs', top_modules, macs_to_string)}")
        if estimate.backward:
            lines.append(f"    bwd MACs    - {_top(entries, 'bwd_macs', top_modules, macs_to_string)}")
        if measured:
            timed = {name: values for name, values in entries.items() if values["timed"]}
            lines.append(
                f"    fwd latency - {_top(timed, 'latency', top_modules, duration_to_string)}"
            )
    return lines


# --------------------------------------------------------------------------- detailed profile


def _detailed_header(estimate: Estimate, folded: bool) -> list[str]:
    per = _per(estimate.measurements)
    measured = _is_measured(estimate)
    order = "params, percentage of total params, MACs, percentage of total MACs"
    if estimate.backward:
        order = ("params, percentage of total params, fwd MACs, percentage of total fwd MACs, "
                 "bwd MACs, bwd flops / fwd flops")
    if measured:
        order += ", fwd latency, percentage of total fwd latency, fwd FLOPS"
        if any(stats.bwd_latency is not None for stats in estimate.modules.values()):
            order += ", bwd latency, bwd FLOPS"
    if estimate.prediction is not None:
        order += ", predicted latency, compute- or memory-bound" + (", measured / predicted" if measured else "")
    notes = [
        "Note: 1. A module's numbers include its submodules'. Ops a module calls directly "
        "(torch.nn.functional, tensor methods) count toward it, so a parent can hold more than "
        "the sum of its submodules.",
        "2. Number of floating-point operations is a theoretical estimation from the traced "
        "graph, so FLOPS computed from it can exceed what the hardware sustains.",
    ]
    if folded:
        notes.append(
            f"{len(notes) + 1}. `(a-b): n x Type(...)` stands for n identical numbered repeats and "
            "shows the numbers of one of them" + (" (latency: their mean)" if measured else "")
            + "; fold=False (--no-fold) shows each."
        )
    if measured:
        notes.append(
            f"{len(notes) + 1}. The top module's fwd latency is measured with per-module hooks, "
            "so it can differ from the fwd latency in the summary, measured without them."
        )
    return [
        _rule_line(f" Detailed Profile{per} ", 86),
        "Each module profile is listed after its name in the following order:",
        order,
        "",
        *notes,
        "",
    ]


def module_fields(
    estimate: Estimate, group: folding.Group, latency_total: float | None, measured: bool
) -> list[str]:
    """`params, % Params, MACs, % MACs[, latency, % latency, FLOPS][, calls]` of one entry."""
    stats = folding.stats_of(estimate, group)
    fields = [
        params_to_string(stats.params),
        f"{percent(stats.params, estimate.total_params)} Params",
        macs_to_string(stats.fwd_macs),
        f"{percent(stats.fwd_macs, estimate.fwd_macs)} MACs",
    ]
    if estimate.backward:
        ratio = stats.bwd_fwd_ratio
        fields += [f"{macs_to_string(stats.bwd_macs)} bwd",
                   "no fwd flops" if ratio is None else f"{ratio:.2f}x bwd/fwd"]
    if measured:
        latency = folding.mean_latency(estimate, group)
        if latency is None:
            fields += ["not timed", "0.00% latency", "0 FLOPS"]
        else:
            rate = stats.fwd_flops / latency if latency else 0.0
            fields += [
                duration_to_string(latency),
                f"{percent(latency, latency_total)} latency",
                flops_to_string(rate),
            ]
    bwd_latency = folding.mean_latency(estimate, group, "bwd_latency")
    if bwd_latency is not None:
        fields += [f"{duration_to_string(bwd_latency)} bwd",
                   f"{flops_to_string(stats.bwd_flops / bwd_latency if bwd_latency else 0.0)} bwd"]
    fields += _predicted_fields(estimate, group, measured)
    if stats.calls == 0 and not _ran(estimate, group.name):
        fields.append("not called")
    elif stats.calls > 1:
        fields.append(f"{stats.calls} calls")
    return fields


def _predicted_fields(estimate: Estimate, group: folding.Group, measured: bool) -> list[str]:
    """`predicted latency, bound[, measured/predicted]` of one entry, when a prediction was asked for."""
    predicted = estimate.prediction.modules.get(group.name) if estimate.prediction is not None else None
    if predicted is None:
        return []
    fields = [f"{duration_to_string(predicted.latency)} predicted", f"{predicted.bound}-bound"]
    latency = folding.mean_latency(estimate, group) if measured else None
    if latency and predicted.latency:
        fields.append(f"{latency / predicted.latency:.2f}x measured/predicted")
    return fields


def _ran(estimate: Estimate, name: str) -> bool:
    """Whether the module or any submodule ran: containers such as ModuleList are never called."""
    stats = estimate.modules[name]
    return stats.calls > 0 or any(_ran(estimate, child) for child in stats.children)


def _head(group: folding.Group, type_name: str) -> str:
    count = f"{group.count} x " if group.folded else ""
    label = f"({group.label}): " if group.depth else ""
    return f"{label}{count}{type_name}("


def detailed_lines(estimate: Estimate, module_depth: int = -1, fold: bool = True) -> list[str]:
    """The module tree as torch prints it, each module's numbers before its own extra_repr."""
    lines: list[str] = []
    folded = False
    latency_total = folding.root_latency(estimate)
    measured = _is_measured(estimate)
    signatures = folding.subtree_signatures(estimate)

    def emit(group: folding.Group) -> None:
        nonlocal folded
        folded = folded or group.folded
        stats = folding.stats_of(estimate, group)
        indent = "  " * group.depth
        shown = module_depth < 0 or group.depth < module_depth
        children = folding.child_groups(estimate, group, signatures, fold) if shown else []
        parts = module_fields(estimate, group, latency_total, measured)
        extra = " ".join(stats.extra_repr.split("\n")).strip()
        if extra:
            parts.append(extra)
        if not children:
            if stats.children:
                parts.append("...")  # submodules below the depth limit
            lines.append(f"{indent}{_head(group, stats.type)}{', '.join(parts)})")
            return
        lines.append(f"{indent}{_head(group, stats.type)}")
        lines.append(f"{indent}  {', '.join(parts)},")
        for child in children:
            emit(child)
        lines.append(f"{indent})")

    if "" in estimate.modules:
        emit(folding.root_group())
    return _detailed_header(estimate, folded) + lines
