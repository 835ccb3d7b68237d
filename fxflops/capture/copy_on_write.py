"""Save a real tensor's data just before an op first writes into it, and put it back afterwards."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxflops.capture.tensor_walk import tensors_in


class CopyOnWrite:
    """Saves a protected tensor's data just before an op first writes into it (or a view of it).

    Ops are known to write by their schema. Some schemas do not say so (native_batch_norm updates its
    running statistics in place): `saved_now` tensors, the small buffers, are saved up front.
    """

    def __init__(self, tensors: list[torch.Tensor], saved_now: list[torch.Tensor]) -> None:
        self._owners = {_storage_key(t): t for t in tensors}
        self._saved = {_storage_key(t): (t, t.detach().clone()) for t in saved_now}
        self._mutable: dict[Any, bool] = {}
        self._versions = [(t, t._version) for t in tensors]

    def before(self, func: Any, args: tuple, kwargs: dict) -> None:
        mutable = self._mutable.get(func)
        if mutable is None:
            mutable = self._mutable[func] = bool(getattr(func, "_schema", None) and func._schema.is_mutable)
        if mutable:
            for tensor in tensors_in((args, kwargs)):
                key = _storage_key(tensor)
                owner = self._owners.get(key)
                if owner is not None and key not in self._saved:
                    self._saved[key] = (owner, owner.detach().clone())

    def restore(self) -> None:
        with torch.no_grad():
            for owner, saved in self._saved.values():
                owner.copy_(saved)

    def watching(self) -> TorchDispatchMode:
        """A dispatch mode that saves what the ops run under it are about to write."""
        return _WriteWatch(self)

    def unsaved_writes(self) -> list[torch.Tensor]:
        """Protected tensors written in place that were not saved first (written outside `watching`)."""
        saved = {id(owner) for owner, _ in self._saved.values()}
        return [t for t, version in self._versions if t._version != version and id(t) not in saved]


class _WriteWatch(TorchDispatchMode):
    def __init__(self, writes: CopyOnWrite) -> None:
        super().__init__()
        self._writes = writes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self._writes.before(func, args, kwargs)
        return func(*args, **kwargs)


def _storage_key(tensor: torch.Tensor) -> Any:
    try:
        return tensor.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):  # sparse, nested: no one storage (and no views into it)
        return ("tensor", id(tensor))
