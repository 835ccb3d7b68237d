"""Test helpers: read fxflops' text report back into numbers, independently of fxflops' formatter,
and build Estimates by hand from numbers worked out on paper.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict

import networkx as nx

from fxflops.results import (
    COUNTED,
    UNKNOWN,
    Estimate,
    ModuleStats,
    NodeCost,
    OpTotals,
    Profile,
    UnknownOp,
)

PREFIXES = {"": 1.0, "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3, "u": 1e-6, "n": 1e-9}
QUANTITY = re.compile(r"^(-?\d+(?:\.\d+)?)(?: ([KkMGTmun]?)(MACs|FLOPS|s)?)?$")


def parse_quantity(text: str) -> tuple[float, float, str]:
    """'120.42 MMACs' -> (120.42, 1e6, 'MACs')."""
    match = QUANTITY.match(text.strip())
    assert match, f"not a human-formatted quantity: {text!r}"
    number, prefix, unit = match.group(1), match.group(2) or "", match.group(3) or ""
    return float(number), PREFIXES[prefix], unit


def shows(text: str, expected: float, unit: str = "") -> bool:
    """True when `text` is `expected` rounded to 2 decimals at a sensible scale (1 <= x < 1000)."""
    number, scale, found_unit = parse_quantity(text)
    if found_unit != unit:
        return False
    if expected == 0:
        return number == 0
    in_range = 1 <= abs(expected) / scale < 1000 or (scale == 1 and abs(expected) < 1000)
    return in_range and abs(round(expected / scale, 2) - number) < 1e-9


def assert_shows(text: str, expected: float, unit: str = "") -> None:
    assert shows(text, expected, unit), f"{text!r} does not show {expected} {unit}"


def parse_percent(text: str) -> float:
    match = re.match(r"^(\d+\.\d\d)%", text.strip())
    assert match, f"not a percentage: {text!r}"
    return float(match.group(1))


def assert_percent(text: str, part: float, whole: float) -> None:
    expected = round(100 * part / whole, 2) if whole else 0.0
    assert abs(parse_percent(text) - expected) < 1e-9, f"{text!r} is not {expected}%"


# --------------------------------------------------------------------------------- report text


def section(report: str, title: str) -> list[str]:
    """Lines of the section whose dashed header contains `title`, up to the next dashed line."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("---") and title in line)
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].startswith("-----")), len(lines)
    )
    return lines[start + 1 : end]


