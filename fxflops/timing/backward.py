"""The backward and the optimizer step timed: per module (BackwardTimer) and per phase (PhaseTimer).

`BackwardTimer` times every autograd node of a backward and charges it to the module whose forward
created it (autograd's sequence numbers, as the estimate attributes them). `PhaseTimer` times a
training loop's whole backward and optimizer step with autograd and optimizer hooks, without
touching torch's functions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxflops.capture.backward import SequenceRuns, graph_nodes, parameter_owners
from fxflops.capture.running import capturing
from fxflops.timing.clocks import CpuClock, CudaClock


class BackwardTimer:
    """Times the backward per module: every autograd node the backward runs is timed (from its
    pre-hook to its hook) and charged to the innermost module whose forward created it.

    Ownership comes from autograd's sequence numbers, as in the estimate: while attached, each
    module entry and exit of a forward cuts them (`SequenceRuns`), the numbers handed out in between
    going to the module on top of the stack. A gradient accumulated into a parameter belongs to the
    parameter's nearest timed module. Autograd nodes do not nest, so a module's time is exactly the
    sum of its nodes'; a parent's includes its children's.
    """

    def __init__(self, model: nn.Module, clock: CpuClock | CudaClock, skip_types: tuple[type, ...] = ()) -> None:
        self.clock = clock
        self.records: list[dict[str, float]] = []  # per backward: module -> seconds (inclusive)
        self._modules = [(n, m) for n, m in model.named_modules() if not n or not isinstance(m, skip_types)]
        timed = {name for name, _ in self._modules}
        self._param_owner = {key: _nearest(path, timed) for key, (path, _) in parameter_owners(model).items()}
        self._runs = SequenceRuns()
        self._thread = threading.get_ident()
        self._stack: list[str] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _enter(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if not capturing():  # a capture's forward is not the one being differentiated
                self._runs.cut(self._stack[-1] if self._stack else None)
                self._stack.append(name)
        return hook

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._stack and not capturing():
            self._runs.cut(self._stack.pop())

    def attach(self) -> BackwardTimer:
        """Follow the forwards that run from now on (call before the forward to be differentiated)."""
        if not self._handles:
            self._runs, self._stack, self._thread = SequenceRuns(), [], threading.get_ident()
            self._runs.cut(None)
            for name, module in self._modules:
                self._handles.append(module.register_forward_pre_hook(self._enter(name), prepend=True))
                self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        return self

    def detach(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def owner(self, node: Any) -> str | None:
        variable = getattr(node, "variable", None)  # AccumulateGrad: the parameter's module
        if variable is not None:
            return self._param_owner.get(id(variable))
        return self._runs.owner_of(self._thread, node._sequence_nr())

    def backward(self, roots: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Run the backward from `roots`, timing each autograd node; appends one record."""
        nodes = graph_nodes(roots)
        owners = [self.owner(node) for node in nodes]
        stamps: list[list[Any]] = [[] for _ in nodes]
        handles = []
        for node, owner, taken in zip(nodes, owners, stamps):
            if owner is None:
                continue
            handles.append(node.register_prehook(lambda grad_outputs, taken=taken: taken.append(self.clock.stamp())))
            handles.append(node.register_hook(lambda grad_inputs, grad_outputs, taken=taken:
                                              taken.append(self.clock.stamp())))
        self.clock.reset()
        try:
            torch.autograd.backward(roots, grads)
        finally:
            for handle in handles:
                handle.remove()
        seconds = iter(self.clock.seconds([stamp for taken in stamps for stamp in taken]))
        per_module: dict[str, float] = {}
        for owner, taken in zip(owners, stamps):
            times = [next(seconds) for _ in taken]
            if owner is None or len(times) != 2:
                continue
            for name in _self_and_ancestors(owner):
                per_module[name] = per_module.get(name, 0.0) + times[1] - times[0]
        self.records.append(per_module)


def _nearest(path: str, names: set[str]) -> str:
    """`path` or its nearest ancestor in `names` (the root always is)."""
    return next(name for name in _self_and_ancestors(path) if name in names or not name)


def _self_and_ancestors(name: str) -> list[str]:
    names = [name]
    while name:
        name = name.rsplit(".", 1)[0] if "." in name else ""
        names.append(name)
    return names


def mean_backward(records: list[dict[str, float]]) -> dict[str, float]:
    """Per module: mean backward seconds per step (modules absent from a step count 0 there)."""
    totals: dict[str, float] = {}
    for record in records:
        for name, seconds in record.items():
            totals[name] = totals.get(name, 0.0) + seconds
    return {name: seconds / len(records) for name, seconds in totals.items()}


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """Tensors of a forward's output that gradients flow through (HF ModelOutput is a dict)."""
    leaves = pytree.tree_leaves(dict(output) if isinstance(output, dict) else output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


class PhaseTimer:
    """Backward and optimizer-step latency in a training loop, without touching torch's functions.

    Backward: from the first gradient reaching a forward output to the end of that backward pass
    (an autograd-engine callback queued from the gradient hook), so the loss's own few backward
    ops are outside it. Step: the optimizer step pre/post hooks, registered (globally, for every
    optimizer) only while attached. On CUDA each phase end synchronizes once.
    """

    def __init__(self, clock: CpuClock | CudaClock) -> None:
        self.clock = clock
        self.bwd: list[float] = []
        self.step: list[float] = []
        self._grad_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._step_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._step_start: Any = None

    def watch(self, output: Any) -> None:
        """Time the backward pass that will run through this forward output."""
        tensors = _output_tensors(output)
        if not tensors:
            return
        started: list[Any] = []

        def on_grad(grad: torch.Tensor) -> None:
            if started:
                return
            self.clock.reset()
            started.append(self.clock.stamp())
            torch.autograd.Variable._execution_engine.queue_callback(on_end)

        def on_end() -> None:
            end = self.clock.stamp()
            self.bwd.append(self.clock.seconds([started[0], end])[1])
            self._drop_grad_hooks()

        self._drop_grad_hooks()  # a later forward replaces an earlier one that never ran backward
        self._grad_handles = [t.register_hook(on_grad) for t in tensors]

    def _drop_grad_hooks(self) -> None:
        handles, self._grad_handles = self._grad_handles, []
        for handle in handles:
            handle.remove()

    def _on_step_start(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.clock.reset()
        self._step_start = self.clock.stamp()

    def _on_step_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._step_start is not None:
            self.step.append(self.clock.seconds([self._step_start, self.clock.stamp()])[1])
            self._step_start = None

    def attach(self) -> PhaseTimer:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        if not self._step_handles:
            self._step_handles = [
                register_optimizer_step_pre_hook(self._on_step_start),
                register_optimizer_step_post_hook(self._on_step_end),
            ]
        return self

    def detach(self) -> None:
        handles, self._step_handles = self._step_handles, []
        for handle in handles:
            handle.remove()
        self._drop_grad_hooks()
