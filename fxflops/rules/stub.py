"""An op call as the user reads it: the values its formula names took, and a rule stub that counts it.

`bound_values` lists each name a rule's formulas read with its value in one call (a tensor as
dtype[shape], a size as a number or, under a sweep, a formula), as explain() shows it. `rule_stub`
writes a TOML rule for an op no rule counts, naming what its formulas can read, for the user to
edit and pass back with rules=.
"""

from __future__ import annotations

from typing import Any

import torch

from fxflops.results import ROOT_LABEL
from fxflops.rules.binding import OpCall
from fxflops.rules.entries import Rule, ZeroList
from fxflops.rules.formula import HELPERS


def rule_stub(op: str, call: OpCall | None, module: str = "") -> str:
    """A TOML rule that counts `op` (a guess: one FLOP per output element), listing the names its
    formulas can read and their values in this call, for the user to edit and pass with rules=."""
    readable = _readable_names(call)
    where = f" (in {module or ROOT_LABEL})" if module is not None else ""
    lines = [
        f"# A rule for {op}{where}. Edit the formulas; save as a .toml file and pass it back:",
        "#   fxflops MODEL --rules FILE.toml   or   fxflops.estimate(model, ..., rules=['FILE.toml'])",
        "# Names a formula can read here: " + (", ".join(f"{k} = {v}" for k, v in readable.items()) or "out"),
        f"# Helpers: {', '.join(sorted(HELPERS))}",
        "[[rule]]",
        f"name = {_toml_string(_stub_name(op))}",
        f"ops = [{_toml_string(op)}]",
        'macs = "0"  # multiply-accumulates per call',
        f'flops = "{_guess(call)}"  # a guess: one FLOP per element of the first output',
    ]
    return "\n".join(lines) + "\n"


def _guess(call: OpCall | None) -> str:
    """One FLOP per element of the op's first tensor output (or, with none, of its first tensor input)."""
    out = call.out if call is not None else None
    if isinstance(out, torch.Tensor):
        return "numel(out)"
    if isinstance(out, list | tuple) and out and isinstance(out[0], torch.Tensor):
        return "numel(out[0])"
    for name, value in (call.names.items() if call is not None else ()):
        if isinstance(value, torch.Tensor) and name not in ("args", "kwargs"):
            return f"numel({name})"
    return "0"


def bound_values(entry: Rule | ZeroList | None, call: OpCall | None, sizes: Any) -> dict[str, str]:
    """Each name the rule's formulas read, with the value it took in this call."""
    if call is None:
        return {}
    if not isinstance(entry, Rule) or entry.function is not None:
        return _readable_names(call, sizes) if entry is None else {}
    wanted: list[str] = []
    for formula in (entry.when, entry.macs, entry.flops, *(f for pair in entry.presets.values() for f in pair)):
        if formula is not None:
            wanted += [name for name in sorted(formula.names) if name not in wanted and name not in ("macs", "flops")]
    names = {**call.names, "out": call.out}
    return {name: describe(names[name], sizes) for name in wanted if name in names}


def _readable_names(call: OpCall | None, sizes: Any = None) -> dict[str, str]:
    if call is None:
        return {}
    names = {key: value for key, value in call.names.items() if key not in ("args", "kwargs")}
    names["out"] = call.out
    return {key: describe(value, sizes) for key, value in names.items()
            if _describable(value)}


def _describable(value: Any) -> bool:
    return value is None or isinstance(value, torch.Tensor | int | float | bool | str | list | tuple
                                       | torch.SymInt | torch.SymFloat | torch.dtype)


def describe(value: Any, sizes: Any = None, limit: int = 120) -> str:
    """A bound value as the explanation prints it: a tensor as dtype[shape], sizes as numbers or formulas."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(_size(s, sizes) for s in value.shape)}]"
    if isinstance(value, torch.SymInt | torch.SymFloat):
        return _size(value, sizes)
    if isinstance(value, list | tuple):
        inner = ", ".join(describe(item, sizes, limit) for item in value)
        text = f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
        return text if len(text) <= limit else text[:limit - 3] + "..."
    if isinstance(value, torch.nn.Module):
        return type(value).__name__
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _size(size: Any, sizes: Any) -> str:
    if isinstance(size, torch.SymInt | torch.SymFloat) and sizes is not None:
        return str(sizes.expression(size))
    return str(size)


def _stub_name(op: str) -> str:
    parts = op.split(".")
    if parts[0] == "aten" and len(parts) >= 2:
        return parts[1]
    return parts[-1].lower() if parts else "my_op"


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
