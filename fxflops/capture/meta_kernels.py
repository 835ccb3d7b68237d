"""Ops shaped past FakeTensorMode's per-op dispatch, where its outcome is known (issue 23).

Before the mode runs an op's rule or meta kernel it hashes the arguments for its cache, checks for
constants, converts stray real tensors and walks its special cases: 0.3-1.7 ms an op on a first
count, where the kernel and the wrap take 0.05-0.2 ms; for some ops it runs a Python decomposition
instead (batch norm: 6-13 ms, 35-55% of a convnet's whole estimate). An op whose arguments are all
plain fake tensors of the capture's mode (static sizes, no constant value, one device, strided) and
plain values takes a shorter route:

- where the mode would run its own rule for the op or the op's meta kernel, the route runs them and
  wraps the outputs with the mode's own function: the mode's last step, its result by construction;
- where the mode decomposes the op, the meta kernel runs only for ops it shapes alike
  (`_SHAPED_ALIKE`: batch and layer norm, their statistics remade as the CPU route gives them;
  addmm, split, embedding);
- a CPU batch norm of a contiguous or channels-last input gets its outputs made directly, and an
  in-place pointwise op on a dense `self` returns it once a call like it has run its kernel's checks;
- metadata queries (prim.device, aten.size/stride/storage_offset) get the mode's first-step answer.

The route keeps a cache as the mode does, made by the mode's own functions (its key of the op and its
arguments' metadata, its checks of what may be cached, its output rebuilt from a cached entry): a call
equal to an earlier one gets its output without running the kernel again. Most meta kernels of pointwise
ops are Python (torch._refs: 0.1-0.5 ms each), and a transformer repeats the same calls layer after
layer: the mode's cache is what makes FakeTensorMode itself fast there. The cache is the route's own
(one per capture), holding only outputs the route made; with the mode's caching off, there is none.

Views keep the mode's Python rule (the C++ kernel strides size-1 axes otherwise). Anything else goes
through the mode: named sizes (C++ meta kernels would pin SymInts to their example values), constants
(the mode computes small ones for real so `.item()` works), the ops it decomposes, and every op while a
torch-function mode is active (it would see the route's Python). tests/test_meta_kernels.py holds the
two routes equal over grids of shapes, layouts, dtypes and devices, and node by node over models.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from fxflops.capture.torch_versions import is_inplace, is_pointwise

aten = torch.ops.aten

# tags under which the mode does more than run the kernel: unbacked sizes, metadata written in place
_MODE_HANDLES = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.inplace_view)


class MetaKernels:
    """One capture's short route: `__call__` runs an op as the mode's dispatch would end, or gives
    NotImplemented where the op must go through the mode."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self._torch = _fake_internals()
        # op -> None (through the mode) or the mode's rules for it, tried in order before its meta kernel
        self._routes: dict[Any, tuple | None] = {}
        self._accepted: set[tuple] = set()  # in-place calls that have run (see _in_place_key)
        self.enabled = self._torch is not None and not getattr(mode, "propagate_real_tensors", False)
        # the mode's cache entries for the calls the route made, by the mode's key (see _cached_end)
        self._cache: dict[Any, Any] = {}
        self._shapes_seen: set[tuple] = set()  # (op, its tensors' shapes) of the calls run (see _cached_end)
        self._caching = self.enabled and getattr(mode, "cache_enabled", False) \
            and not getattr(mode, "cache_crosscheck_enabled", True)

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if not self.enabled or torch._C._is_torch_function_mode_enabled():
            # an op dispatched from C++ inside a function mode (functorch's vmap exit under
            # transformers' mask mode): the route's Python would be seen by the mode, the mode's is not
            return NotImplemented
        answer = self._torch["_DISPATCH_META_HANDLERS"].get(func)
        if answer is not None:  # prim.device and other metadata queries: the mode's first step answers them
            return answer(args)
        if func in self._routes:
            rules = self._routes[func]
        else:
            rules = self._routes[func] = _short_route(func, self.mode, self._torch)
        if rules is None:
            return NotImplemented
        flat = _plain_arguments(self.mode, args, kwargs)
        if flat is None:
            return NotImplemented
        known = self._known_outcome(func, args, kwargs, flat)
        if known is not NotImplemented:
            return known
        if self._caching:
            out = self._cached_end(func, args, kwargs, flat, rules)
        else:
            out = self._dispatch_end(func, args, kwargs, flat, rules)
        key = _in_place_key(func, args, kwargs, flat)
        if key is not None and out is not NotImplemented:
            self._accepted.add(key)
        return out

    def _known_outcome(self, func: Any, args: tuple, kwargs: dict, flat: list[Any]) -> Any:
        """What the mode's dispatch is known to give without running a kernel, or NotImplemented:
        an in-place pointwise op on its only tensor leaves it as it is once a call that differs only
        in sizes has run (its kernel checks the dtype and the scalars, and overlap, which a dense
        tensor has none of); a CPU batch norm of a canonically laid out input (see
        _batch_norm_outputs_on_cpu), whose meta kernel is a Python decomposition of ~1 ms."""
        if func is aten.native_batch_norm.default:
            return _batch_norm_outputs_on_cpu(args, kwargs)
        key = _in_place_key(func, args, kwargs, flat)
        return args[0] if key is not None and key in self._accepted else NotImplemented

    def _cached_end(self, func: Any, args: tuple, kwargs: dict, flat: list[Any], rules: tuple) -> Any:
        """_dispatch_end, or its output for an equal earlier call rebuilt from the cache, as the mode's
        `_cached_dispatch_impl` does: the mode's key (the op, its arguments' metadata and plain values,
        the default dtype and device, inference mode), the mode's checks of which calls and outputs can
        be cached (none with data-dependent or dynamic output shapes, in-place views, constants, ...),
        an in-place op's output as its argument again, a new output as a new fake tensor."""
        shapes = (func, *[tuple(value.shape) for value in flat if isinstance(value, torch.Tensor)])
        if shapes not in self._shapes_seen:
            # a first call of its shapes: many are the only one (a convnet's layers differ in shape), and
            # the mode's key and entry cost as much as the kernel again; the next call of its shapes has them
            self._shapes_seen.add(shapes)
            return self._dispatch_end(func, args, kwargs, flat, rules)
        mode, internals = self.mode, self._torch
        bypass = internals["_BypassDispatchCache"]
        try:
            state = internals["_CacheKeyState"](mode.shape_env)
            key = mode._cache_key(state, func, args, kwargs)
        except bypass:
            return self._dispatch_end(func, args, kwargs, flat, rules)
        entry = self._cache.get(key)
        if entry is _UNCACHED:
            return self._dispatch_end(func, args, kwargs, flat, rules)
        if entry is _THROUGH_MODE:
            return NotImplemented
        if entry is not None:
            return mode._output_from_cache_entry(state, entry, key, func, args)
        out = self._dispatch_end(func, args, kwargs, flat, rules)
        if out is NotImplemented:  # (which rules decline it follows from what the key holds)
            self._cache[key] = _THROUGH_MODE
        else:
            try:
                self._cache[key] = mode._make_cache_entry(state, key, func, args, kwargs, out)
            except bypass:
                self._cache[key] = _UNCACHED
        return out

    def _dispatch_end(self, func: Any, args: tuple, kwargs: dict, flat: list[Any], rules: tuple) -> Any:
        """The mode's dispatch from the point its preamble would hand over: its rules, else the meta kernel."""
        if rules:
            with self._torch["unset_fake_temporarily"]():  # as inside the mode's own dispatch
                for rule in rules:
                    out = rule(self.mode, func, *args, **kwargs)
                    if out is not NotImplemented:
                        return out
            if not self._torch["has_meta"](func):
                return NotImplemented  # the mode runs the device kernel as a fallback
        with self._torch["in_kernel_invocation_manager"](self.mode):
            out = func(*args, **kwargs)
        out = self.mode.wrap_meta_outputs_with_default_device_logic(out, func, flat, device=kwargs.get("device"))
        made_alike = _SHAPED_ALIKE.get(func)
        return made_alike(out, args, kwargs) if made_alike is not None else out


