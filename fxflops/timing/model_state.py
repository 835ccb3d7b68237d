"""What of a model's state its count depends on, read cheaply every step: a training meter's key.

A training step's FLOPs depend on more than the batch's shapes: which parameters are trainable
(`requires_grad`: a frozen layer gets no weight gradient), each submodule's training flag (dropout,
batch norm, a checkpointed block recomputes only in training), flags such as transformers'
`gradient_checkpointing`, which modules are in the tree (a head replaced) and the parameters' dtype.
`model_state(model)` reads all of them in one walk of the module tree, as a tuple of plain values
that compares equal exactly when none of them changed: the meter and the profiler key their counts by
it, so a change costs one new capture and never a stale count. It reads attributes only (no tensor
data, no device synchronization): tens of microseconds on a small model, see benchmarks/meter_overhead.py.
"""

from __future__ import annotations

from typing import Any

import torch

# what every nn.Module holds for torch's own bookkeeping (hooks, children, ...): not the module's settings
_BOOKKEEPING = frozenset(torch.nn.Module().__dict__) - {"training"}
# settings read by value; any other attribute (a tensor cache, a config object) is not read: a tensor
# cache reassigned every forward would otherwise look like a new model every step
_PLAIN = frozenset({bool, int, float, str, type(None)})


def model_state(model: torch.nn.Module) -> tuple[Any, ...]:
    """The model's count-relevant state as a flat tuple of plain values (see the module's docstring):
    per module its identity, training flag and plain public settings, per parameter requires_grad and
    dtype."""
    state: list[Any] = []
    append = state.append
    for module in model.modules():
        append(id(module))
        for key, value in module.__dict__.items():
            if type(value) in _PLAIN and key not in _BOOKKEEPING and (key == "training" or key[0] != "_"):
                append(key)
                append(value)
        for parameter in module._parameters.values():
            if parameter is not None:
                append(parameter.requires_grad)
                append(parameter.dtype)
    return tuple(state)


def state_change(before: tuple[Any, ...], after: tuple[Any, ...], model: torch.nn.Module) -> str:
    """A few words on what differs between two states of `model` (for a message), e.g. "a module was
    replaced", "requires_grad or dtype of a parameter", "training of a module"."""
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
