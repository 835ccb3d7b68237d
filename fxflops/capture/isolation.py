"""Leave the user's model and torch exactly as they were, whatever the captured forward does.

A capture runs the model's own forward (on fake twins of its tensors, or for real). That forward
may set attributes, register hooks or submodules, materialize lazy modules (which changes their
class), write into its weights or draw random numbers. Rather than copying the model, we snapshot
what such a forward can change, swap the tensors for twins in place, and restore everything after,
also when the forward raises.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, UninitializedTensorMixin
from torch.utils._python_dispatch import TorchDispatchMode

from fxflops.capture.inputs import tensors_in

Twin = Callable[[torch.Tensor], torch.Tensor]


def walk_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str | None]]:
    """(qualified name, module, first name if this is a second registration) in pre-order.

    Iterative, so a model nested thousands deep does not exhaust Python's recursion limit; a module
    registered twice is yielded again under its second name but not descended into.
    """
    first: dict[int, str] = {}
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    while stack:
        name, module = stack.pop()
        seen_as = first.get(id(module))
        yield name, module, seen_as
        if seen_as is not None:
            continue
        first[id(module)] = name
        children = [(f"{name}.{key}" if name else key, child) for key, child in module._modules.items()
                    if child is not None]
        stack.extend(reversed(children))


def unique_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(name, module) for name, module, alias_of in walk_modules(model) if alias_of is None]


# --- what one module's forward can change ---------------------------------------------------------


class _ModuleSnapshot:
    """A module's class, its __dict__ entries, and the contents of the containers stored there
    (parameters, buffers, submodules, hook dicts, plain list/dict/set attributes)."""

    __slots__ = ("module", "cls", "attrs", "contents")

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.cls = module.__class__
        self.attrs = dict(module.__dict__)
        self.contents = [(value, _contents(value)) for value in self.attrs.values() if _contents(value) is not None]

    def restore(self) -> None:
        module = self.module
        if module.__class__ is not self.cls:
            module.__class__ = self.cls
        for container, contents in self.contents:
            _refill(container, contents)
        state = module.__dict__
        for key in [key for key in state if key not in self.attrs]:
            del state[key]
        for key, value in self.attrs.items():
            if state.get(key, _MISSING) is not value:
                state[key] = value


_MISSING = object()


def _contents(value: Any) -> Any:
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, list):
        return list(value)
    if isinstance(value, set):
        return set(value)
    return None


def _refill(container: Any, contents: Any) -> None:
    """Put a container's saved contents back in place (compared by identity: values may be tensors)."""
    if isinstance(container, dict):
        current = list(container.items())
        if not _same_items(current, contents):
            container.clear()
            container.update(contents)
    elif isinstance(container, list):
        if not _same_items(container, contents):
            container[:] = contents
    elif {id(item) for item in container} != {id(item) for item in contents}:
        container.clear()
        container.update(contents)


def _same_items(current: list, saved: list) -> bool:
    return len(current) == len(saved) and all(_same(a, b) for a, b in zip(current, saved))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):  # dict items: (key, value)
        return len(a) == len(b) and all(x is y or (type(x) is str and x == y) for x, y in zip(a, b))
    return a is b


# --- torch's and Python's global state ------------------------------------------------------------


def _global_hook_tables() -> list[dict]:
    """torch.nn's global module hook tables (forward, backward, registration; with their side tables)."""
    module = torch.nn.modules.module
    return [value for name, value in vars(module).items() if name.startswith("_global_") and isinstance(value, dict)]


class _GlobalSnapshot:
    """Global hook tables, nn.Module's class attributes, the random number generators and the recursion limit."""

    def __init__(self, needed_depth: int) -> None:
        self.tables = [(table, dict(table)) for table in _global_hook_tables()]
        # torch.compile (a compiled submodule, torch.cond's eager path) installs its generation tagging
        # as nn.Module.__init__ / __setstate__ the first time it runs: the capture must not leave it there
        self.module_class = dict(vars(torch.nn.Module))
        self.torch_rng = torch.random.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.python_rng = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy_rng = numpy.random.get_state() if numpy is not None else None
        self.recursion_limit = sys.getrecursionlimit()
        # each nested module call takes a handful of Python frames: let deep models run
        sys.setrecursionlimit(max(self.recursion_limit, self.recursion_limit + 8 * needed_depth))

    def restore(self) -> None:
        for table, contents in self.tables:
            _refill(table, list(contents.items()))
        _restore_class(torch.nn.Module, self.module_class)
        torch.random.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.python_rng)
        if self.numpy_rng is not None:
            sys.modules["numpy"].random.set_state(self.numpy_rng)
        sys.setrecursionlimit(self.recursion_limit)


