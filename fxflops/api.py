"""The public entry points: estimate() a model's cost, annotate() a graph someone already has."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from fxflops.capture import Captured, capture, inputs_from_shape, label_modules
from fxflops.count import count_nodes
from fxflops.results import Estimate
from fxflops.rules import CONVENTIONS, RuleSpec, RuleTable, load_table, load_user_entries
from fxflops.tree import build_estimate


class UnknownOpsWarning(UserWarning):
    """Some ops in the graph matched no rule and no zero list: their cost is not in the totals."""


def estimate(
    model: torch.nn.Module,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    input_shape: Sequence[int] | Sequence[Sequence[int]] | None = None,
    method: str = "auto",
    conventions: str = "deepspeed",
    rules: Iterable[RuleSpec] | RuleSpec | None = None,
    leaf_modules: Iterable[type | str] | None = None,
) -> Estimate:
    """MACs, FLOPs and parameters of one forward of `model`, per module, without running it.

    `args`/`kwargs` may be real or meta tensors (only their shapes and dtypes are used), or give
    `input_shape=(1, 3, 224, 224)`. `method` is "export", "symbolic", "trace" (one real forward,
    for data-dependent control flow) or "auto" (each in that order). `conventions` is "deepspeed"
    or "torch" (FlopCounterMode's counting). `rules` adds TOML rule files or {op: callable} maps;
    `leaf_modules` lists module classes (or qualified class names) to count as a whole by their rule.
    """
    _check_conventions(conventions)
    args, kwargs = _normalize_inputs(model, args, kwargs, input_shape)
    table = load_table(rules)
    user_entries = load_user_entries(rules)
    user_table = RuleTable(user_entries) if user_entries else None
    is_whole = _whole_predicate(user_table, leaf_modules)
    state = _ModelState.save(model)
    try:
        captured = capture(model, args, kwargs, method, is_leaf=lambda m: table.knows_module(m) or is_whole(m),
                           is_whole=is_whole)
    finally:
        state.restore(model)
    result = _estimate_captured(model, captured, table, conventions, is_whole)
    _warn_unknown(result)
    return result


def annotate(graph: torch.fx.GraphModule | torch.export.ExportedProgram, *, conventions: str = "deepspeed",
             rules: Iterable[RuleSpec] | RuleSpec | None = None) -> torch.fx.GraphModule:
    """Write each op node's cost into node.meta["fxflops"] (macs, flops, rule, status, module); return the graph.

    Takes an FX GraphModule whose nodes carry meta["val"] (torch.export, make_fx, or a shape-propagated
    symbolic trace) or an ExportedProgram.
    """
    _check_conventions(conventions)
    graph_module = graph.graph_module if isinstance(graph, torch.export.ExportedProgram) else graph
    label_modules(graph_module, prefix="", root_type=type(graph_module).__name__)
    captured = Captured(graph_module, "given", graph_module, {})
    costs = count_nodes(captured, load_table(rules), conventions)
    nodes = {node.name: node for node in graph_module.graph.nodes}
    for cost in costs:
        node = nodes.get(cost.name)
        if node is not None:
            node.meta["fxflops"] = {
                "macs": cost.macs, "flops": cost.flops, "rule": cost.rule, "status": cost.status,
                "module": cost.module, "op": cost.op,
            }
    return graph_module


def _estimate_captured(model: torch.nn.Module, captured: Captured, table: RuleTable, conventions: str,
                       is_whole: Callable[[torch.nn.Module], bool]) -> Estimate:
    costs = count_nodes(captured, table, conventions, is_whole)
    return build_estimate(model, captured, costs, conventions)


def _check_conventions(conventions: str) -> None:
    if conventions not in CONVENTIONS:
        raise ValueError(f"conventions must be one of {', '.join(CONVENTIONS)}; got {conventions!r}")


def _normalize_inputs(model: torch.nn.Module, args: Any, kwargs: dict | None, input_shape: Any) -> tuple[tuple, dict]:
    if input_shape is not None:
        if args not in ((), [], None):
            raise ValueError("give either input_shape or args, not both")
        args = inputs_from_shape(model, input_shape)
    if args is None:
        args = ()
    elif not isinstance(args, tuple | list):
        args = (args,)
    return tuple(args), dict(kwargs or {})


def _whole_predicate(user_table: RuleTable | None,
                     leaf_modules: Iterable[type | str] | None) -> Callable[[torch.nn.Module], bool]:
    classes = tuple(c for c in (leaf_modules or ()) if isinstance(c, type))
    names = {c for c in (leaf_modules or ()) if isinstance(c, str)}

    def is_whole(module: torch.nn.Module) -> bool:
        if classes and isinstance(module, classes):
            return True
        if names and any(f"{c.__module__}.{c.__qualname__}" in names or c.__name__ in names
                         for c in type(module).__mro__):
            return True
        return user_table is not None and user_table.knows_module(module)

    return is_whole


def _warn_unknown(result: Estimate) -> None:
    if result.unknown:
        listed = ", ".join(f"{u.op} x{u.count} (in {', '.join(m or '<root>' for m in u.modules[:3])})"
                           for u in result.unknown[:8])
        warnings.warn(
            f"{sum(u.count for u in result.unknown)} op calls matched no rule and are not in the totals: {listed}. "
            "Add a rule for them (rules=[...]) or declare them zero-cost; see Estimate.unknown.",
            UnknownOpsWarning,
            stacklevel=3,
        )


class _ModelState:
    """What estimate() promises to leave as it was: training flags and requires_grad."""

    def __init__(self, training: list[tuple[torch.nn.Module, bool]],
                 grads: list[tuple[torch.Tensor, bool]]) -> None:
        self.training = training
        self.grads = grads

    @classmethod
    def save(cls, model: torch.nn.Module) -> _ModelState:
        return cls([(m, m.training) for m in model.modules()], [(p, p.requires_grad) for p in model.parameters()])

    def restore(self, model: torch.nn.Module) -> None:
        for module, training in self.training:
            module.training = training
        for param, requires_grad in self.grads:
            if param.requires_grad != requires_grad:
                param.requires_grad_(requires_grad)
