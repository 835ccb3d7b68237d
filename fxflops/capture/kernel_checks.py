"""Ops a real kernel would refuse: what FakeTensorMode lets through, checked on the captured graph.

Fake and meta kernels compute output shapes and dtypes; most do not repeat the checks the CPU and
CUDA kernels make before they compute. A model that a real run stops with a RuntimeError is then
counted without a word. Three of those checks are made here, on each captured aten node:

- one dtype: matmul, convolution and attention kernels take operands of one dtype (a float32 input
  into a bfloat16 Linear), and norm kernels take parameters of their input's dtype, save the mixed
  precision every backend accepts (a bfloat16 or float16 input with float32 parameters);
- in-place promotion: an in-place op's result must be castable to its destination's dtype, as
  TensorIterator demands (`long_tensor.mul_(0.5)`); the result's dtype is that of the op's functional
  form, taken from its meta kernel on one-element stand-ins (no memory, no computation);
- in-place writes into expanded memory: a destination with stride 0 along a dimension longer than 1
  has elements that share memory, which TensorIterator refuses (`x.expand(2, 4).add_(1)`); a few
  in-place ops accept it (fills, masked and indexed writes), listed below.

Each is one caution per (op, problem), naming the modules and the source line, so a model with 32
such layers says so once. An op the checks cannot read (no values on its inputs) is passed over, and
so is one that ran under torch.autocast (the recorder marks it), which casts its operands first.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from fxflops.capture.branches import where
from fxflops.capture.recorder import AUTOCAST, SOURCE
from fxflops.capture.replay import REPLAY_OF
from fxflops.capture.torch_versions import is_inplace
from fxflops.results import FORWARD, PHASE

aten = torch.ops.aten

# aten packets whose tensor arguments (these, by schema name) must all have one dtype
_ONE_DTYPE = {
    "mm": ("self", "mat2"), "bmm": ("self", "mat2"), "mv": ("self", "vec"), "dot": ("self", "tensor"),
    "vdot": ("self", "other"),
    "addmm": ("self", "mat1", "mat2"), "baddbmm": ("self", "batch1", "batch2"),
    "addbmm": ("self", "batch1", "batch2"), "addmv": ("self", "mat", "vec"), "addr": ("self", "vec1", "vec2"),
    "matmul": ("self", "other"), "linear": ("input", "weight", "bias"), "bilinear": ("input1", "input2", "weight", "bias"),
    "einsum": ("operands",),
    **dict.fromkeys(("convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                     "conv_transpose2d", "conv_transpose3d"), ("input", "weight", "bias")),
    # the index/scatter family reads its source into self's dtype: real kernels refuse another one
    **dict.fromkeys(("index_add", "index_add_", "index_copy", "index_copy_", "masked_scatter", "masked_scatter_"),
                    ("self", "source")),
    **dict.fromkeys(("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_"),
                    ("self", "src")),
    **dict.fromkeys(("scaled_dot_product_attention", "_scaled_dot_product_attention_math",
                     "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_flash_attention_for_cpu"), ("query", "key", "value")),
}
# norm packets: (the input, the parameters that must share its dtype)
_NORMS = {
    **dict.fromkeys(("native_layer_norm", "layer_norm"), ("input", ("weight", "bias"))),
    **dict.fromkeys(("native_group_norm", "group_norm"), ("input", ("weight", "bias"))),
    **dict.fromkeys(("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                     "batch_norm", "_batch_norm_impl_index", "instance_norm"),
                    ("input", ("weight", "bias", "running_mean", "running_var"))),
}
# inputs normalized with float32 parameters (CPU's mixed-type kernels, CUDA's): not refused. (Where a
# backend refuses one, no caution is given: the checks say only what real kernels surely refuse.)
_REDUCED = (torch.float16, torch.bfloat16)

# in-place ops whose kernels write through expanded memory (a deprecation warning at most), by packet
_OVERLAP_ACCEPTED = frozenset({"fill_", "zero_", "masked_fill_", "masked_scatter_", "index_put_", "_index_put_impl_",
                               "index_fill_", "tril_", "triu_", "set_", "resize_", "resize_as_", "detach_",
                               "requires_grad_", "squeeze_", "unsqueeze_", "transpose_", "t_", "as_strided_",
                               "swapaxes_", "swapdims_"})


def rejected_ops(graph_module: torch.fx.GraphModule) -> list[str]:
    """One sentence per (op, problem) a real kernel raises on, with the modules and the first source line."""
    found: dict[tuple[str, str], list[torch.fx.Node]] = {}
    promoted: dict[Any, torch.dtype | None] = {}  # functional dtypes already worked out, by op and operand dtypes
    # each op's packet and argument names when a check applies to it, else None (most ops); read once per op
    # (a schema is rebuilt on every access). Keyed by id: an OpOverload's hash is Python code (~0.2 us, twice
    # for each of a 70B's ~5,000 nodes), and every op keyed is held by its nodes while this runs
    checked: dict[int, tuple[str, tuple[str, ...]] | None] = {}
    # a checked node's problems by name: a replayed copy of it (capture.replay) runs the same op on operands
    # of the same dtypes, shapes and strides, with the same meta (autocast marks), so it has the same ones
    by_name: dict[str, list[str]] = {}
    for node in _aten_nodes(graph_module):
        op = node.target
        plan = checked.get(id(op), _UNPLANNED)
        if plan is _UNPLANNED:
            plan = checked[id(op)] = _plan(op)
        if plan is not None:
            packet = plan[0]
            problems = by_name.get(node.meta.get(REPLAY_OF, ""))
            if problems is None:
                problems = by_name[node.name] = list(_problems(node, *plan, promoted))
            for problem in problems:
                found.setdefault((f"aten.{packet}", problem), []).append(node)
    return [_sentence(op, problem, nodes) for (op, problem), nodes in found.items()]


_UNPLANNED = object()  # (an op not looked at yet: its plan may be None)


def _aten_nodes(graph_module: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    """The forward's aten op nodes: a forward a kernel refuses never reaches its backward (whose ops would
    repeat the forward's problem), nor a recomputation of it."""
    for module in graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
                        and node.meta.get(PHASE, FORWARD) == FORWARD):
                    yield node


