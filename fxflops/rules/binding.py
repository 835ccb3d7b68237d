"""Binding: an op call's arguments named the way its schema, signature or module does (OpCall), and the
canonical spelling of an op (aten_key, function_key) that rules are matched by."""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class OpCall:
    """One call of an op as a rule sees it: the op, its bound arguments and its output."""

    key: str  # canonical op name, e.g. "aten.linear.default"
    kind: str  # "aten" | "function" | "method" | "module"
    target: Any
    names: Mapping[str, Any]  # argument (or module attribute) name -> value
    out: Any
    module: torch.nn.Module | None = None
    conventions: str = "deepspeed"  # the preset counting this call (what a callable rule reads)
    within: str = ""  # the class name of the innermost module the call ran in (a module call: its own)


def _object_spelling(obj: Any) -> str:
    if isinstance(obj, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return aten_key(obj)
    return f"{obj.__module__}.{obj.__qualname__}"


def aten_key(op: Any) -> str:
    """'aten.linear.default' for an OpOverload, 'aten.linear' for a packet."""
    if isinstance(op, torch._ops.OpOverload):
        namespace, name = op._schema.name.split("::")
        return f"{namespace}.{name}.{op._overloadname}"
    return str(op).replace("::", ".")


# --- binding --------------------------------------------------------------------------------


def bind_op_call(target: Any, kind: str, args: tuple, kwargs: Mapping[str, Any], out: Any,
                 module: torch.nn.Module | None = None) -> OpCall:
    """Name an op call's arguments the way its schema, signature or module does."""
    if kind == "aten":
        key, names = aten_key(target), _bind_schema(target, args, kwargs)
    elif kind == "method":
        key, names = f"Tensor.{target}", _bind_method(target, args, kwargs)
    elif kind == "module":
        cls = type(module)
        key, names = f"{cls.__module__}.{cls.__qualname__}", _bind_module(module, args, kwargs)
    else:
        key, names = function_key(target), _bind_function(target, args, kwargs)
    names = {**names, "args": tuple(args), "kwargs": dict(kwargs)}
    return OpCall(key=key, kind=kind, target=target, names=names, out=out, module=module)


def function_key(target: Any) -> str:
    if getattr(target, "__module__", None) == "_operator" or target in vars(operator).values():
        return f"operator.{target.__name__}"
    module = getattr(target, "__module__", None) or ""
    if module.startswith("torch._C") or module == "torch.functional":
        module = "torch"
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', repr(target)))}"


def _bind_schema(op: Any, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    names: dict[str, Any] = {}
    schema_args = op._schema.arguments
    for position, argument in enumerate(schema_args):
        if position < len(args) and not argument.kwarg_only:
            names[argument.name] = args[position]
        elif argument.name in kwargs:
            names[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            names[argument.name] = argument.default_value
        else:
            names[argument.name] = None
    return names


def _bind_function(target: Any, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    for signature in _signatures(target):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            continue
        bound.apply_defaults()
        return _flatten_varargs(bound, signature)
    return {}


def _bind_method(name: str, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    function = _method_function(name)
    names = _bind_function(function, args, kwargs) if function is not None else {}
    if args:
        names.setdefault("self", args[0])
        names.setdefault("input", args[0])
    return names


def _bind_module(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    names = {key: value for key, value in vars(module).items() if not key.startswith("_")}
    names.update(module._parameters)
    names.update(module._buffers)
    names["training"] = module.training
    signature = _find_signatures(module.forward)  # not cached: the cache would keep the module alive
    if signature:
        try:
            bound = signature[0].bind(*args, **kwargs)
            bound.apply_defaults()
            names.update(_flatten_varargs(bound, signature[0]))
        except TypeError:
            pass
    if args:
        names.setdefault("input", args[0])
    return names


def _method_function(name: str) -> Any:
    """The torch function whose signature names a Tensor method's arguments: torch.NAME, or for an
    in-place method with no torch function of its own (index_add_, scatter_add_) the out-of-place one."""
    function = getattr(torch, name, None)
    if function is None and name.endswith("_") and not name.endswith("__"):
        function = getattr(torch, name[:-1], None)
    return function


def _flatten_varargs(bound: inspect.BoundArguments, signature: inspect.Signature) -> dict[str, Any]:
    names = dict(bound.arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            names.update(names.pop(parameter.name, {}))
    return names


def _signatures(target: Any) -> tuple[inspect.Signature, ...]:
    try:
        return _cached_signatures(target)
    except TypeError:  # an unhashable callable
        return _find_signatures(target)


@functools.lru_cache(maxsize=1024)
def _cached_signatures(target: Any) -> tuple[inspect.Signature, ...]:
    # a builtin's signature is parsed from its text each time: hundreds of microseconds per node
    return _find_signatures(target)


def _find_signatures(target: Any) -> tuple[inspect.Signature, ...]:
    try:
        return (inspect.signature(target),)
    except (ValueError, TypeError):
        pass
    from torch.fx.operator_schemas import get_signature_for_torch_op

    return tuple(get_signature_for_torch_op(target) or ())


def _formula_names(call: OpCall) -> Mapping[str, Any]:
    return {**call.names, "out": call.out, "within": call.within}
