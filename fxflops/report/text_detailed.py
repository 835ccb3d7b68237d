"""The text report's detailed profile: the module tree as torch prints it, each module's numbers before
its own extra_repr.

Each entry: params, MACs and their shares; latency, FLOPS and the roofline prediction when there; calls.
Identical numbered repeats fold into one entry (fxflops.report.fold).
"""

from __future__ import annotations

from fxflops.report import fold as folding
from fxflops.report.formats import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    params_to_string,
    percent,
    printable,
    shared_to_string,
)
from fxflops.report.text_layout import _is_measured, _per, _rule_line
from fxflops.results import Estimate


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
    if any(stats.shared for stats in estimate.modules.values()):
        notes.append(
            f"{len(notes) + 1}. A parameter several modules hold (tied weights) counts once, at its first "
            "owner: `tied: weight = a.b.weight` says which it leaves out and where it counts."
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
    if stats.shared:
        fields.append(f"tied: {shared_to_string(stats.shared)}")
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
    # a name holds no newline of its own (one printed would forge a line of the report): escaped here
    label = f"({printable(group.label, keep='')}): " if group.depth else ""
    return f"{label}{count}{printable(type_name, keep='')}("


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
