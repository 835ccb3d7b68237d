"""Leave the user's model and torch exactly as they were, whatever the captured forward does.

A capture runs the model's own forward (on fake twins of its tensors, or for real). That forward
may set attributes, register hooks or submodules, materialize lazy modules (which changes their
class), write into its weights or draw random numbers. Rather than copying the model, we snapshot
what such a forward can change, swap the tensors for twins in place, and restore everything after,
also when the forward raises.
"""

from __future__ import annotations

import contextlib
import operator
import random
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, UninitializedTensorMixin
from torch.utils._python_dispatch import TorchDispatchMode

from fxflops.capture.inputs import Reach, own_attribute, slot_names, tensors_in

Twin = Callable[[torch.Tensor], torch.Tensor]


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module a torch.compile'd model wraps (its `_orig_mod`), or the model itself.

    Calling the compiled model would run dynamo (which compiles, and installs its hooks into torch);
    its original module runs the same forward eagerly, which is what a capture records."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing can have been compiled
    while dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        model = model._orig_mod
    return model


def walk_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str | None]]:
    """(qualified name, module, first name if this is a second registration) in pre-order.

    Iterative, so a model nested thousands deep does not exhaust Python's recursion limit; a module
    registered twice is yielded again under its second name but not descended into. A torch.compile'd
    submodule is its original module under its own name (no `._orig_mod` level: the wrapper runs it).
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
        children = [(f"{name}.{key}" if name else key, uncompiled(child)) for key, child in module._modules.items()
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
        self.contents = [_Saved(value, f"attribute {key!r} of {type(module).__name__}")
                         for key, value in self.attrs.items() if isinstance(value, list | dict | set)]

    def restore(self) -> list[str]:
        """Put the module back; return what could not be put back (changes to very large containers)."""
        module = self.module
        if module.__class__ is not self.cls:
            module.__class__ = self.cls
        lost = [message for saved in self.contents if (message := saved.restore()) is not None]
        state = module.__dict__
        for key in [key for key in state if key not in self.attrs]:
            del state[key]
        for key, value in self.attrs.items():
            if state.get(key, _MISSING) is not value:
                state[key] = value
        return lost


_MISSING = object()

# a container of up to this many items is saved whole, by reference; a larger one only by its size and
# a sample of its items (copying a list of 10^8 items costs seconds and gigabytes)
SAVED_WHOLE = 1 << 16
_SAMPLE = 32


class _Saved:
    """One list's, dict's or set's own contents, to be put back in place (never copied deeper).

    A container of more than SAVED_WHOLE items keeps its size and a sample of its items instead: items
    appended to a list and keys added to a dict are taken out again exactly; another change seen in the
    sample is reported, as it cannot be undone.
    """

    __slots__ = ("container", "label", "size", "whole", "sample")

    def __init__(self, container: Any, label: str) -> None:
        self.container = container
        self.label = label
        self.size = len(container)
        self.whole = _contents(container) if self.size <= SAVED_WHOLE else None
        self.sample = None if self.whole is not None else _sample(container, self.size)

    def restore(self) -> str | None:
        """Put the contents back; a message if a change to a container saved by a sample cannot be undone."""
        if self.whole is not None:
            _refill(self.container, self.whole)
            return None
        if _undo_growth(self.container, self.size, self.sample):
            return None
        return (f"the forward changed {self.label} in place (a {type(self.container).__name__} of {self.size:,} "
                f"items), which fxflops could not undo: containers over {SAVED_WHOLE:,} items are not copied, "
                "so only items appended to a list or keys added to a dict are taken out again")


def _contents(value: Any) -> Any:
    if isinstance(value, dict):
        return list(_dict_class(value).items(value))
    if isinstance(value, list):
        return list.copy(value)
    return set.copy(value)


def _refill(container: Any, contents: Any) -> None:
    """Put a container's saved contents back in place (compared by identity: values may be tensors)."""
    if isinstance(container, dict):
        kind = _dict_class(container)
        if not _same_items(list(kind.items(container)), contents):
            kind.clear(container)
            for key, value in contents:
                kind.__setitem__(container, key, value)
    elif isinstance(container, list):
        if len(container) != len(contents) or not all(map(operator.is_, container, contents)):
            list.__setitem__(container, slice(None), contents)
    elif {id(item) for item in container} != {id(item) for item in contents}:
        set.clear(container)
        set.update(container, contents)


def _dict_class(value: dict) -> type:
    # an OrderedDict keeps its order beside the dict: its own methods, never a subclass's overrides
    return OrderedDict if isinstance(value, OrderedDict) else dict


def _same_items(current: list, saved: list) -> bool:
    return len(current) == len(saved) and all(_same(a, b) for a, b in zip(current, saved))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):  # dict items: (key, value)
        return len(a) == len(b) and all(x is y or (type(x) is str and x == y) for x, y in zip(a, b))
    return a is b