def _plan(op: Any) -> tuple[str, tuple[str, ...]] | None:
    schema = op._schema
    packet = schema.name.partition("::")[2]
    if packet in _ONE_DTYPE or packet in _NORMS or is_inplace(op):
        return packet, tuple(argument.name for argument in schema.arguments)
    return None


def _problems(node: torch.fx.Node, packet: str, names: tuple[str, ...], promoted: dict) -> Iterator[str]:
    op = node.target
    bound = _bound(node, names)
    if packet in _ONE_DTYPE or packet in _NORMS:
        if node.meta.get(AUTOCAST) or _autocast_now(bound):
            return  # autocast casts the operands to one dtype (or to float32) before the kernel sees them
    if packet in _ONE_DTYPE:
        yield from _mixed(bound, _ONE_DTYPE[packet])
    elif packet in _NORMS:
        yield from _norm_mixed(bound, *_NORMS[packet])
    if names and is_inplace(op):  # (an in-place op: its first argument is written)
        destination = bound.get(names[0])
        if isinstance(destination, torch.Tensor):
            yield from _inplace(op, packet, node, destination, promoted)


def _autocast_now(bound: dict[str, Any]) -> bool:
    """Whether autocast is on for the operands' device where the graph is checked: a graph another method
    (export) captured under the caller's torch.autocast carries no AUTOCAST mark."""
    device = next((value.device.type for value in bound.values() if isinstance(value, torch.Tensor)), None)
    if device is None or device == "meta":  # (export captures on meta: whichever device the model runs on)
        return torch._C._is_any_autocast_enabled()
    return torch.is_autocast_enabled(device)


def _bound(node: torch.fx.Node, names: tuple[str, ...]) -> dict[str, Any]:
    """The node's arguments by schema name, as values (a node's meta["val"])."""
    values = {name: _value(given) for name, given in zip(names, node.args)}
    for name in names[len(node.args):]:
        if name in node.kwargs:
            values[name] = _value(node.kwargs[name])
    return values


def _value(given: Any) -> Any:
    if isinstance(given, torch.fx.Node):
        return given.meta.get("val")
    if isinstance(given, list | tuple):
        return [_value(item) for item in given]
    return given


def _tensors(bound: dict[str, Any], names: tuple[str, ...]) -> list[tuple[str, torch.Tensor]]:
    found = []
    for name in names:
        value = bound.get(name)
        items = value if isinstance(value, list) else [value]
        found += [(name, item) for item in items if isinstance(item, torch.Tensor)]
    return found


def _mixed(bound: dict[str, Any], names: tuple[str, ...]) -> Iterator[str]:
    tensors = _tensors(bound, names)
    if len({tensor.dtype for _, tensor in tensors}) > 1:
        given = ", ".join(f"{name} {_dtype(tensor.dtype)}" for name, tensor in tensors)
        yield (f"operands of different dtypes ({given}), which real kernels refuse (one dtype for all): cast "
               "the inputs to the weights' dtype, or count under torch.autocast as the model would run")