_UNCACHED = object()  # a cache entry: calls with this key run the kernel every time
_THROUGH_MODE = object()  # a cache entry: calls with this key go through the mode


def _fake_internals() -> dict[str, Any] | None:
    """The parts of torch's fake-tensor dispatch the route mirrors, or None where this torch lacks one."""
    try:
        from torch._decomp import decomposition_table, meta_table
        from torch._library.simple_registry import singleton
        from torch._subclasses import fake_tensor
        from torch._subclasses.fake_impls import has_meta, op_implementations_checks
    except ImportError:
        return None
    names = ("in_kernel_invocation_manager", "unset_fake_temporarily", "torch_decomp_decompositions",
             "_DISPATCH_META_HANDLERS", "_DISPATCH_HANDLE_DIRECTLY", "_CacheKeyState", "_BypassDispatchCache")
    methods = ("wrap_meta_outputs_with_default_device_logic", "cpp_meta_supports_symint", "lift_fns", "_cache_key",
               "_make_cache_entry", "_output_from_cache_entry")
    if not all(hasattr(fake_tensor, name) for name in names) or \
            not all(hasattr(fake_tensor.FakeTensorMode, name) for name in methods):
        return None
    dynamo = sys.modules.get("torch._dynamo.config")
    if dynamo is not None and getattr(dynamo, "_custom_ops_profile", None) is not None:
        return None  # the mode shapes ops from recorded profiles first
    found = {name: getattr(fake_tensor, name) for name in names}
    return dict(found, decomposition_table=decomposition_table, meta_table=meta_table, has_meta=has_meta,
                op_implementations_checks=op_implementations_checks, registry=singleton)


