"""The backward pass, recorded as autograd runs it: which forward op each backward op differentiates.

Every autograd node gets a sequence number when the forward op that creates it runs (torch numbers
them per thread, in creation order, as its own tracers do: see NOTE [ Sequence Number ] in torch).
While the forward is recorded, each recorded op claims the sequence numbers handed out since the op
before it: its own node and those of the ops it decomposed into. While the backward runs, the node
executing (`torch._C._current_autograd_node()`) names, through its number, the forward op it
differentiates, and that op's module is where the backward op's cost belongs.

Ops that run in the backward with grad mode on are a forward recomputed there (activation
checkpointing): they count as backward work, in the module whose forward runs again.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from fxflops.capture.inputs import tensors_in
from fxflops.capture.isolation import unique_modules
from fxflops.results import BACKWARD, FORWARD, PHASE, RECOMPUTE

__all__ = ["BACKWARD", "DIFFERENTIATES", "FORWARD", "PHASE", "RECOMPUTE", "GradOwners",
           "NothingToDifferentiateWarning", "backward_roots", "ones_like_each", "parameter_owners", "run_backward"]
DIFFERENTIATES = "fxflops_differentiates"  # node.meta key of a backward op: the forward node's name

Loss = Callable[[Any], torch.Tensor]


class GradOwners:
    """Maps autograd nodes to the recorded forward nodes that created them, and says which phase runs."""

    def __init__(self, leaf_owners: dict[int, tuple[str, str]] | None = None) -> None:
        self.in_backward = False
        self._leaf_owners = leaf_owners or {}  # id(parameter) -> (module path, class name)
        self._forward_thread = threading.get_ident()
        self._by_seq: dict[int, torch.fx.Node] = {}  # nodes created on the forward's thread
        self._later: dict[tuple[int, int], torch.fx.Node] = {}  # created during the backward, per thread
        self._next: dict[int, int] = {}  # thread -> first sequence number not yet claimed

    def claim(self, node: torch.fx.Node) -> None:
        """Give `node` the autograd nodes created on this thread since the previous recorded op."""
        thread = threading.get_ident()
        now = torch.autograd._get_sequence_nr()
        start = self._next.get(thread, now)
        if self.in_backward:
            for seq in range(start, now):
                self._later[(thread, seq)] = node
        elif thread == self._forward_thread:
            for seq in range(start, now):
                self._by_seq[seq] = node
        self._next[thread] = now

    def start(self) -> None:
        """Called before the forward: sequence numbers handed out earlier belong to no recorded op."""
        self._next[threading.get_ident()] = torch.autograd._get_sequence_nr()

    def phase(self) -> str:
        if not self.in_backward:
            return FORWARD
        return RECOMPUTE if torch.is_grad_enabled() else BACKWARD

    def differentiated(self) -> torch.fx.Node | tuple[str, str] | None:
        """The recorded forward node whose autograd node is executing now; for a gradient being
        accumulated into a parameter, the module that owns it; None when neither is known."""
        grad_fn = torch._C._current_autograd_node()
        if grad_fn is None:
            return None
        variable = getattr(grad_fn, "variable", None)  # AccumulateGrad: numbered past every forward op
        if variable is not None:
            return self._leaf_owners.get(id(variable))
        seq = grad_fn._sequence_nr()
        # a node created inside the backward (a recomputed forward's) runs on the thread that made it
        found = self._later.get((threading.get_ident(), seq))
        return found if found is not None else self._by_seq.get(seq)


def backward_roots(output: Any, loss: Loss | None) -> list[torch.Tensor]:
    """The tensors the backward starts from: `loss(output)`, or the output's floating tensors that
    require grad (the default loss is their sum, whose gradient is ones: the sum itself is not
    recorded, being no part of the model). Call with recording paused unless `loss` is the user's."""
    if loss is not None:
        value = loss(output)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"loss(output) must return a tensor; it returned {type(value).__name__}")
        return [value] if value.requires_grad else []
    return [t for t in tensors_in(output) if t.is_floating_point() and t.requires_grad]


class NothingToDifferentiateWarning(UserWarning):
    """backward=True, but no output depends on anything that requires grad: the backward costs 0."""


def run_backward(roots: list[torch.Tensor], owners: GradOwners, seeds: Callable[[list[torch.Tensor]], list]) -> None:
    """Run autograd's backward from `roots`, seeded by `seeds(roots)` (ones of each root's shape)."""
    if not roots:
        warnings.warn("backward=True, but nothing in the output requires grad (every parameter frozen, or the "
                      "forward detaches its result): the backward costs 0. Unfreeze what trains, or pass inputs "
                      "with requires_grad=True", NothingToDifferentiateWarning, stacklevel=2)
        return
    grads = seeds(roots)
    owners.in_backward = True
    try:
        torch.autograd.backward(roots, grads)
    finally:
        owners.in_backward = False


def parameter_owners(model: torch.nn.Module) -> dict[int, tuple[str, str]]:
    """id(parameter) -> (path, class) of the module holding it (the tensors in place right now)."""
    return {id(parameter): (name, type(module).__name__)
            for name, module in unique_modules(model) for parameter in module._parameters.values()
            if parameter is not None}


def ones_like_each(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """The default loss's gradient: ones for every root."""
    return [torch.ones_like(root) for root in roots]