def _norm_mixed(bound: dict[str, Any], input_name: str, parameters: tuple[str, ...]) -> Iterator[str]:
    source = bound.get(input_name)
    if not isinstance(source, torch.Tensor):
        return
    params = _tensors(bound, parameters)
    kinds = {tensor.dtype for _, tensor in params}
    if not params or kinds == {source.dtype} or (source.dtype in _REDUCED and kinds == {torch.float32}):
        return
    given = ", ".join(f"{name} {_dtype(tensor.dtype)}" for name, tensor in params)
    yield (f"a {_dtype(source.dtype)} input with parameters of another dtype ({given}), which real kernels refuse "
           "(parameters of the input's dtype, or float32 for a float16/bfloat16 input): cast the input or the module")


def _inplace(op: Any, packet: str, node: torch.fx.Node, destination: torch.Tensor, promoted: dict) -> Iterator[str]:
    if packet not in _OVERLAP_ACCEPTED and _expanded(destination):
        yield ("an in-place write into an expanded tensor (elements that share memory, stride 0), which real "
               "kernels refuse: clone() the tensor before writing to it, or use the out-of-place op")
    result = _functional_dtype(op, packet, node, promoted)
    if result is not None and not torch.can_cast(result, destination.dtype):
        yield (f"an in-place result of dtype {_dtype(result)} written into a tensor of dtype {_dtype(destination.dtype)}, "
               "which real kernels refuse (the result cannot be cast to the destination's dtype): use the "
               "out-of-place op, or convert the tensor first")


def _expanded(tensor: torch.Tensor) -> bool:
    """Whether some dimension longer than 1 has stride 0 (TensorIterator's "internal overlap")."""
    for size, stride in zip(tensor.shape, tensor.stride()):
        size, stride = _concrete(size), _concrete(stride)
        if size is not None and stride == 0 and size > 1:
            return True
    return False


def _concrete(size: Any) -> int | None:
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)  # a symbolic size: its example value
    return hint if isinstance(hint, int) else None


def _functional_dtype(op: Any, packet: str, node: torch.fx.Node, promoted: dict) -> torch.dtype | None:
    """The dtype the op's out-of-place form gives for these operands (its meta kernel, run on stand-ins of
    one element per dimension: dtypes and dimensionality decide promotion), or None when unknown."""
    functional = getattr(getattr(aten, packet[:-1], None), op._overloadname, None)
    if functional is None:
        return None
    key = (functional, _signature(node.args), _signature(node.kwargs))
    if key not in promoted:
        args, kwargs = _stand_ins(node.args), _stand_ins(node.kwargs)
        out = None
        if args is not None and kwargs is not None:
            try:
                out = functional(*args, **kwargs)
            except Exception:  # a form the stand-ins do not fit (shapes that matter): not checked
                pass
        promoted[key] = out.dtype if isinstance(out, torch.Tensor) else None
    return promoted[key]


def _stand_ins(given: Any) -> Any:
    """The arguments with each tensor replaced by an empty meta tensor of its dtype and one element per
    dimension; None where an argument has no value to stand in for."""
    if isinstance(given, torch.fx.Node):
        value = given.meta.get("val")
        if isinstance(value, torch.Tensor):
            return torch.empty((1,) * value.ndim, dtype=value.dtype, device="meta")
        return value if isinstance(value, int | float | bool | complex) else None
    if isinstance(given, list | tuple):
        items = [_stand_ins(item) for item in given]
        return None if any(item is None and raw is not None for item, raw in zip(items, given)) else type(given)(items)
    if isinstance(given, dict):
        items = {name: _stand_ins(item) for name, item in given.items()}
        return None if any(items[name] is None and given[name] is not None for name in given) else items
    return given


def _signature(value: Any) -> Any:
    """What decides an op's result dtype: each tensor's dtype and dimensionality, each number's type."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.ndim)
    if isinstance(value, list | tuple):
        return tuple(_signature(item) for item in value)
    if isinstance(value, dict):
        return tuple((name, _signature(item)) for name, item in value.items())
    return value if isinstance(value, str | None) else type(value).__name__  # a number's type decides, not its value


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sentence(op: str, problem: str, nodes: list[torch.fx.Node]) -> str:
    places = list(dict.fromkeys(where(*node.meta["fxflops_module"]) if "fxflops_module" in node.meta else "in the model"
                                for node in nodes))
    shown = "; ".join(places[:3]) + (f"; and {len(places) - 3} more places" if len(places) > 3 else "")
    calls = f" ({len(nodes)} calls)" if len(nodes) > 1 else ""
    line = next((node.meta[SOURCE] for node in nodes if node.meta.get(SOURCE)), None)
    at = f", at {line[0]}:{line[1]}" if isinstance(line, tuple) and len(line) == 2 else ""
    return f"{op} {shown}{calls}{at}: {problem}; a real forward raises here, so the count is of a model that cannot run"
