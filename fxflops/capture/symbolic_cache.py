"""A repeated op under named sizes, its output rebuilt from the fake mode's own cache entry at a third of the cost.

Under named sizes every op goes through FakeTensorMode, whose cache serves a call equal to an earlier
one (a decoder's layers repeat the same calls) from the entry the first call left. The mode rebuilds
each output tensor with `empty_strided` of the cached sizes and strides, which works out the storage
size in symbolic arithmetic (each step a Python call into sympy), and for a view points it at the
input's storage with `set_`, which works it out again for the bounds check: ~30 symbolic operations
a new tensor, ~90 a view, 0.5-1.5 ms, most of a Llama layer's capture.

`CacheHits` rebuilds the same tensors from the same entry without that arithmetic: a view as the
input's `as_strided` at the cached sizes, strides and offset (the meta kernel sets them as given); a
new tensor as a flat one of the storage size the entry holds (the first call's, already worked out),
strided as cached. What it reads is what the mode reads: the mode's key for the call, the mode's cache
(the shape env's, as the mode picks it), the entry the mode made, its sizes read as the mode reads
them, the output wrapped as the mode wraps it, under the mode's kernel context with guards
suppressed as in the mode's rebuild. Only plain tensors are taken (strided, of the entry's dtype, no
conjugate or negative bit, not quantized, not requiring grad; an in-place op's output is its argument
again, as in the mode); anything else, and any call without an entry (a first call, one the mode
does not cache), goes through the mode as before. tests/test_symbolic_cache.py holds the outputs
equal to the mode's, and sweeps equal to fresh estimates node by node.

An entry is made only for a call met before. The mode makes one at every miss, and making it rebuilds the
output from it once more to check it (`empty_strided` and `set_` in symbolic arithmetic again): most calls
of a capture with replay are met once (the reference block's), so the entries cost a third of its capture
and served a few calls. A call whose key the capture has not met (`FIRST_SIGHT`) runs through the mode with
its cache off for that call: the mode's own dispatch, the output it computes as on any miss, no entry. The
second equal call is a miss that makes the entry, the third on take the route. Nothing else changes: a hit
gives the tensor a miss computes, and a miss is what the mode does without an entry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

_REFUSED = object()  # an output the route does not rebuild: the call goes through the mode
FIRST_SIGHT = object()  # a call not met before in this capture: the mode runs it with its cache off (`uncached`)


class CacheHits:
    """One symbolic capture's short route for calls the mode has cached: `__call__` gives the outputs the
    mode would rebuild from its entry, or NotImplemented where the call must go through the mode."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self._parts = _cache_internals() if mode.shape_env is not None and mode.cache_enabled \
            and not mode.cache_crosscheck_enabled else None
        self._taken: dict[Any, bool] = {}  # op -> whether the route may take its calls (decided once per op)
        self._met: set[Any] = set()  # the keys of the calls met so far without an entry

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The outputs from the mode's entry; FIRST_SIGHT for a call whose key was not met before (run it
        through the mode under `uncached()`); NotImplemented where the mode runs it as it would."""
        if self._parts is None or not self._takes(func) or torch._C._is_torch_function_mode_enabled():
            return NotImplemented
        mode, parts = self.mode, self._parts
        try:
            state = parts["_CacheKeyState"](mode.shape_env)
            key = mode._cache_key(state, func, args, kwargs)
        except parts["_BypassDispatchCache"]:
            return NotImplemented
        cache = mode.shape_env.fake_tensor_cache if state.cache_on_shape_env() else type(mode).cache
        entry = cache.get(key)
        if entry is None:
            if key not in self._met:
                self._met.add(key)
                return FIRST_SIGHT
            return NotImplemented  # met before: the mode runs it and makes its entry
        if not isinstance(entry, parts["_DispatchCacheValidEntry"]):
            return NotImplemented  # one the mode does not cache: the mode runs it
        outputs = [self._output(info, key, state, func, args) for info in entry.output_infos]
        if any(output is _REFUSED for output in outputs):
            return NotImplemented
        return tuple(outputs) if entry.is_output_tuple else outputs[0]

    @contextlib.contextmanager
    def uncached(self) -> Iterator[None]:
        """The mode with its cache off while a call met for the first time runs (its own flag, restored)."""
        mode = self.mode
        before = mode.cache_enabled
        mode.cache_enabled = False
        try:
            yield
        finally:
            mode.cache_enabled = before

    def _output(self, info: Any, key: Any, state: Any, func: Any, args: tuple) -> Any:
        """One output as the mode's `_get_output_tensor_from_cache_entry` makes it, or _REFUSED."""
        if info.inplace_idx is not None:
            return args[info.inplace_idx]  # the argument an in-place op returns
        metadata = info.metadata
        if metadata is None:
            return info.constant_value if info.constant_value is None else _REFUSED
        if metadata.layout != torch.strided or metadata.is_conj or metadata.is_neg or metadata.is_quantized \
                or metadata.requires_grad:
            return _REFUSED
        shape = tuple(_value(size, key, state) for size in metadata.shape)
        stride = tuple(_value(step, key, state) for step in metadata.stride)
        offset = _value(metadata.storage_offset, key, state)
        mode = self.mode
        if info.view_idx is not None:  # a view: the input's storage, at the cached sizes, strides and offset
            source = args[info.view_idx]
            if type(source) is not FakeTensor or source.fake_mode is not mode or source.dtype != metadata.dtype \
                    or source.layout != torch.strided or source.is_conj() or source.is_neg() or source.requires_grad:
                return _REFUSED
        else:  # a new tensor: a storage of the cached size
            if metadata.storage_bytes is None:
                return _REFUSED
            elements = _elements(_value(metadata.storage_bytes, key, state), metadata.dtype.itemsize)
            if elements is None:
                return _REFUSED
        # the mode's own rebuild runs under its kernel context, with no guard added for what it reads of
        # sizes it has already checked; below autograd's view tracking, a view is no autograd view of
        # its input (the mode's is not either: a tensor set to the input's storage)
        with self._parts["in_kernel_invocation_manager"](mode), mode.shape_env.suppress_guards(), \
                torch._C._AutoDispatchBelowADInplaceOrView():
            if info.view_idx is None:
                source = torch.empty((elements,), dtype=metadata.dtype, device="meta")
            made = torch.ops.aten.as_strided.default(source, shape, stride, offset)
        return FakeTensor(mode, made, metadata.device)

    def _takes(self, func: Any) -> bool:
        found = self._taken.get(func)
        if found is None:
            found = self._taken[func] = isinstance(func, torch._ops.OpOverload) and func.namespace == "aten" \
                and torch.Tag.inplace_view not in func.tags
        return found


def _elements(nbytes: Any, itemsize: int) -> Any:
    """A storage of `nbytes` as elements of `itemsize` bytes, where it is known to divide (else None): the
    expression divided as sympy divides it (no symbolic operation through torch's Python wrapper)."""
    if type(nbytes) is int:
        return nbytes // itemsize if nbytes % itemsize == 0 else None
    node = nbytes.node
    elements = node.expr / itemsize
    if elements.is_integer is not True or node.hint is None:  # (a multiple of the item size divides)
        return None
    return node.shape_env.create_symintnode(elements, hint=node.hint // itemsize)


def _value(value: Any, key: Any, state: Any) -> Any:
    """A size, stride, offset or storage size of a cached output, as the mode reads it from the entry."""
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
