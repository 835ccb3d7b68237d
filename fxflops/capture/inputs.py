"""Example inputs: made from shapes, keyed by their shapes and dtypes, tagged in the captured graph.

Also what the capture reports of them (shapes, the floating dtype, whether they can really run) and
the values of a graph handed in already captured.
"""

from __future__ import annotations

import itertools
import math
import types
from typing import Any

import torch
from torch.nn.parameter import UninitializedTensorMixin
from torch.utils import _pytree as pytree
from torch.utils._pytree import tree_map

from fxflops.capture.tensor_walk import iter_tensors, tensors_in


def inputs_from_shape(model: torch.nn.Module, input_shape: Any) -> tuple[torch.Tensor, ...]:
    """Meta tensors for DeepSpeed's `input_shape=` convenience: one shape, or a list of shapes.

    In a list, a real tensor may stand in place of a shape: it is that input, values and all, for the
    few small inputs whose values the forward reads (a mask, lengths, ids; see capture.input_values)."""
    if not isinstance(input_shape, tuple | list | torch.Size) or not input_shape:
        raise ValueError(f"input_shape must be a tuple of ints such as (1, 3, 224, 224), or a list of them "
                         f"(one per input), got {input_shape!r}")
    shapes = [input_shape] if isinstance(input_shape[0], int) else list(input_shape)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    if any(isinstance(shape, torch.Tensor) for shape in shapes):
        return tuple(shape if isinstance(shape, torch.Tensor) else inputs_from_shape(model, [shape])[0]
                     for shape in shapes)
    for shape in shapes:
        if not isinstance(shape, tuple | list | torch.Size) or not all(
                isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape):
            raise ValueError(f"input_shape must be a tuple of non-negative ints (or a list of them), got {shape!r}")
    return tuple(_meta_tensor(tuple(shape), dtype) for shape in shapes)


def _meta_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    try:
        return torch.empty(shape, dtype=dtype, device="meta")
    except RuntimeError:  # "Storage size calculation overflowed": torch sizes its storage even on meta
        raise ValueError(f"input_shape {shape} is too large for a tensor, even a fake one: "
                         f"{math.prod(shape):.3g} elements of {dtype} exceed torch's 2**63 - 1 bytes") from None


def refuse_lazy_output(output: Any) -> Any:
    """The forward's output, unless it is a generator: its ops run only as it is iterated, after the
    forward returns, so there would be nothing to count (and an empty count is not an answer)."""
    if isinstance(output, types.GeneratorType | types.AsyncGeneratorType):
        raise TypeError("the forward returned a generator, whose ops run only as it is iterated: there is "
                        "nothing to count. Return a list or tuple, or wrap the model in a module whose "
                        "forward returns list(model(...))")
    return output


# node.meta key of a captured graph's placeholder that is a model input: its index in tensors_in(inputs)
INPUT_INDEX = "fxflops_input"


def mark_inputs(graph_module: torch.fx.GraphModule, inputs: Any) -> None:
    """Tag the placeholders holding `inputs`' tensors (by identity) with INPUT_INDEX, so a later
    stage can replay what the graph derived from an input on the real one (the meter's data masks)."""
    index: dict[int, int] = {}
    for position, tensor in enumerate(tensors_in(inputs)):
        index.setdefault(id(tensor), position)
    for node in graph_module.graph.find_nodes(op="placeholder"):
        position = index.get(id(node.meta.get("val")))
        if position is not None:
            node.meta[INPUT_INDEX] = position


def signature(value: Any) -> tuple:
    """A hashable key for the input shapes of a call: equal keys give equal estimates.

    Tensors contribute shape, dtype and device type; opaque objects such as a KV cache the shapes
    of the tensors inside them; plain scalars (`use_cache=True`, `logits_to_keep=1`) their value.
    """
    leaves, spec = pytree.tree_flatten(value)
    return str(spec), tuple(_leaf_signature(leaf) for leaf in leaves)


def _leaf_signature(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return tuple(leaf.shape), leaf.dtype, leaf.device.type
    if leaf is None or isinstance(leaf, bool | int | float | str | torch.dtype | torch.device):
        return leaf
    return type(leaf).__qualname__, tuple((tuple(t.shape), t.dtype) for t in tensors_in(leaf))


def is_plain(value: Any) -> bool:
    """Whether a value is tensors and builtin containers of them (what torch.export takes as input)."""
    if value is None or isinstance(value, torch.Tensor | int | float | bool | str | torch.dtype | torch.device):
        return True
    if isinstance(value, list | tuple):
        return all(is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and is_plain(item) for key, item in value.items())
    return False


def shapes_of(value: Any) -> Any:
    """The value with every tensor replaced by its shape (for reports)."""
    return tree_map(lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else v, value)


def floating_dtype(model: torch.nn.Module, args: Any = (), kwargs: Any = None) -> str:
    """The model's floating dtype: its first floating parameter or buffer's, else its inputs', else torch's default."""
    for tensor in itertools.chain(model.parameters(), model.buffers(), iter_tensors((args, kwargs or {}))):
        if not isinstance(tensor, UninitializedTensorMixin) and tensor.is_floating_point():
            return str(tensor.dtype).removeprefix("torch.")
    return str(torch.get_default_dtype()).removeprefix("torch.")


def nothing_to_run(model: torch.nn.Module, args: Any = (), kwargs: Any = None) -> str | None:
    """Why the model cannot really run (its weights or its inputs are meta tensors), or None if it can."""
    weights = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    inputs = any(t.is_meta for t in tensors_in((args, kwargs or {})))
    if weights and inputs:
        return "its weights and inputs are on the meta device (or the inputs given as shapes)"
    if weights:
        return "its weights are on the meta device"
    if inputs:
        return "its inputs are given as shapes (input_shape=) or meta tensors, which hold no values"
    return None


def values_from_tensor_meta(graph_module: torch.fx.GraphModule) -> list[str]:
    """Give every node that has only ShapeProp's `tensor_meta` a `meta["val"]` (a meta tensor of that
    shape, dtype and stride), which is what the count stage reads; return the op nodes left without
    any value (a graph whose shapes were never propagated)."""
    missing = []
    for node in graph_module.graph.nodes:
        if "val" in node.meta:
            continue
        if "tensor_meta" in node.meta:
            node.meta["val"] = _meta_value(node.meta["tensor_meta"])
        elif node.op in ("call_function", "call_method", "call_module"):
            missing.append(node.name)
    return missing


def _meta_value(tensor_meta: Any) -> Any:
    # TensorMetadata is a namedtuple with .shape; a multi-output node holds a tuple of them
    if hasattr(tensor_meta, "shape") and hasattr(tensor_meta, "dtype"):
        return torch.empty_strided(tuple(tensor_meta.shape), tuple(tensor_meta.stride), dtype=tensor_meta.dtype,
                                   device="meta")
    if isinstance(tensor_meta, list | tuple):
        return type(tensor_meta)(_meta_value(item) for item in tensor_meta)
    if isinstance(tensor_meta, dict):
        return {key: _meta_value(item) for key, item in tensor_meta.items()}
    return tensor_meta
