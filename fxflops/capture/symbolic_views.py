"""A repeated view op under named sizes, its output rebuilt from the mode's own cache entry at a tenth of the cost.

Under named sizes every op goes through FakeTensorMode, whose cache serves a call equal to an earlier
one (a decoder's layers repeat the same calls) from the entry the first call left. For a view op the
mode rebuilds the output as a fresh tensor of the cached sizes and strides (`empty_strided`, which
works out a storage size for it in symbolic arithmetic) and then points it at the input's storage
(`set_`, which works it out again, with the bounds check): ~90 symbolic operations through Python,
~1 ms a view, a third of a Llama layer's capture. The same tensor is the input viewed at those sizes,
strides and offset: `as_strided` on the meta kernel, which sets them without that arithmetic.

`SymbolicViews` does exactly that for a call the mode would answer from its cache: the mode's key for
the call and the mode's cache (the shape env's, as the mode picks it), an entry the mode made for it,
sizes, strides and offset as the mode reads them from the entry, the output wrapped as the mode wraps
it. Only a plain view is taken: one tensor out, of its input's dtype and layout, no conjugate or
negative bit, not requiring grad; anything else (a first call, an entry the mode refuses to cache, an
in-place view, a tuple of views) goes through the mode as before. tests/test_symbolic_views.py holds
the outputs equal to the mode's, and sweeps equal to fresh estimates node by node.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor


class SymbolicViews:
    """One symbolic capture's short route for repeated view ops: `__call__` gives the view the mode would
    rebuild from its cache, or NotImplemented where the op must go through the mode."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self._parts = _cache_internals() if mode.shape_env is not None and mode.cache_enabled \
            and not mode.cache_crosscheck_enabled else None
        self._views: dict[Any, bool] = {}  # op -> whether it is a plain aten view (decided once per op)

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self._parts is None or not self._is_view(func) or torch._C._is_torch_function_mode_enabled():
            return NotImplemented
        mode, parts = self.mode, self._parts
        try:
            state = parts["_CacheKeyState"](mode.shape_env)
            key = mode._cache_key(state, func, args, kwargs)
        except parts["_BypassDispatchCache"]:
            return NotImplemented
        cache = mode.shape_env.fake_tensor_cache if state.cache_on_shape_env() else type(mode).cache
        entry = cache.get(key)
        if not isinstance(entry, parts["_DispatchCacheValidEntry"]) or entry.is_output_tuple:
            return NotImplemented  # a first call, or one the mode does not cache: the mode runs it
        info = entry.output_infos[0]
        metadata, index = info.metadata, info.view_idx
        if metadata is None or index is None or info.inplace_idx is not None:
            return NotImplemented
        source = args[index] if index < len(args) else None
        if type(source) is not FakeTensor or source.fake_mode is not mode or metadata.dtype != source.dtype \
                or metadata.layout != torch.strided or source.layout != torch.strided or metadata.is_conj \
                or metadata.is_neg or metadata.is_quantized or metadata.requires_grad or source.requires_grad or source.is_conj() \
                or source.is_neg():
            return NotImplemented
        shape = tuple(_value(size, key, state) for size in metadata.shape)
        stride = tuple(_value(step, key, state) for step in metadata.stride)
        offset = _value(metadata.storage_offset, key, state)
        # the mode's own rebuild runs under its kernel mode, with no guard added for what it reads of
        # sizes it has already checked; below autograd's view tracking, its output is no autograd view
        # of the input (as the mode's is not: a tensor set to the input's storage)
        with parts["in_kernel_invocation_manager"](mode), mode.shape_env.suppress_guards(), \
                torch._C._AutoDispatchBelowADInplaceOrView():
            view = torch.ops.aten.as_strided.default(source, shape, stride, offset)
        return FakeTensor(mode, view, metadata.device)

    def _is_view(self, func: Any) -> bool:
        found = self._views.get(func)
        if found is None:
            found = self._views[func] = isinstance(func, torch._ops.OpOverload) and func.namespace == "aten" \
                and func.is_view and torch.Tag.inplace_view not in func.tags
        return found


def _value(value: Any, key: Any, state: Any) -> Any:
    """A size, stride or offset of a cached output, as the mode reads it from the entry."""
    extract = getattr(value, "extract", None)
    return extract(key, state.shape_env) if extract is not None else value


def _cache_internals() -> dict[str, Any] | None:
    """The parts of torch's fake-tensor cache the route reads, or None where this torch lacks one."""
    try:
        from torch._subclasses import fake_tensor
    except ImportError:
        return None
    names = ("_CacheKeyState", "_BypassDispatchCache", "_DispatchCacheValidEntry", "in_kernel_invocation_manager")
    if not all(hasattr(fake_tensor, name) for name in names) or not hasattr(fake_tensor.FakeTensorMode, "_cache_key"):
        return None
    return {name: getattr(fake_tensor, name) for name in names}