def parse_summary(report: str) -> dict[str, str]:
    """'label:' -> value for the summary rows (label padded, two or more spaces, value)."""
    rows = {}
    for line in section(report, "Flops Profiler"):
        match = re.match(r"^(\S.*?:)\s{2,}(\S.*)$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def parse_aggregated(report: str) -> dict[int, dict[str, dict[str, str]]]:
    result: dict[int, dict[str, dict[str, str]]] = {}
    depth = None
    for line in section(report, "Aggregated Profile"):
        head = re.match(r"^depth (\d+):$", line)
        if head:
            depth = int(head.group(1))
            result[depth] = {}
            continue
        entry = re.match(r"^    (params|MACs|fwd latency)\s+- (\{.*\})$", line)
        if entry:
            result[depth][entry.group(1)] = ast.literal_eval(entry.group(2))
    return result


ENTRY = re.compile(r"^(?P<indent>\s*)(?:\((?P<label>[^)]*)\): )?(?:(?P<count>\d+) x )?(?P<type>\w+)\((?P<rest>.*)$")


def parse_detailed(report: str) -> dict[str, dict]:
    """Path of labels ('' root, 'feature_extractor.0', 'h.0-2') -> type, count, fields.

    `fields` are the comma-separated items after the name: params, % Params, MACs, % MACs,
    [latency, % latency, FLOPS], then the module's own extra_repr.
    """
    lines = [line for line in section(report, "Detailed Profile") if line.strip()]
    start = next(i for i, line in enumerate(lines) if ENTRY.match(line) and not line.startswith(" "))
    entries: dict[str, dict] = {}
    stack: list[str] = []
    index = start
    while index < len(lines):
        line = lines[index]
        index += 1
        if line.strip() == ")":
            stack.pop()
            continue
        match = ENTRY.match(line)
        assert match, f"unexpected line in the detailed profile: {line!r}"
        depth = len(match.group("indent")) // 2
        del stack[depth:]
        label = match.group("label") or ""
        path = ".".join([*stack[1:], label]) if depth else ""
        rest = match.group("rest")
        if rest:  # a one-line entry
            assert rest.endswith(")"), line
            fields_text = rest[:-1]
            has_children = False
        else:  # children follow; the next line holds the numbers
            fields_text = lines[index].strip().rstrip(",")
            index += 1
            has_children = True
        entries[path] = {
            "type": match.group("type"),
            "count": int(match.group("count") or 1),
            "fields": [field.strip() for field in fields_text.split(", ")],
            "depth": depth,
        }
        if has_children:
            stack.append(label)
    return entries


# -------------------------------------------------------------------------- estimates by hand


def estimate_by_hand(
    model_type: str,
    modules: list[tuple],
    nodes: list[NodeCost],
    *,
    latencies: dict[str, float] | None = None,
    measurements=None,
    input_shapes=None,
) -> Estimate:
    """modules: (qualified name, type, params, self_macs, self_flops, calls, extra_repr) in
    pre-order; inclusive numbers are the sums over each subtree. Params are given inclusive."""
    stats: dict[str, ModuleStats] = {}
    for name, type_name, params, self_macs, self_flops, calls, extra in modules:
        stats[name] = ModuleStats(
            name=name,
            type=type_name,
            depth=0 if name == "" else name.count(".") + 1,
            params=params,
            macs=self_macs,
            flops=self_flops,
            self_macs=self_macs,
            self_flops=self_flops,
            calls=calls,
            extra_repr=extra,
            latency=(latencies or {}).get(name),
        )
    for name in list(stats):
        if name:
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            stats[parent].children.append(name)
    for name in reversed(list(stats)):
        for child in stats[name].children:
            stats[name].macs += stats[child].macs
            stats[name].flops += stats[child].flops
    tree = nx.DiGraph()
    for name, item in stats.items():
        tree.add_node(name, stats=item)
        tree.add_edges_from((name, child) for child in item.children)
    root = stats[""]
    cls = Profile if measurements is not None else Estimate
    return cls(
        model_type=model_type,
        method="export",
        conventions="deepspeed",
        total_macs=root.macs,
        total_flops=root.flops,
        total_params=root.params,
        modules=stats,
        nodes=nodes,
        by_op=_totals(nodes, lambda node: node.op),
        by_rule=_totals(nodes, lambda node: node.rule_key),  # as production: unknown nodes under UNKNOWN_RULE
        unknown=_unknown(nodes),
        tree=tree,
        input_shapes=input_shapes or [],
        measurements=measurements,
    )


def _totals(nodes, key) -> dict[str, OpTotals]:
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    statuses: dict[str, set[str]] = defaultdict(set)
    for node in nodes:
        entry = sums[key(node)]
        entry[0] += 1
        entry[1] += node.macs
        entry[2] += node.flops
        statuses[key(node)].add(node.status)
    return {name: OpTotals(*values, statuses=tuple(sorted(statuses[name]))) for name, values in sums.items()}


def _unknown(nodes) -> list[UnknownOp]:
    seen: dict[str, list[str]] = defaultdict(list)
    for node in nodes:
        if node.status == UNKNOWN:
            seen[node.op].append(node.module)
    return [UnknownOp(op, len(where), tuple(dict.fromkeys(where))) for op, where in seen.items()]


def node(name, op, status, rule, module, macs=0, flops=0) -> NodeCost:
    return NodeCost(
        name=name, op=op, status=status, rule=rule, module=module, module_type="",
        input_shapes=(), output_shapes=(), macs=macs, flops=flops,
    )


def counted(name, op, rule, module, macs, flops) -> NodeCost:
    return node(name, op, COUNTED, rule, module, macs, flops)