def _restore_class(cls: type, saved: dict[str, Any]) -> None:
    """Put a class's attributes back as `saved` holds them (added ones removed, replaced ones restored)."""
    current = vars(cls)
    for key in [key for key in current if key not in saved]:
        delattr(cls, key)
    for key, value in saved.items():
        if current.get(key, _MISSING) is not value:
            setattr(cls, key, value)


@contextlib.contextmanager
def isolated(model: torch.nn.Module) -> Iterator[list[tuple[str, torch.nn.Module]]]:
    """Run the body, then put the model, torch's global hook tables and the RNGs back as they were.

    Yields the model's modules (qualified name, module), each once, in pre-order.
    """
    modules = unique_modules(model)
    depth = max((name.count(".") + 1 for name, _ in modules if name), default=0)
    snapshots = [_ModuleSnapshot(module) for _, module in modules]
    global_state = _GlobalSnapshot(depth)
    try:
        yield modules
    finally:
        for snapshot in reversed(snapshots):
            snapshot.restore()
        global_state.restore()


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


def swap_tensors(modules: list[tuple[str, torch.nn.Module]], twin: Twin) -> None:
    """Replace every parameter, buffer and tensor attribute of the modules by its twin, in place.

    Call inside `isolated()`, which puts the originals back. A tensor reachable under several names
    (tied weights) gets one twin, so it stays shared. A lazy module's uninitialized parameter gets a
    stand-in that, when the module materializes it, puts a twin of the materialized shape in its place.
    """
    twins: dict[int, torch.Tensor] = {}

    def twin_of(tensor: torch.Tensor) -> torch.Tensor:
        found = twins.get(id(tensor))
        if found is None:
            found = twins[id(tensor)] = twin(tensor)
        return found

    for _, module in modules:
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if isinstance(tensor, UninitializedTensorMixin):
                    table[key] = _lazy_stand_in(tensor, table, key, twin)
                elif tensor is not None:
                    table[key] = twin_of(tensor)
        state = module.__dict__
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, UninitializedTensorMixin):
                state[key] = twin_of(value)


class _LazyParameter(UninitializedParameter):
    def materialize(self, shape: Any, device: Any = None, dtype: Any = None) -> None:
        _materialize_twin(self, shape, dtype)


class _LazyBuffer(UninitializedBuffer):
    def materialize(self, shape: Any, device: Any = None, dtype: Any = None) -> None:
        _materialize_twin(self, shape, dtype)


def _lazy_stand_in(tensor: torch.Tensor, table: dict, key: str, twin: Twin) -> torch.Tensor:
    if isinstance(tensor, torch.nn.Parameter):
        stand_in: torch.Tensor = _LazyParameter(requires_grad=tensor.requires_grad, device="meta", dtype=tensor.dtype)
    else:
        stand_in = _LazyBuffer(requires_grad=tensor.requires_grad, device="meta", dtype=tensor.dtype)
    stand_in.fxflops_slot = (table, key, twin)
    return stand_in


def _materialize_twin(stand_in: torch.Tensor, shape: Any, dtype: Any) -> None:
    table, key, twin = stand_in.fxflops_slot
    with unset_fake_temporarily():  # materialized while a fake forward runs: a plain meta tensor first
        meta = torch.empty(shape, dtype=dtype or stand_in.dtype, device="meta")
        if isinstance(stand_in, torch.nn.Parameter):
            meta = torch.nn.Parameter(meta, requires_grad=stand_in.requires_grad)
    table[key] = twin(meta)
