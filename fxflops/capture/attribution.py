"""Module attribution: which module ran each op, how often each module ran, what the model holds.

The eager and trace methods follow the running module through torch's global module hooks (they are
removed again, and `isolation` restores torch's hook tables); export and symbolic read the
`nn_module_stack` their tracers write on each node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from fxflops.capture.backward import FORWARD
from fxflops.capture.module_walk import walk_modules
from fxflops.capture.sharded import local_numel
from fxflops.results import ModuleInfo, WholeCall

NAME_TAG = "_fxflops_qualified_name"  # set in a module's __dict__ while capturing only; export may copy modules


class ModuleTracker:
    """The stack of running modules, calls per module, and the calls of modules counted as a whole.

    `keep` turns a whole-counted call's inputs and output into what the rule will read (fake values
    as they are; real tensors to meta, so no data is held).
    """

    def __init__(self, model: torch.nn.Module, prefix: str = "",
                 is_whole: Callable[[torch.nn.Module], bool] = lambda m: False,
                 keep: Callable[[Any], Any] = lambda value: value,
                 phase: Callable[[], str] | None = None, forward_inputs: bool = False) -> None:
        self._names = {id(module): _strip_prefix(name, prefix)
                       for name, module, alias_of in walk_modules(model) if alias_of is None}
        self._model = model
        self._is_whole = is_whole
        self._keep = keep
        self._phase = phase  # which pass runs (a forward recomputed in the backward is not a new call)
        self.stack: list[tuple[str, str]] = []
        self.call_log: list[str] = []  # each counted call's module, in order (what a block's calls were)
        self.whole_calls: list[WholeCall] = []
        self._handles: list[Any] = []
        self._ending: dict[int, list[Any]] = {}  # id(module) -> the hooks that end its calls after its own hooks
        # a module with forward pre-hooks of its own (an expert-parallel dispatch, a tensor-parallel input
        # redistribution): the tensors its forward itself received at its first call, after those hooks (the
        # tokens and tokens per expert grouped experts are handed; the meter reads them, timing.routed)
        # (`forward_inputs`: recorded only when asked, in captures that replay no block: the hook this needs
        # would make every hooked block's calls run)
        self.forward_inputs: dict[str, tuple[torch.Tensor, ...]] = {}
        self._record_inputs = forward_inputs

    @property
    def calls(self) -> dict[str, int]:
        """Calls per module, in the order each was first called."""
        return dict(Counter(self.call_log))

    def __enter__(self) -> ModuleTracker:
        hooks = torch.nn.modules.module
        self._handles = [
            hooks.register_module_forward_pre_hook(self._enter),
            hooks.register_module_forward_hook(self._exit, with_kwargs=True, always_call=True),
        ]
        # last among each hooked module's own pre-hooks (a global hook runs before them: it cannot see
        # what they hand the forward); removed on leaving, as isolation restores the hook tables
        if self._record_inputs:
            self._handles += [module.register_forward_pre_hook(self._forward_begins, with_kwargs=True)
                              for _, module, alias_of in walk_modules(self._model)
                              if alias_of is None and module._forward_pre_hooks]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()

    def name_of(self, module: torch.nn.Module) -> str | None:
        tagged = module.__dict__.get(NAME_TAG)
        return tagged if tagged is not None else self._names.get(id(module))

    def current(self) -> tuple[str, str]:
        return self.stack[-1] if self.stack else ("", "")

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        name = self.name_of(module)
        if name is not None:
            self.stack.append((name, type(module).__name__))
            if self._phase is None or self._phase() == FORWARD:
                self.call_log.append(name)
            if module._forward_hooks:
                # its own forward hooks run after the global one that ends the call (a tensor-parallel plan's
                # output redistribution, a user's hook): their ops are the module's too, as torch's
                # CommDebugMode has it. A hook of ours, last, ends the call (isolation removes it again).
                self._ending.setdefault(id(module), []).append(
                    module.register_forward_hook(self._after_own_hooks, always_call=True))

    def _exit(self, module: torch.nn.Module, args: Any, *kwargs_and_output: Any) -> None:
        # (kwargs, output) normally; (output,) when the forward raised: torch then calls every
        # always-called global hook without the kwargs
        name = self.name_of(module)
        if name is None or not self.stack:
            return
        if not self._ending.get(id(module)):
            self.stack.pop()
        if len(kwargs_and_output) == 2 and self._is_whole(module):
            kwargs, output = kwargs_and_output
            self.whole_calls.append(WholeCall(name, module, self._keep(tuple(args)), self._keep(dict(kwargs)),
                                              self._keep(output), FORWARD if self._phase is None else self._phase()))


    def _forward_begins(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        name = self.name_of(module)
        if name is not None and name not in self.forward_inputs:
            self.forward_inputs[name] = tuple(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))

    def _after_own_hooks(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        handles = self._ending.get(id(module))
        if handles:
            handles.pop().remove()  # (a module calling itself: each call its own hook, innermost first)
            if self.stack:
                self.stack.pop()


def tag_names(model: torch.nn.Module) -> None:
    """Write each module's qualified name into it (undone by `isolation`), for tracers that copy modules."""
    for name, module, alias_of in walk_modules(model):
        if alias_of is None:
            module.__dict__[NAME_TAG] = name


