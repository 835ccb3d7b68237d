"""The backward pass, recorded as autograd runs it: which forward op each backward op differentiates.

Every autograd node gets a sequence number when the forward op that creates it runs (torch numbers
them per thread, in creation order, as its own tracers do: see NOTE [ Sequence Number ] in torch).
While the forward is recorded, each recorded op claims the sequence numbers handed out since the op
before it: its own node and those of the ops it decomposed into. Before the backward, each node of
the graph is tagged with its forward op; while the backward runs, the node executing
(`torch._C._current_autograd_node()`) names the forward op it differentiates, and that op's module
is where the backward op's cost belongs.

Ops that run in the backward with grad mode on are a forward recomputed there (activation
checkpointing): they count as backward work, in the module whose forward runs again.
"""

from __future__ import annotations

import bisect
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fxflops.capture.module_walk import unique_modules
from fxflops.capture.tensor_walk import tensors_in
from fxflops.results import BACKWARD, FORWARD, PHASE, RECOMPUTE

__all__ = ["AUTOGRAD_NODE", "BACKWARD", "DIFFERENTIATES", "FORWARD", "PHASE", "RECOMPUTE", "REPLAYED", "GradOwners",
           "NothingToDifferentiateWarning", "ReplayRetry", "SequenceRuns", "backward_roots", "cleared_grads", "differentiate",
           "graph_nodes", "ones_like_each", "parameter_owners", "restore_grads", "run_backward"]
DIFFERENTIATES = "fxflops_differentiates"  # node.meta key of a backward op: the forward node's name
AUTOGRAD_NODE = "fxflops_autograd_node"  # node.meta key of a backward op: (class, sequence nr) of the autograd node running it
OWNER = "fxflops_forward_node"  # autograd node.metadata key: the recorded forward node that created it
REPLAYED = "fxflops_replayed_block"  # autograd node.metadata key: the node standing for a replayed block's backward
ACCUMULATE = ("AccumulateGrad", 2 ** 64 - 1)  # AUTOGRAD_NODE of a leaf's gradient accumulation (autograd's own)


class ReplayRetry(Exception):
    """A replayed block's backward met what its copy cannot place as a full capture would (a gradient
    accumulated into a tensor shared with other calls): the capture runs again, every call run."""

Loss = Callable[[Any], torch.Tensor]


class SequenceRuns:
    """Autograd's sequence numbers, per thread, cut into runs: `cut(owner)` gives `owner` every number
    handed out on this thread since the previous cut (on a thread's first cut: from 0)."""

    def __init__(self) -> None:
        self._ends: dict[int, list[int]] = {}  # thread -> ends of its runs, ascending
        self._owners: dict[int, list[Any]] = {}  # thread -> the owner of each run

    def cut(self, owner: Any) -> None:
        thread = threading.get_ident()
        now = torch.autograd._get_sequence_nr()
        ends = self._ends.setdefault(thread, [])
        if ends and now <= ends[-1]:
            return  # no autograd node since the last cut: `owner` has none
        ends.append(now)
        self._owners.setdefault(thread, []).append(owner)

    def owner_of(self, thread: int, seq: int) -> Any:
        ends = self._ends.get(thread)
        if not ends:
            return None
        index = bisect.bisect_right(ends, seq)
        return self._owners[thread][index] if index < len(ends) else None


