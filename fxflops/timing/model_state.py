"""What of a model's state its count depends on, read cheaply every step: a training meter's key.

A training step's FLOPs depend on more than the batch's shapes: which parameters are trainable
(`requires_grad`: a frozen layer gets no weight gradient), each submodule's training flag (dropout,
batch norm, a checkpointed block recomputes only in training), flags such as transformers'
`gradient_checkpointing` or a private switch such as peft's `_disable_adapters`, which modules are in
the tree (a head replaced) and their classes, the parameters' dtype and shape, and the forward
(pre-)hooks registered on each module (pruning's, a user's).
`model_state(model)` reads all of them in one walk of the module tree, as a tuple of plain values
that compares equal exactly when none of them changed: the meter and the profiler key their counts by
it, so a change costs one new capture and never a stale count. It reads attributes only (no tensor
data, no device synchronization): about 1.5-2 us a module on a busy 2-core CPU (GPT-2 small 0.25 ms,
a Llama-2-7B shape 0.7-0.9 ms; benchmarks/meter_overhead.py) before classes, hooks, shapes and private
flags were read, ~1.3-1.45x that since (GPT-2 small on meta, both reads in one run, under contention),
once per optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch

# what every nn.Module holds for torch's own bookkeeping (hooks, children, ...): not the module's settings
_BOOKKEEPING = frozenset(torch.nn.Module().__dict__) - {"training"}
# settings read by value; any other attribute (a tensor cache, a config object) is not read: a tensor
# cache reassigned every forward would otherwise look like a new model every step
_PLAIN = frozenset({bool, int, float, str, type(None)})
# of private attributes only flags and names: a switch kept private (peft's `_disable_adapters`,
# `_active_adapter`) changes the forward, a private number is more often a counter moved every step
_PRIVATE = frozenset({bool, str})


class ModelState:
    """A model's state as read by model_state(): its plain values, hashed once (a dict key of the meter's
    families is looked up every micro-batch; a tuple would be hashed again each time)."""

    __slots__ = ("values", "_hash")

    def __init__(self, values: tuple[Any, ...]) -> None:
        self.values = values
        self._hash = hash(values)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, ModelState) and self._hash == other._hash
                                 and self.values == other.values)

    def __repr__(self) -> str:
        return f"ModelState({len(self.values)} values, hash {self._hash:#x})"


def model_state(model: torch.nn.Module, ignored: frozenset[int] = frozenset()) -> ModelState:
    """The model's count-relevant state (see the module's docstring): per module its identity and class,
    training flag, plain public settings, private flags and names, and forward hooks (but those whose
    handle ids are `ignored`: the meter's own, which only read), per parameter requires_grad, dtype and shape."""
    state: list[Any] = []
    append = state.append
    seen: set[int] = set()
    stack = [model]
    while stack:  # model.modules()'s pre-order, without the name strings named_modules() builds
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        attributes = module.__dict__
        append(id(module))
        append(type(module))  # its forward: a class swapped on the same object (or an id reused) is another model
        for key, value in attributes.items():
            if type(value) in (_PLAIN if key[0] != "_" else _PRIVATE) and key not in _BOOKKEEPING:
                append(key)
                append(value)
        for parameter in attributes["_parameters"].values():
            if parameter is not None:
                append(parameter.requires_grad)
                append(parameter.dtype)
                append(parameter.shape)  # a parameter replaced by one of another size (a head resized in place)
        for hooks in (attributes["_forward_pre_hooks"], attributes["_forward_hooks"]):
            if hooks:  # a hook runs in the forward and may compute (pruning's mask multiply, a user's projection):
                ids = tuple(key for key in hooks if key not in ignored) if ignored else tuple(hooks)
                if ids:
                    append(ids)  # its handle ids, new for every hook registered
        children = attributes["_modules"]
        if children:
            stack.extend(child for child in reversed(children.values()) if child is not None)
    return ModelState(tuple(state))


def state_change(before: ModelState, after: ModelState) -> str:
    """A few words on what differs between two states of a model, for a message."""
    before, after = before.values, after.values
    if len(before) != len(after):
        return "modules or settings were added, removed or replaced"
    for old, new in zip(before, after):
        if old != new:
            if isinstance(old, bool) and isinstance(new, bool):
                return "a flag (training, requires_grad or a module setting) changed"
            if isinstance(old, torch.dtype):
                return f"a parameter's dtype changed ({str(old).removeprefix('torch.')} -> " \
                       f"{str(new).removeprefix('torch.')})"
            return "a module or one of its settings changed"
    return "nothing"
