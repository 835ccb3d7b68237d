"""Capture: turn a model and example inputs into an FX graph whose nodes carry shapes and modules.

Every method hands the next stage the same thing: a GraphModule in which each op node has
`meta["val"]` (fake or meta values: shapes, no data) and `meta["fxflops_module"]` (the qualified
name and class name of the innermost module that ran it, "" being the model itself).

- export:   torch.export (non-strict) of a weightless meta-device copy of the model.
- symbolic: torch.fx symbolic tracing of that copy, shapes propagated on the meta device.
- trace:    the aten ops one real forward executes (needs real weights and inputs; costs one forward).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import operator
import dataclasses
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

METHODS = ("export", "symbolic", "trace")
_WRAPPED = "model"  # attribute name of the user's model inside the output-flattening wrapper
_NAME_TAG = "_fxflops_qualified_name"  # set on the modules of our meta copy only, never the user's


class CaptureError(RuntimeError):
    """Every capture method failed; lists each attempt, where it broke and what to try."""

    def __init__(self, model_type: str, attempts: Sequence[Attempt]) -> None:
        self.attempts = list(attempts)
        lines = [f"fxflops could not capture {model_type}: every method failed."]
        for attempt in attempts:
            lines.append(f"  - {attempt.method}: {attempt.reason}")
            if attempt.module is not None:
                lines.append(f"      in module '{attempt.module or '<root>'}'" + (f", op {attempt.op}" if attempt.op else ""))
            if attempt.source:
                lines.append(f"      at {attempt.source}")
        lines.append(
            "What to try: check the input shapes against the model; for data-dependent control flow "
            "pass real weights and inputs with method='trace'; mark custom blocks with leaf_modules=[...] "
            "and give them a rule."
        )
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Attempt:
    method: str
    reason: str
    module: str | None = None  # qualified name of the module whose forward raised, when known
    source: str | None = None  # "file:line: code" of the user's line where tracing broke
    op: str | None = None  # the op being run when it broke, when known


@dataclass
class Captured:
    """A captured graph plus what the later stages need to attribute it."""

    graph_module: torch.fx.GraphModule
    method: str
    structure: torch.nn.Module  # the module tree the graph refers to (a meta copy, or the model itself)
    module_calls: dict[str, int]  # qualified name -> forward calls seen while capturing
    whole_calls: list[WholeCall] = field(default_factory=list)  # calls of modules a rule counts whole
    input_shapes: Any = ()  # (args, kwargs) with every tensor replaced by its shape
    attempts: list[Attempt] = field(default_factory=list)  # failed attempts before this one


# --- inputs and the weightless copy -------------------------------------------------------------


def inputs_from_shape(model: torch.nn.Module, input_shape: Any) -> tuple[torch.Tensor, ...]:
    """Meta tensors for DeepSpeed's `input_shape=` convenience: one shape, or a list of shapes."""
    shapes = [input_shape] if input_shape and isinstance(input_shape[0], int) else list(input_shape)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    for shape in shapes:
        if not all(isinstance(size, int) and size >= 0 for size in shape):
            raise ValueError(f"input_shape must be a tuple of non-negative ints (or a list of them), got {shape!r}")
    return tuple(torch.empty(tuple(shape), dtype=dtype, device="meta") for shape in shapes)


