"""The symbolic method: torch.fx symbolic tracing, shapes propagated on the meta device.

Modules a rule counts as a whole stay leaves of the graph. The model's tensors are swapped for meta
twins in place while tracing and propagating (no copy); `isolation` puts them back.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from fxflops.capture.attribution import ModuleTracker, label_modules, module_infos
from fxflops.capture.isolation import isolated
from fxflops.capture.methods import SYMBOLIC
from fxflops.capture.module_walk import unique_modules
from fxflops.capture.request import Request
from fxflops.capture.twins import meta_twin, swap_tensors, to_meta
from fxflops.results import ROOT_LABEL, Captured


class _RuleAwareTracer(torch.fx.Tracer):
    """Keeps a module whole only where a rule counts it as a whole (or the user asked)."""

    def __init__(self, is_leaf: Callable[[torch.nn.Module], bool]) -> None:
        super().__init__()
        self._is_leaf = is_leaf

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        # a parametrized module's weight is computed by its parametrization (weight_norm, spectral_norm;
        # the hook-based ones in a forward pre-hook, which torch.fx runs only for modules it traces
        # through): traced through, that work is counted and its rule-free ops see the computed weight
        return self._is_leaf(m) and not torch.nn.utils.parametrize.is_parametrized(m) and not _weight_hooks(m)

    def create_args_for_root(self, root_fn: Callable[..., Any], is_module: bool,
                             concrete_args: Any = None) -> tuple[Callable[..., Any], list[Any]]:
        root_fn, args = self._create_args_for_root(root_fn, is_module, concrete_args)
        root = self.root
        if not _weight_hooks(root):
            return root_fn, args

        def with_hooks(*values: Any) -> Any:
            # torch.fx calls the root's forward without its hooks: run the weight-computing ones
            for hook in _weight_hooks(root):
                hook(root, ())  # sets the root's weight attribute (a proxy; isolation restores it)
            return root_fn(*values)

        return with_hooks, args

    def _create_args_for_root(self, root_fn: Callable[..., Any], is_module: bool,
                              concrete_args: Any = None) -> tuple[Callable[..., Any], list[Any]]:
        # A forward under a functools.wraps decorator (transformers' merge_with_config_defaults,
        # check_model_inputs): torch.fx makes placeholders from the inner signature but calls the
        # outer wrapper with them positionally, where its (*args, **kwargs) take them out of place
        # (kwargs became the attention mask). Call the wrapper by keyword, as a user would.
        inner = inspect.unwrap(root_fn)
        if inner is root_fn:
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        _, args = super().create_args_for_root(inner, is_module, concrete_args)
        return _keyword_caller(root_fn, inspect.signature(inner)), args


_WEIGHT_HOOKS = (WeightNorm, SpectralNorm)  # torch.nn.utils' hook-based parametrizations


def _weight_hooks(module: torch.nn.Module) -> list[Any]:
    return [hook for hook in module._forward_pre_hooks.values() if isinstance(hook, _WEIGHT_HOOKS)]


def _skipped_hooks(model: torch.nn.Module, graph_module: torch.fx.GraphModule) -> list[str]:
    """A caution naming the modules whose forward hooks symbolic tracing did not run (the root's, and
    those of modules kept whole as graph leaves), if any."""
    leaves = {node.target for node in graph_module.graph.nodes if node.op == "call_module"}
    hooked = []
    for name, module in unique_modules(model):
        if name and name not in leaves:
            continue
        others = [hook for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
                  if not isinstance(hook, _WEIGHT_HOOKS)]
        if others:
            hooked.append(f"{name or ROOT_LABEL} ({', '.join(_hook_name(h) for h in others[:3])})")
    if not hooked:
        return []
    return [f"symbolic tracing does not run module forward hooks, so what the hooks of {', '.join(hooked[:5])}"
            f"{' ...' if len(hooked) > 5 else ''} compute is not counted (method='eager' runs them)"]


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__name__", None) or type(hook).__name__


def _keyword_caller(wrapper: Callable[..., Any], signature: inspect.Signature) -> Callable[..., Any]:
    """`wrapper` called with one value per parameter of `signature`, in order, passed as a user would:
    positional-only ones (and self) by position, the rest by keyword (defaults left out), *args and
    **kwargs spread."""
    parameters = list(signature.parameters.values())

    def call(*values: Any) -> Any:
        positional: list[Any] = []
        keywords: dict[str, Any] = {}
        for index, (parameter, value) in enumerate(zip(parameters, values)):
            if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
                positional.extend(value if isinstance(value, tuple | list) else ())
            elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
                keywords.update(value if isinstance(value, dict) else {})  # a proxy: nothing extra given
            elif index == 0 or parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
                positional.append(value)
            elif value is not parameter.default:  # a default the caller left: the wrapper may set its own
                keywords[parameter.name] = value
        return wrapper(*positional, **keywords)

    return call


class _MetaShapeProp(torch.fx.Interpreter):
    """Runs the graph on meta tensors and records each node's output as meta["val"]."""

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        n.meta["val"] = result
        return result


