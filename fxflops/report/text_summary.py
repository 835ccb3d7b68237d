"""The text report's summary: what was estimated how, the totals, the roofline prediction, the node
shares and the unknown ops.

What was estimated how: model, inputs, capture method, dtype, mode, conventions. The totals: params,
MACs, flops, the counted backward, attention read two ways, bytes, the optimizer step. A profile's
measured lines come from `text_measured`.
"""

from __future__ import annotations

from typing import Any

from fxflops.capture.methods import describe, runs_model
from fxflops.report.formats import (
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    percent,
)
from fxflops.report.memory_text import memory_lines
from fxflops.report.text_layout import _device_word, _per, _row, _rule_line
from fxflops.report.text_measured import _latency_lines, _parallel_lines, generation_lines
from fxflops.results import COUNTED, RECOMPUTE, ROOT_LABEL, UNKNOWN, ZERO, Estimate

TITLE = " fxflops Flops Profiler "
MAX_MODULES_PER_UNKNOWN = 3


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
    lines += memory_lines(estimate)
    lines += prediction_lines(estimate)
    if m is not None:
        lines += _latency_lines(estimate, m)
    lines += _node_share_lines(estimate)
    lines += unknown_lines(estimate)
    lines += [_row("caution:", caution) for caution in estimate.cautions]
    if m is not None and "generate" in m.extra:
        lines += generation_lines(m.extra["generate"])
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