def to_meta(value: Any) -> Any:
    """The same pytree with every tensor replaced by a meta tensor of the same shape and dtype."""

    def convert(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().to("meta").requires_grad_(leaf.requires_grad)
        return leaf

    return tree_map(convert, value)


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module tree whose parameters and buffers live on the meta device.

    The user's weights are never copied: deepcopy's memo maps each tensor to its meta twin up
    front, so only the module objects and small attributes are duplicated.
    """
    memo: dict[int, Any] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) not in memo:
                memo[id(param)] = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None and id(buffer) not in memo:
                memo[id(buffer)] = buffer.detach().to("meta")
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = value.detach().to("meta")
        # the copy gets no hooks: they may hold unpicklable state, and must not fire during tracing
        for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                      module._backward_pre_hooks):
            memo[id(hooks)] = type(hooks)()
    shadow = copy.deepcopy(model, memo)
    # torch.export may copy modules again (it does for aliased ones), so identity cannot name them
    for name, module in shadow.named_modules():
        module.__dict__[_NAME_TAG] = name
    return shadow


def _module_name(module: torch.nn.Module, names_by_id: Mapping[int, str]) -> str | None:
    """A module's qualified name: its tag in our meta copy, else by identity in the user's model."""
    tagged = module.__dict__.get(_NAME_TAG)
    return tagged if tagged is not None else names_by_id.get(id(module))


def has_meta_tensors(model: torch.nn.Module, args: Any = (), kwargs: Any = None) -> bool:
    tensors = [*model.parameters(), *model.buffers(), *tensors_in((args, kwargs or {}))]
    return any(t.is_meta for t in tensors)


# --- output flattening --------------------------------------------------------------------------


def tensors_in(value: Any, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every tensor reachable from a model output: tuples, dicts, dataclasses, cache objects."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        return [value]
    if value is None or isinstance(value, str | bytes | int | float | bool | torch.dtype | torch.device):
        return []
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, Mapping):
        items: Iterable[Any] = value.values()
    elif isinstance(value, list | tuple | set | frozenset):
        items = value
    elif dataclasses.is_dataclass(value):
        items = (getattr(value, f.name) for f in dataclasses.fields(value))
    elif hasattr(value, "__dict__"):
        items = vars(value).values()
    else:
        return []
    return [tensor for item in items for tensor in tensors_in(item, seen)]


class _FlatOutputs(torch.nn.Module):
    """Returns the model's output tensors as a flat tuple, so any output type can be exported.

    Inputs export cannot take (cache objects and other custom classes) are held here as constants
    and put back in their places on each call.
    """

    def __init__(self, model: torch.nn.Module, held_args: dict[int, Any], held_kwargs: dict[str, Any]) -> None:
        super().__init__()
        setattr(self, _WRAPPED, model)
        self._held_args = held_args
        self._held_kwargs = held_kwargs

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        merged = list(args)
        for index in sorted(self._held_args):
            merged.insert(index, self._held_args[index])
        output = getattr(self, _WRAPPED)(*merged, **kwargs, **self._held_kwargs)
        return tuple(tensors_in(output))


def _is_plain(value: Any) -> bool:
    """Whether torch.export takes this input as it is (tensors and builtin containers of them)."""
    if value is None or isinstance(value, torch.Tensor | int | float | bool | str | torch.dtype | torch.device):
        return True
    if isinstance(value, list | tuple):
        return all(_is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _is_plain(item) for key, item in value.items())
    return False


def meta_deepcopy(value: Any) -> Any:
    """A deep copy of any object in which every reachable tensor is a meta twin (no data copied)."""
    memo = {id(tensor): tensor.detach().to("meta") for tensor in tensors_in(value)}
    return copy.deepcopy(value, memo)


def _hold_custom_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict, dict[int, Any], dict[str, Any]]:
    held_args = {i: meta_deepcopy(a) for i, a in enumerate(args) if not _is_plain(a)}
    held_kwargs = {k: meta_deepcopy(v) for k, v in kwargs.items() if not _is_plain(v)}
    plain_args = tuple(a for i, a in enumerate(args) if i not in held_args)
    plain_kwargs = {k: v for k, v in kwargs.items() if k not in held_kwargs}
    return plain_args, plain_kwargs, held_args, held_kwargs


# --- module attribution -------------------------------------------------------------------------


def _class_name(type_info: Any) -> str:
    if isinstance(type_info, type):
        return type_info.__name__
    return str(type_info).rsplit(".", 1)[-1].rstrip("'>")


def _strip_prefix(path: str, prefix: str) -> str | None:
    if not prefix:
        return path
    if path == prefix:
        return ""
    if path.startswith(prefix + "."):
        return path[len(prefix) + 1 :]
    return None


def label_modules(graph_module: torch.fx.GraphModule, prefix: str, root_type: str) -> None:
    """Write meta["fxflops_module"] = (qualified name, class name) on every op node, subgraphs too."""
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


@dataclass(frozen=True)
class WholeCall:
    """One call of a module that a rule counts as a whole: its inputs and output, as meta values."""

    module: str  # qualified name
    args: tuple
    kwargs: dict
    out: Any


class _CallCounter:
    """Counts forward calls per module through torch's global module hooks while tracing runs.

    For modules counted as a whole it also keeps each call's inputs and output (as meta values),
    which is what their rule's formula reads.
    """

    def __init__(self, structure: torch.nn.Module, prefix: str = "",
                 is_whole: Callable[[torch.nn.Module], bool] = lambda m: False) -> None:
        self._names = {id(module): name for name, module in structure.named_modules()}
        self._prefix = prefix
        self._is_whole = is_whole
        self.calls: dict[str, int] = {}
        self.whole_calls: list[WholeCall] = []
        self._handles: list[Any] = []

    def __enter__(self) -> _CallCounter:
        hooks = torch.nn.modules.module
        self._handles = [
            hooks.register_module_forward_pre_hook(self._count),
            hooks.register_module_forward_hook(self._record_whole, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()

    def _name(self, module: torch.nn.Module) -> str | None:
        tagged = module.__dict__.get(_NAME_TAG)
        if tagged is not None:
            return tagged
        name = self._names.get(id(module))
        return None if name is None else _strip_prefix(name, self._prefix)

    def _count(self, module: torch.nn.Module, args: Any) -> None:
        name = self._name(module)
        if name is not None:
            self.calls[name] = self.calls.get(name, 0) + 1

    def _record_whole(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        name = self._name(module)
        if name is not None and self._is_whole(module):
            self.whole_calls.append(WholeCall(name, to_meta(tuple(args)), to_meta(dict(kwargs)), to_meta(output)))


# --- the three methods --------------------------------------------------------------------------


def capture_export(model: torch.nn.Module, structure: torch.nn.Module, args: tuple, kwargs: dict,
                   is_whole: Callable[[torch.nn.Module], bool]) -> Captured:
    plain_args, plain_kwargs, held_args, held_kwargs = _hold_custom_inputs(args, kwargs)
    wrapper = _FlatOutputs(structure, held_args, held_kwargs)
    meta_args, meta_kwargs = to_meta(plain_args), to_meta(plain_kwargs)
    # torch.export prints its partial graph to stderr when it fails; we report the failure ourselves,
    # and pass on whatever else was written there
    stderr = io.StringIO()
    with _CallCounter(wrapper, prefix=_WRAPPED, is_whole=is_whole) as counter, contextlib.redirect_stderr(stderr):
        program = torch.export.export(wrapper, tuple(meta_args), dict(meta_kwargs), strict=False)
    sys.stderr.write(stderr.getvalue())
    graph_module = program.graph_module
    _refuse_data_dependent_sizes(graph_module)
    label_modules(graph_module, prefix=_WRAPPED, root_type=type(model).__name__)
    return Captured(graph_module, "export", structure, counter.calls, counter.whole_calls)


def _refuse_data_dependent_sizes(graph_module: torch.fx.GraphModule) -> None:
    """Export succeeds where sizes depend on tensor values (.item(), nonzero); costs need real sizes."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "placeholder" and free_unbacked_symbols(node.meta.get("val")):
                where = (node.meta.get("stack_trace") or "").strip().splitlines()[-2:]
                raise RuntimeError(
                    f"the output size of {node.target} depends on tensor values (data-dependent: "
                    f"{node.meta['val'].shape if hasattr(node.meta['val'], 'shape') else node.meta['val']}); "
                    f"costs need concrete sizes. {' '.join(line.strip() for line in where)}"
                )


class _RuleAwareTracer(torch.fx.Tracer):
    """Keeps a module whole only where a rule counts it as a whole (or the user asked)."""

    def __init__(self, is_leaf: Callable[[torch.nn.Module], bool]) -> None:
        super().__init__()
        self._is_leaf = is_leaf

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return self._is_leaf(m)


class _MetaShapeProp(torch.fx.Interpreter):
    """Runs the graph on meta tensors and records each node's output as meta["val"]."""

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        n.meta["val"] = result
        return result


def capture_symbolic(model: torch.nn.Module, structure: torch.nn.Module, args: tuple, kwargs: dict,
                     is_leaf: Callable[[torch.nn.Module], bool]) -> Captured:
    tracer = _RuleAwareTracer(is_leaf)
    graph = tracer.trace(structure, concrete_args=_defaults_not_given(structure, args, kwargs))
    graph_module = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    meta_args, meta_kwargs = meta_deepcopy(args), meta_deepcopy(kwargs)
    bound = _bind_placeholders(placeholders, meta_args, meta_kwargs)
    with _CallCounter(structure) as counter:
        _MetaShapeProp(graph_module).run(*bound)
    label_modules(graph_module, prefix="", root_type=type(model).__name__)
    return Captured(graph_module, "symbolic", structure, _symbolic_calls(graph_module, counter.calls))


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
        else:
            raise TypeError(f"forward() is missing an input for '{node.target}'")
    return values


def capture_trace(model: torch.nn.Module, args: tuple, kwargs: dict,
                  is_whole: Callable[[torch.nn.Module], bool]) -> Captured:
    """Record the aten ops of one real forward into an FX graph, with the modules that ran them."""
    if has_meta_tensors(model, args, kwargs):
        raise RuntimeError("needs real weights and real input tensors (the model or inputs are on the meta device)")
    args, kwargs = _copy_custom_inputs(args), _copy_custom_inputs(kwargs)
    recorder = _OpRecorder(model)
    # a real forward in training mode updates buffers (batch-norm running stats): put them back after
    saved_buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    try:
        with (torch.no_grad(), _CallCounter(model, is_whole=is_whole) as counter, recorder.tracker, recorder,
              _OpaqueFunctions(recorder)):
            output = model(*args, **kwargs)
    finally:
        with torch.no_grad():
            for buffer, value in saved_buffers:
                buffer.copy_(value)
    graph_module = recorder.finish(output)
    return Captured(graph_module, "trace", model, counter.calls, counter.whole_calls)


def _copy_custom_inputs(value: Any) -> Any:
    # cache objects are updated in place by a forward: run on a copy so the user's stays as it was
    if isinstance(value, dict):
        return {k: v if _is_plain(v) else copy.deepcopy(v) for k, v in value.items()}
    return tuple(v if _is_plain(v) else copy.deepcopy(v) for v in value)


class _ModuleStack:
    """The stack of modules currently running, through torch's global module hooks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._names = {id(module): name for name, module in model.named_modules()}
        self.stack: list[tuple[str, str]] = []
        self._handles: list[Any] = []

    def __enter__(self) -> _ModuleStack:
        hooks = torch.nn.modules.module
        self._handles = [
            hooks.register_module_forward_pre_hook(self._enter),
            hooks.register_module_forward_hook(self._exit, always_call=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        name = _module_name(module, self._names)
        if name is not None:
            self.stack.append((name, type(module).__name__))

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if _module_name(module, self._names) is not None and self.stack:
            self.stack.pop()

    def current(self) -> tuple[str, str]:
        return self.stack[-1] if self.stack else ("", "")


class _OpaqueFunctions(TorchFunctionMode):
    """Records composite functions whose eager decomposition varies by backend as their single aten op.

    On CPU, scaled_dot_product_attention may decompose into scale, matmul and softmax ops (the math
    fallback); recording it as one aten.scaled_dot_product_attention call keeps the trace method's
    count equal to export's.
    """

    def __init__(self, recorder: _OpRecorder) -> None:
        super().__init__()
        self._recorder = recorder
        self._as_aten = {torch.nn.functional.scaled_dot_product_attention:
                         torch.ops.aten.scaled_dot_product_attention.default}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        aten_op = self._as_aten.get(func)
        if aten_op is None or self._recorder.inside_opaque:
            return func(*args, **kwargs)
        self._recorder.inside_opaque += 1
        try:
            out = func(*args, **kwargs)
            self._recorder.record(aten_op, args, kwargs, out)  # its own tensor ops must not be recorded either
        finally:
            self._recorder.inside_opaque -= 1
        return out


class _OpRecorder(TorchDispatchMode):
    """Appends one FX node per aten op executed, wired to the nodes that produced its inputs."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.tracker = _ModuleStack(model)
        self.graph = torch.fx.Graph()
        self._producers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._inputs = 0
        self._root_type = type(model).__name__
        self.inside_opaque = 0  # > 0 while a function recorded as one op runs its decomposition

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.inside_opaque:
            self.record(func, args, kwargs, out)
        return out

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        node = self.graph.call_function(func, tree_map(self._as_arg, args), tree_map(self._as_arg, kwargs))
        node.meta["val"] = to_meta(out)
        path, type_name = self.tracker.current()
        node.meta["fxflops_module"] = (path, type_name or self._root_type)
        self._register_outputs(node, out)

    def _register_outputs(self, node: torch.fx.Node, out: Any) -> None:
        # a multi-output op's tensors are reached through getitem nodes, as in any FX graph
        if isinstance(out, torch.Tensor):
            self._producers[out] = node
        elif isinstance(out, list | tuple):
            for index, item in enumerate(out):
                if isinstance(item, torch.Tensor | list | tuple):
                    element = self.graph.call_function(operator.getitem, (node, index))
                    element.meta["val"] = to_meta(item)
                    element.meta["fxflops_module"] = node.meta["fxflops_module"]
                    self._register_outputs(element, item)

    def _as_arg(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        producer = self._producers.get(value)
        if producer is None:
            producer = self.graph.placeholder(f"input_{self._inputs}")
            producer.meta["val"] = to_meta(value)
            self._inputs += 1
            self._producers[value] = producer
        return producer

    def finish(self, output: Any) -> torch.fx.GraphModule:
        self.graph.output(tuple(self._as_arg(t) for t in tensors_in(output)))
        return torch.fx.GraphModule(torch.nn.Module(), self.graph)


# --- choosing a method --------------------------------------------------------------------------


def capture(model: torch.nn.Module, args: tuple, kwargs: dict, method: str = "auto",
            is_leaf: Callable[[torch.nn.Module], bool] = lambda m: False,
            is_whole: Callable[[torch.nn.Module], bool] = lambda m: False) -> Captured:
    """Capture with the requested method, or with each in turn for "auto"; raise CaptureError if all fail."""
    if method not in (*METHODS, "auto"):
        raise ValueError(f"method must be one of {', '.join((*METHODS, 'auto'))}; got {method!r}")
    methods = METHODS if method == "auto" else (method,)
    structure = meta_copy(model) if set(methods) & {"export", "symbolic"} else model
    attempts: list[Attempt] = []
    for name in methods:
        if method == "auto" and name == "trace" and has_meta_tensors(model, args, kwargs):
            attempts.append(Attempt("trace", "skipped: needs real weights and inputs (the model is on the meta device)"))
            continue
        try:
            with _quiet_torch_logs():
                captured = _run_method(name, model, structure, args, kwargs, is_leaf, is_whole)
        except Exception as error:  # each method's failure is reported, then the next one is tried
            traced = model if name == "trace" else structure
            attempts.append(_describe_failure(name, error, traced))
            continue
        captured.attempts = attempts
        captured.input_shapes = _shapes_of((args, kwargs))
        return captured
    raise CaptureError(type(model).__name__, attempts)


def _run_method(name: str, model: torch.nn.Module, structure: torch.nn.Module, args: tuple, kwargs: dict,
                is_leaf: Callable[[torch.nn.Module], bool], is_whole: Callable[[torch.nn.Module], bool]) -> Captured:
    if name == "export":
        return capture_export(model, structure, args, kwargs, is_whole)
    if name == "symbolic":
        return capture_symbolic(model, structure, args, kwargs, is_leaf)
    return capture_trace(model, args, kwargs, is_whole)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Silence torch's loggers while a capture method is tried; its failures reach the user in our error."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name == "torch" or name.startswith("torch.")]
    levels = [(logger, logger.level) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in levels:
            logger.setLevel(level)


def _shapes_of(value: Any) -> Any:
    return tree_map(lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else v, value)


_LIBRARY_DIRS = tuple(
    os.path.dirname(module.__file__) + os.sep for module in (torch,) if getattr(module, "__file__", None)
) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


def _describe_failure(method: str, error: BaseException, model: torch.nn.Module) -> Attempt:
    """The error's first line, the innermost module whose forward was running, and the user's line."""
    frames = traceback.extract_tb(error.__traceback__)
    user_frames = [f for f in frames if not f.filename.startswith(_LIBRARY_DIRS) and "<frozen" not in f.filename]
    source = None
    if user_frames:
        frame = user_frames[-1]
        source = f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return Attempt(method, _first_lines(error), _failing_module(error, model), source, _failing_op(error))


def _failing_op(error: BaseException) -> str | None:
    """The aten op whose shape function raised (fake and meta kernels run it as `func`)."""
    op = None
    tb = error.__traceback__
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("func")
        if isinstance(candidate, torch._ops.OpOverload):
            op = str(candidate)
        tb = tb.tb_next
    return op


def _first_lines(error: BaseException, limit: int = 3) -> str:
    text = str(error).strip() or type(error).__name__
    lines = [line for line in text.splitlines() if line.strip()][:limit]
    return f"{type(error).__name__}: " + " | ".join(line.strip() for line in lines)


def _failing_module(error: BaseException, traced: torch.nn.Module) -> str | None:
    """Qualified name of the innermost module whose forward() is on the failing stack."""
    names = {}
    for name, module in traced.named_modules():
        names.setdefault(id(module), name)
    innermost = None
    tb = error.__traceback__
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if tb.tb_frame.f_code.co_name == "forward" and isinstance(candidate, torch.nn.Module):
            innermost = _module_name(candidate, names) or innermost
        tb = tb.tb_next
    return innermost