def module_infos(model: torch.nn.Module) -> tuple[dict[str, ModuleInfo], dict[str, str]]:
    """Each module by its first name (pre-order) with its inclusive parameter count; and the aliases.

    Read while the captured forward's tensors are in place, so lazy modules count what they materialized.
    """
    order: list[tuple[str, torch.nn.Module]] = []
    aliases: dict[str, str] = {}
    for name, module, alias_of in walk_modules(model):
        if alias_of is None:
            order.append((name, module))
        else:
            aliases[name] = alias_of
    names = {name for name, _ in order}
    children = {name: tuple(_children(name, module, names)) for name, module in order}
    first = _first_owners(order)
    params: dict[str, int] = {}
    shared: dict[str, list[tuple[str, str]]] = {}
    for name, module in reversed(order):  # children before parents
        own = [(key, p) for key, p in module._parameters.items() if p is not None]
        params[name] = sum(_numel(p) for key, p in own if first[id(p)] == _joined(name, key))
        params[name] += sum(params[child] for child in children[name])
        # a tied weight is left out here when its first owner lies outside this subtree: say where it counts
        held = [(key, first[id(p)]) for key, p in own if first[id(p)] != _joined(name, key)]
        for child in children[name]:
            held += [(_joined(child[len(name) + 1:] if name else child, key), owner) for key, owner in shared[child]]
        shared[name] = [(key, owner) for key, owner in held if not _within(owner, name)]
    infos = {
        name: ModuleInfo(type=type(module).__name__, extra_repr=_extra_repr(module),
                         children=children[name], params=params[name], shared=tuple(shared[name]))
        for name, module in order
    }
    return infos, aliases


def _first_owners(order: list[tuple[str, torch.nn.Module]]) -> dict[int, str]:
    """id(parameter) -> the qualified name it has first in definition order (as model.named_parameters())."""
    first: dict[int, str] = {}
    for name, module in order:
        for key, p in module._parameters.items():
            if p is not None:
                first.setdefault(id(p), _joined(name, key))
    return first


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _within(qualified: str, module: str) -> bool:
    """Whether a qualified parameter name belongs to `module` or one of its submodules."""
    return module == "" or qualified.startswith(module + ".")


def _children(name: str, module: torch.nn.Module, names: set[str]) -> list[str]:
    joined = [f"{name}.{key}" if name else key for key, child in module._modules.items() if child is not None]
    return [child for child in joined if child in names]


def _numel(tensor: torch.Tensor) -> int:
    try:
        return local_numel(tensor)  # a sharded (DTensor) parameter: this rank's shard
    except (RuntimeError, ValueError):  # a lazy parameter the forward never materialized
        return 0


def _extra_repr(module: torch.nn.Module) -> str:
    try:
        return module.extra_repr()
    except Exception:  # an extra_repr that reads a value a twin does not have must not fail the estimate
        return ""


def _strip_prefix(path: str, prefix: str) -> str | None:
    if not prefix:
        return path
    if path == prefix:
        return ""
    if path.startswith(prefix + "."):
        return path[len(prefix) + 1 :]
    return None


def _class_name(type_info: Any) -> str:
    if isinstance(type_info, type):
        return type_info.__name__
    return str(type_info).rsplit(".", 1)[-1].rstrip("'>")


def label_modules(graph_module: torch.fx.GraphModule, prefix: str, root_type: str) -> None:
    """Write meta["fxflops_module"] = (qualified name, class name) on every op node, subgraphs too,
    from the `nn_module_stack` torch.export and torch.fx write."""
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            innermost = ("", root_type)
            for path, type_info in (node.meta.get("nn_module_stack") or {}).values():
                stripped = _strip_prefix(path, prefix)
                if stripped is not None:
                    innermost = (stripped, _class_name(type_info))
            if node.op == "call_module" and "fxflops_module" not in node.meta:
                leaf = graph_module.get_submodule(node.target) if prefix == "" else None
                if leaf is not None:
                    innermost = (node.target, type(leaf).__name__)
            node.meta.setdefault("fxflops_module", innermost)