def _short_route(func: Any, mode: Any, torch_parts: dict[str, Any]) -> tuple | None:
    """None where the mode must shape `func` itself; else the mode's rules for it, in the mode's order
    (empty: the mode runs its meta kernel), as FakeTensorMode._dispatch_impl decides past its preamble."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace != "aten" or func is aten.to_dense.default:
        return None
    if func in torch_parts["_DISPATCH_META_HANDLERS"] or func in torch_parts["_DISPATCH_HANDLE_DIRECTLY"] \
            or func in mode.lift_fns or any(tag in func.tags for tag in _MODE_HANDLES):
        return None
    if func in _SHAPED_ALIKE:
        return () if torch_parts["has_meta"](func) else None
    if func not in torch_parts["meta_table"] and not mode.cpp_meta_supports_symint(func):
        if func in torch_parts["decomposition_table"] and torch_parts["torch_decomp_decompositions"](func):
            return None  # the mode runs torch's Python decomposition
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            return None  # the mode decomposes it into the ops it is made of
    if torch_parts["registry"].find(func.name()).fake_impl.kernel is not None:
        return None  # a library's fake rule
    rules = tuple(rule for check, rule in torch_parts["op_implementations_checks"] if check(func))
    return rules if rules or torch_parts["has_meta"](func) else None


def _plain_arguments(mode: Any, args: tuple, kwargs: dict) -> list[Any] | None:
    """The flat arguments, or None where one is not a plain static fake tensor of `mode`, a plain value,
    or a flat list of those (the mode alone handles symbolic values, constants and real tensors)."""
    flat: list[Any] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            flat.extend(value)
        else:
            flat.append(value)
    device = None
    for value in flat:
        if isinstance(value, torch.Tensor):
            if (type(value) is not FakeTensor or value.fake_mode is not mode or value.constant is not None
                    or value.layout is not torch.strided or value._has_symbolic_sizes_strides
                    or device is not None and value.device != device):
                return None  # mixed devices too: the mode's rules for them differ by op
            device = value.device
        elif isinstance(value, (list, tuple, dict, torch.SymInt, torch.SymFloat, torch.SymBool)):
            return None
    return flat if device is not None else None


def _in_place_key(func: Any, args: tuple, kwargs: dict, flat: list[Any]) -> tuple | None:
    """For an in-place pointwise op whose only tensor is a dense `self`: what its kernel's checks read
    (op, dtype, device, the other arguments); None for any other call."""
    if not is_inplace(func) or not is_pointwise(func):
        return None
    tensors = [value for value in flat if isinstance(value, torch.Tensor)]
    if len(tensors) != 1 or not args or tensors[0] is not args[0] or not _is_dense(args[0]):
        return None
    others = tuple((type(value), value) for value in flat if value is not args[0])
    return func, args[0].dtype, args[0].device, others, tuple(sorted(kwargs))


def _is_dense(tensor: torch.Tensor) -> bool:
    """Laid out as a contiguous or channels-last tensor of its shape: no element stored twice."""
    return tensor.is_contiguous() or tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last)


def _batch_norm_outputs_on_cpu(args: tuple, kwargs: dict) -> Any:
    """native_batch_norm's outputs on the CPU as the mode's decomposition shapes them, for an input whose
    strides are the contiguous ones of its shape (or the channels-last ones, 4-d): the output keeps
    the input's strides and dtype; the saved statistics are [C] in training, [0] in eval, in the
    input's dtype. Every other case (another device or layout, statistics of another shape, a
    training batch of one value a channel, where the decomposition divides by zero) takes the kernel.
    tests/test_meta_kernels.py holds this against the mode for every layout of sizes 1-3 in 2-5 axes."""
    if kwargs or len(args) != 8:
        return NotImplemented
    source, weight, bias, running_mean, running_var, training = args[:6]
    if source.device.type != "cpu" or source.dim() < 2 or not source.is_floating_point() \
            or source.storage_offset() != 0 or source.numel() == 0 or not isinstance(training, bool):
        return NotImplemented
    channels = source.shape[1]
    if any(t is not None and tuple(t.shape) != (channels,) for t in (weight, bias, running_mean, running_var)):
        return NotImplemented
    if training and source.numel() <= channels or not training and (running_mean is None or running_var is None):
        return NotImplemented
    stride = source.stride()
    if stride != _contiguous_strides(source.shape) and (
            source.dim() != 4 or stride != _contiguous_strides(source.shape, (0, 2, 3, 1))):
        return NotImplemented
    statistics = (channels,) if training else (0,)
    return (_fake_like(source, tuple(source.shape), source.dtype, stride), _fake_like(source, statistics),
            _fake_like(source, statistics))


def _contiguous_strides(shape: Any, order: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The strides of a tensor of `shape` stored axis by axis in `order` (default: as indexed), as
    torch gives them: a size-1 axis gets the stride of the axes stored inside it."""
    order = order or tuple(range(len(shape)))
    strides = [0] * len(shape)
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= max(shape[axis], 1)
    return tuple(strides)


