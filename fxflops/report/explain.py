"""The text of an Explanation: the target's totals, then each counted op with its rule, formulas,
bound values and result, the unknown ops with their rule stubs, and the zero-cost ops by list."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxflops.report.formats import bytes_to_string, macs_to_string, number_to_string, printable
from fxflops.results import BACKWARD, COUNTED, ROOT_LABEL
from fxflops.rules import default_rules_dir

if TYPE_CHECKING:
    from fxflops.explain import Explanation, OpExplanation


def explanation_lines(explanation: Explanation, sources: bool = True) -> Iterable[str]:
    """The explanation's lines, names from the model shown, never acting on the terminal."""
    return (printable(line) for line in _lines(explanation, sources))


def _lines(explanation: Explanation, sources: bool = True) -> Iterable[str]:
    what = (f"module {explanation.target} ({explanation.module_type})" if explanation.kind == "module"
            else f"op node {explanation.target} (in {explanation.module_type or 'the model'})")
    own = ": the ops it ran itself (its submodules have their own)" if explanation.own else ""
    yield f"{what}, counted under the {explanation.conventions} conventions{own}"
    if explanation.sizes:
        yield f"  as formulas in the sweep's sizes: {', '.join(explanation.sizes)}"
    yield (f"  total: {_amount(explanation.macs, 'MACs', macs_to_string)}, "
           f"{_amount(explanation.flops, 'FLOPs', number_to_string)}, {_amount(explanation.bytes, 'bytes', bytes_to_string)}")
    counted = [op for op in explanation.ops if op.status == COUNTED]
    if counted:
        yield ""
        yield "counted ops:"
    for op in counted:
        yield from _op_lines(op, sources)
    if explanation.unknown:
        yield ""
        yield "unknown ops (not in the totals; a rule that counts each, to edit and pass back with --rules):"
    for op in explanation.unknown:
        yield f"  {op.op} x{op.calls} in {_modules_text(op.modules)}" + (f"  [{op.phase}]" if op.phase == BACKWARD else "")
        yield from ("    " + line for line in (op.stub or "").splitlines())
    if explanation.zero:
        yield ""
        yield "zero-cost ops:"
    for group in explanation.zero:
        listed = ", ".join(f"{op} x{n}" for op, n in sorted(group.ops.items(), key=lambda item: -item[1]))
        where = f" ({_file(group.where)})" if group.where else ""
        yield f"  {group.name}{where}: {listed}"


def _op_lines(op: OpExplanation, sources: bool = True) -> Iterable[str]:
    phase = "" if op.phase == "forward" else f" [{op.phase}]"
    yield f"  {op.op} x{op.calls} in {_modules_text(op.modules)}{phase}: rule '{op.rule}' ({_file(op.where)}, family {op.family})"
    for key, text in op.formulas.items():
        yield f"    {key:<5} = {text}"
    if op.values:
        yield "    with " + ", ".join(f"{name} = {value}" for name, value in op.values.items())
    if op.rule_counts is not None:
        yield f"    rule gives {exact(op.rule_counts[0])} MACs, {exact(op.rule_counts[1])} FLOPs per call"
    if op.preset:
        yield f"    {op.preset}"
    if op.attention:
        yield f"    {op.attention}"
    per_call = f"{exact(op.macs)} MACs, {exact(op.flops)} FLOPs, {exact(op.bytes)} bytes per call"
    times = f"; x{op.calls} = {exact(op.total_macs)} MACs, {exact(op.total_flops)} FLOPs" if op.calls > 1 else ""
    yield f"    = {per_call}{times}"
    if op.source and sources:
        yield f"    at {op.source}"


def _modules_text(modules: tuple[str, ...], shown: int = 3) -> str:
    names = [name or ROOT_LABEL for name in modules[:shown]]
    more = f" and {len(modules) - shown} more modules" if len(modules) > shown else ""
    return ", ".join(names) + more


def _file(where: str | None) -> str:
    """A shipped rule file as rules/NAME.toml; a user's file or Python rule as given."""
    if not where:
        return ""
    shipped = default_rules_dir()
    try:
        return f"rules/{Path(where).resolve().relative_to(shipped.resolve())}"
    except (ValueError, OSError):
        return where


def _amount(value: Any, unit: str, scaled: Any) -> str:
    if isinstance(value, int):
        return f"{value:,} {unit} ({scaled(value).strip()})" if value >= 1000 else f"{value} {unit}"
    return f"{value} {unit}"


def exact(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)
