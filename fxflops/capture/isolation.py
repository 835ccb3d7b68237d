"""Leave the user's model and torch exactly as they were, whatever the captured forward does.

A capture runs the model's own forward (on fake twins of its tensors, or for real). That forward
may set attributes, register hooks or submodules, materialize lazy modules (which changes their
class), write into its weights or draw random numbers. Rather than copying the model, we snapshot
what such a forward can change (the capture methods swap its tensors for twins in place, `twins`),
and restore everything after, also when the forward raises.
"""

from __future__ import annotations

import collections
import contextlib
import operator
import random
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from fxflops.capture.containers import Saved, refill
from fxflops.capture.module_walk import unique_modules
from fxflops.capture.reach import Reach, own_attribute, slot_names


# --- what one module's forward can change ---------------------------------------------------------


class _ModuleSnapshot:
    """A module's class, its __dict__ entries, and the contents of the containers stored there
    (parameters, buffers, submodules, hook dicts, plain list/dict/set attributes)."""

    __slots__ = ("module", "cls", "attrs", "contents", "empty")

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.cls = module.__class__
        self.attrs = dict(module.__dict__)
        self.contents = []
        # most are empty (a module's dozen hook dicts): of a plain list, dict or set only the container is kept
        self.empty = []
        for key, value in self.attrs.items():
            kind = type(value)
            if kind in _PLAIN_CONTAINERS:
                if not value:
                    self.empty.append(value)
                    continue
            elif kind in _NOT_CONTAINERS or not isinstance(value, _CONTAINERS):
                continue
            self.contents.append(Saved(value, f"attribute {key!r} of {type(module).__name__}"))

    def restore(self) -> list[str]:
        """Put the module back; return what could not be put back (changes to very large containers)."""
        module = self.module
        if module.__class__ is not self.cls:
            module.__class__ = self.cls
        lost = [message for saved in self.contents if (message := saved.restore()) is not None]
        if any(self.empty):
            for container in self.empty:
                if container:
                    refill(container, [])
        state = module.__dict__
        attrs = self.attrs
        if list(state) == list(attrs) and all(map(operator.is_, state.values(), attrs.values())):
            return lost  # (the same names in the same order, each the same object: nothing to put back)
        for key in [key for key in state if key not in attrs]:
            del state[key]
        for key, value in attrs.items():
            if state.get(key, _MISSING) is not value:
                state[key] = value
        return lost


_MISSING = object()
_CONTAINERS = (list, dict, set)
_PLAIN_CONTAINERS = frozenset({list, dict, set, collections.OrderedDict})  # (their truth is their size)
# a module's other attributes, mostly (flags, sizes, names): no container, known without isinstance (~20
# attributes x a 70B's 1,047 modules)
_NOT_CONTAINERS = frozenset({bool, int, float, str, type(None)})


class _SavedObject:
    """An input object's own state: its items (a list, dict or set), its attributes and its slots."""

    __slots__ = ("obj", "saved", "slots")

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        label = f"a {type(obj).__name__} in the inputs"
        self.saved = [Saved(obj, label)] if isinstance(obj, list | dict | set) else []
        state = own_attribute(obj, "__dict__", None)
        if type(state) is dict:
            self.saved.append(Saved(state, f"the attributes of {label}"))
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


def global_hooks_present() -> bool:
    """Whether any global module hook is registered (torch.nn.modules.module.register_module_*_hook)."""
    return any(_global_hook_tables())


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
            refill(table, list(contents.items()))
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