def capture(request: Request) -> Captured:
    model, args, kwargs = request.model, request.args, request.kwargs
    root_type = type(model).__name__
    with isolated(model) as modules:
        swap_tensors(modules, meta_twin)
        tracer = _RuleAwareTracer(request.is_leaf)
        graph = tracer.trace(model, concrete_args=_defaults_not_given(model, args, kwargs))
        graph_module = torch.fx.GraphModule(tracer.root, graph, root_type)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        bound = _bind_placeholders(placeholders, to_meta(args), to_meta(kwargs))
        tracker = ModuleTracker(model)  # whole-counted modules are graph leaves here, counted as nodes
        with tracker, torch.no_grad():  # shapes only (and spectral_norm's power iteration writes with out=)
            _MetaShapeProp(graph_module).run(*bound)
        infos, aliases = module_infos(model)
    label_modules(graph_module, prefix="", root_type=root_type)
    return Captured(graph_module, SYMBOLIC.name, infos, aliases, _symbolic_calls(graph_module, tracker.calls),
                    request.whole_paths(), tracker.whole_calls, cautions=_skipped_hooks(model, graph_module))


def _defaults_not_given(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    # forward arguments the caller leaves at their defaults stay constants, not proxies
    # (`if inputs_embeds is not None` must see None)
    parameters = list(inspect.signature(module.forward).parameters.values())
    defaults = {}
    for position, parameter in enumerate(parameters):
        given = position < len(args) or parameter.name in kwargs
        is_variadic = parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        if not given and not is_variadic and parameter.default is not inspect.Parameter.empty:
            defaults[parameter.name] = parameter.default
    return defaults


def _symbolic_calls(graph_module: torch.fx.GraphModule, leaf_calls: dict[str, int]) -> dict[str, int]:
    # only leaf modules run as modules under symbolic tracing; the others show in the module stacks
    calls = dict(leaf_calls)
    seen: set[str] = set()
    for node in graph_module.graph.nodes:
        for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
            if key not in seen:
                seen.add(key)
                if not (node.op == "call_module" and node.target == path):
                    calls[path] = calls.get(path, 0) + 1
    calls[""] = 1
    return calls


def _bind_placeholders(placeholders: list[torch.fx.Node], args: tuple, kwargs: dict) -> list[Any]:
    values = list(args)
    for node in placeholders[len(args) :]:
        if node.name in kwargs or node.target in kwargs:
            values.append(kwargs.get(node.target, kwargs.get(node.name)))
        elif node.args:
            values.append(node.args[0])  # the parameter's default
        elif node.target.startswith("*"):  # *args / **kwargs the caller left empty
            values.append({} if node.target.startswith("**") else ())
        else:
            raise TypeError(f"forward() is missing an input for '{node.target}'")
    return values