def _sample(container: Any, size: int) -> Any:
    """What is kept of a large container: some items by position (list), the first and last items (dict),
    the first members (set)."""
    if isinstance(container, list):
        step = max(1, size // _SAMPLE)
        positions = sorted({*range(_SAMPLE), *range(0, size, step), *range(size - _SAMPLE, size)})
        return [(i, list.__getitem__(container, i)) for i in positions]
    if isinstance(container, dict):
        items = _dict_class(container).items(container)
        return list(islice(items, _SAMPLE)), list(islice(reversed(items), _SAMPLE))
    return list(islice(set.__iter__(container), 2 * _SAMPLE))


def _undo_growth(container: Any, size: int, sample: Any) -> bool:
    """Take out what was added to a large container since it was sampled; False if it changed otherwise."""
    now = len(container)
    extra = now - size
    if isinstance(container, list):
        if extra < 0 or not all(list.__getitem__(container, i) is item for i, item in sample):
            return False
        if extra:
            list.__delitem__(container, slice(size, None))
        return True
    if isinstance(container, dict):
        kind = _dict_class(container)
        items = kind.items(container)
        head, tail = sample
        if extra < 0 or not _same_items(list(islice(items, _SAMPLE)), head) \
                or not _same_items(list(islice(reversed(items), extra, extra + _SAMPLE)), tail):
            return False
        for key in list(islice(reversed(kind.keys(container)), extra)):  # added keys come last
            kind.__delitem__(container, key)
        return True
    members = list(islice(set.__iter__(container), 2 * _SAMPLE))
    return extra == 0 and len(members) == len(sample) and all(map(operator.is_, members, sample))


class _SavedObject:
    """An input object's own state: its items (a list, dict or set), its attributes and its slots."""

    __slots__ = ("obj", "saved", "slots")

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        label = f"a {type(obj).__name__} in the inputs"
        self.saved = [_Saved(obj, label)] if isinstance(obj, list | dict | set) else []
        state = own_attribute(obj, "__dict__", None)
        if type(state) is dict:
            self.saved.append(_Saved(state, f"the attributes of {label}"))
        self.slots = [(name, own_attribute(obj, name, _MISSING)) for name in slot_names(obj)]

    def restore(self) -> list[str]:
        lost = [message for saved in self.saved if (message := saved.restore()) is not None]
        for name, value in self.slots:
            if own_attribute(self.obj, name, _MISSING) is not value:
                if value is _MISSING:
                    object.__delattr__(self.obj, name)
                else:
                    object.__setattr__(self.obj, name, value)
        return lost


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


# Captures take turns: each changes process-wide state (torch's global hook tables, the RNGs, the
# recursion limit) and puts it back when it ends, so two at once would put back each other's hooks.
# A lock is not data: it holds nothing of any model, and is re-entrant for a capture inside a capture.
_CAPTURES = threading.RLock()


def in_turn() -> contextlib.AbstractContextManager:
    """Hold the captures' turn (re-entrant): for what reads the model while deciding how to capture it."""
    return _CAPTURES


@contextlib.contextmanager
def isolated(model: torch.nn.Module, inputs: Any = None) -> Iterator[list[tuple[str, torch.nn.Module]]]:
    """Run the body, then put the model, the objects in `inputs` (a value or its `Reach`; their own
    state, by reference),
    torch's global hook tables and the RNGs back as they were.

    Yields the model's modules (qualified name, module), each once, in pre-order. Captures run one at
    a time; during one, a forward of the model on another thread raises a RuntimeError.
    """
    with _CAPTURES:
        modules = unique_modules(model)
        depth = max((name.count(".") + 1 for name, _ in modules if name), default=0)
        snapshots = [_ModuleSnapshot(module) for _, module in modules]
        reach = inputs if isinstance(inputs, Reach) or inputs is None else Reach(inputs)
        objects = [_SavedObject(obj) for obj in reach.objects()] if reach is not None else []
        global_state = _GlobalSnapshot(depth)
        guard = torch.nn.modules.module.register_module_forward_pre_hook(_refusing_other_threads(modules))
        lost: list[str] = []
        try:
            yield modules
        finally:
            guard.remove()
            for snapshot in reversed(snapshots):
                lost += snapshot.restore()
            for saved in objects:
                lost += saved.restore()
            global_state.restore()
            for message in lost:
                warnings.warn(message, RuntimeWarning, stacklevel=3)


def _refusing_other_threads(modules: Iterable[tuple[str, torch.nn.Module]]) -> Callable[..., None]:
    """A global forward pre-hook: a module of the model called on another thread than the capture's raises."""
    owner = threading.get_ident()
    ids = frozenset(id(module) for _, module in modules)

    def refuse(module: torch.nn.Module, args: Any) -> None:
        if id(module) in ids and threading.get_ident() != owner:
            raise RuntimeError(
                f"{type(module).__name__}.forward was called while fxflops is estimating the model on another "
                "thread, with fake twins in place of its weights until the estimate returns; run the model's "
                "forwards and its estimates one after the other (e.g. estimate between training steps)")

    return refuse


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