def _batch_norm_statistics_as_decomposed(out: tuple, args: tuple, kwargs: dict) -> tuple:
    """native_batch_norm's meta kernel gives its saved statistics as [C] float32 on every device; on the
    CPU the mode's decomposition (as the CPU kernel) gives them in the input's dtype, empty in eval
    mode. The normalised output is the same either way."""
    output, save_mean, save_invstd = out
    source = args[0]
    if source.device.type != "cpu":
        return out
    training = args[5] if len(args) > 5 else kwargs["training"]
    size = (source.shape[1],) if training else (0,)
    return output, _fake_like(source, size), _fake_like(source, size)


def _fake_like(source: Any, size: tuple[int, ...], dtype: torch.dtype | None = None,
               stride: tuple[int, ...] | None = None) -> Any:
    """A fresh fake tensor on `source`'s mode and device (its dtype unless given; contiguous unless given)."""
    with unset_fake_temporarily():
        meta = torch.empty(size, dtype=dtype or source.dtype, device="meta")
        if stride is not None:
            meta = torch.empty_strided(size, stride, dtype=meta.dtype, device="meta")
    return FakeTensor(source.fake_mode, meta, source.device)


def _layer_norm_statistics_as_referenced(out: tuple, args: tuple, kwargs: dict) -> tuple:
    """native_layer_norm's meta kernel keeps a bfloat16/half input's mean and rstd in float32; the mode's
    rule (torch._refs) does so on CUDA but gives them in the input's dtype on the CPU, as they are made
    here. Their shapes and strides agree."""
    output, mean, rstd = out
    source = args[0]
    if source.device.type != "cpu" or mean.dtype == source.dtype:
        return out
    return (output, _fake_like(source, tuple(mean.shape), source.dtype, mean.stride()),
            _fake_like(source, tuple(rstd.shape), source.dtype, rstd.stride()))


def _as_they_are(out: Any, args: tuple, kwargs: dict) -> Any:
    return out


# ops the mode shapes by a decomposition or a rule of its own whose meta kernel shapes them alike, each
# with what makes its outputs agree (tests/test_meta_kernels.py holds each over a grid)
_SHAPED_ALIKE = {
    aten.native_batch_norm.default: _batch_norm_statistics_as_decomposed,
    aten.native_layer_norm.default: _layer_norm_statistics_as_referenced,
    aten.addmm.default: _as_they_are,
    aten.split.Tensor: _as_they_are,
    aten.embedding.default: _as_they_are,
}