def graph_nodes(roots: list[torch.Tensor], stop: Callable[[Any, int], bool] | None = None) -> list[Any]:
    """Every autograd node reachable from the roots' grad_fns, each once (not past an edge `stop(node, input
    number)` stops at)."""
    seen: set[int] = set()
    order: list[Any] = []
    stack = [root.grad_fn for root in roots if root.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        stack.extend(child for child, number in node.next_functions
                     if child is not None and (stop is None or not stop(child, number)))
    return order


class GradOwners:
    """Maps autograd nodes to the recorded forward nodes that created them, and says which phase runs.

    Each recorded op cuts the sequence numbers (`SequenceRuns`): the autograd nodes created since
    the previous recorded op are its own and those of the ops it decomposed into. Before the
    backward starts, every node of the graph to be run is tagged (node.metadata) with its forward
    node, so a backward on another thread (CUDA's device threads) still finds it; only nodes made
    during the backward (a recomputed forward) are looked up by the thread that made and runs them.
    """

    def __init__(self, leaf_owners: dict[int, tuple[str, str]] | None = None) -> None:
        self.in_backward = False
        self._forward_thread = threading.get_ident()
        self._leaf_owners = leaf_owners or {}  # id(parameter) -> (module path, class name)
        self._runs = SequenceRuns()
        self.seeds: list[torch.Tensor] = []  # the gradients the backward started from (memory reads their lifetime)
        # a replayed block's backward (capture.block_backward) accumulating a leaf's gradient itself: the leaf,
        # whose module its ops belong to as autograd's AccumulateGrad's would
        self.accumulating: torch.Tensor | None = None
        self.accumulated: set[int] = set()  # ids of the leaves accumulated so: autograd may not accumulate them too
        # while a replayed block's reference runs its backward once more to be copied: its forward nodes (an op
        # of any other is autograd running past the block: a tensor it reads is reached another way too)
        self.rerunning: set[torch.fx.Node] | None = None

    def start(self) -> None:
        """Called before the forward: numbers handed out earlier belong to no recorded op."""
        self._runs.cut(None)

    def claim(self, node: torch.fx.Node) -> None:
        """Give `node` the autograd nodes created on this thread since the previous recorded op."""
        self._runs.cut(node)

    def tag(self, roots: list[torch.Tensor]) -> None:
        """Tag every autograd node reachable from `roots` with the forward node that created it."""
        for grad_fn in graph_nodes(roots):
            if getattr(grad_fn, "variable", None) is None:
                forward = self._runs.owner_of(self._forward_thread, grad_fn._sequence_nr())
                if forward is not None:
                    grad_fn.metadata[OWNER] = forward

    def leaf_owner(self, tensor: torch.Tensor) -> tuple[str, str] | None:
        """(path, class) of the module holding a parameter; None for another leaf."""
        return self._leaf_owners.get(id(tensor))

    def phase(self) -> str:
        if not self.in_backward:
            return FORWARD
        return RECOMPUTE if torch.is_grad_enabled() else BACKWARD

    def running(self) -> tuple[str, int] | None:
        """The autograd node executing now, as (class name, sequence number); None outside one. One recorded
        forward op can make several autograd nodes, each freeing what it holds when it returns (memory)."""
        if self.accumulating is not None:
            return ACCUMULATE
        grad_fn = torch._C._current_autograd_node()
        return None if grad_fn is None else (type(grad_fn).__name__, grad_fn._sequence_nr())

    def differentiated(self) -> torch.fx.Node | tuple[str, str] | None:
        """The recorded forward node whose autograd node is executing now; for a gradient being
        accumulated into a parameter, the module that owns it; None when neither is known."""
        if self.accumulating is not None:
            return self._leaf_owners.get(id(self.accumulating))
        forward = self._differentiated()
        if self.rerunning is not None and forward not in self.rerunning:
            raise ReplayRetry("a replayed block's backward reaches past the block")
        return forward

    def _differentiated(self) -> torch.fx.Node | tuple[str, str] | None:
        grad_fn = torch._C._current_autograd_node()
        if grad_fn is None:
            return None
        variable = getattr(grad_fn, "variable", None)  # AccumulateGrad: numbered past every forward op
        if variable is not None:
            if id(variable) in self.accumulated:  # a full capture would have summed both before one accumulation
                raise ReplayRetry("a leaf's gradient accumulated by a replayed block and by autograd")
            return self._leaf_owners.get(id(variable))
        metadata = grad_fn.metadata
        if REPLAYED in metadata:  # an op on a replayed block's gradients (summed into a tensor used elsewhere too)
            raise ReplayRetry("an op on a replayed block's gradient outside its copy")
        forward = metadata.get(OWNER)
        if forward is not None:
            return forward
        # made during the backward (a recomputed forward's), on the thread that now runs it
        return self._runs.owner_of(threading.get_ident(), grad_fn._sequence_nr())


def backward_roots(output: Any, loss: Loss | None) -> list[torch.Tensor]:
    """The tensors the backward starts from: `loss(output)`; by default the output's own `loss` when it
    has one (a transformers model given labels: what training differentiates), else the output's
    floating tensors that require grad (the default loss is their sum, whose gradient is ones: the sum
    itself is not recorded, being no part of the model). Call with recording paused unless `loss` is
    the user's."""
    if loss is not None:
        value = loss(output)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"loss(output) must return a tensor; it returned {type(value).__name__}")
        return [value] if value.requires_grad else []
    own = own_loss(output)
    if own is not None:
        return [own] if own.requires_grad else []
    return [t for t in tensors_in(output) if t.is_floating_point() and t.requires_grad]


def own_loss(output: Any) -> torch.Tensor | None:
    """The output's `loss` (a key or attribute holding a floating tensor: transformers' ModelOutput given
    labels), or None."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.is_floating_point() else None


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
    owners.seeds = [grad for grad in grads if isinstance(grad, torch.Tensor)]
    owners.tag(roots)
    owners.in_backward = True
    try:
        torch.autograd.backward(roots, grads)
    finally:
        owners.in_backward = False


def differentiate(output: Any, loss: Loss | None, owners: GradOwners,
                  unrecorded: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Record the backward of `loss(output)` (the user's loss is recorded; the default's roots and seeds,
    being fxflops' own work, run through `unrecorded`)."""
    roots_of = backward_roots if loss is not None else unrecorded(backward_roots)
    run_backward(roots_of(output, loss), owners, unrecorded(ones_like_each))


def parameter_owners(model: torch.nn.Module) -> dict[int, tuple[str, str]]:
    """id(parameter) -> (path, class) of the module holding it (the tensors in place right now)."""
    return {id(parameter): (name, type(module).__name__)
            for name, module in unique_modules(model) for parameter in module._parameters.values()
            if parameter is not None}


def ones_like_each(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """The default loss's gradient: ones for every root."""
    return [torch.ones_like(root) for root in roots]


def cleared_grads(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each tensor's .grad, then cleared: a real backward accumulates into fresh tensors, never into
    a user's gradient in place. Put them back with `restore_grads`."""
    saved = [(tensor, tensor.grad) for tensor in tensors]
    for tensor in tensors:
        tensor.grad = None
    return saved


def restore_grads(saved: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    for tensor, grad in saved:
        tensor.grad = grad
