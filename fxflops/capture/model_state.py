"""What a training step holds besides the graph's values: the model's parameters and buffers as the
capture saw them (the fake twins), the gradients the backward left on them, and its seed gradients.

The memory stage reads these to tell a parameter's storage from an activation's; the FLOP count never
reads them. Recorded in `graph_module.meta[MODEL_STATE]` while the twins are still in place.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

MODEL_STATE = "fxflops_model_state"  # graph_module.meta key


@dataclass(frozen=True)
class ModelState:
    """The model's tensors during a capture, by qualified name (a shared tensor under its first name)."""

    parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter name -> its .grad after the backward
    input_grads: list[torch.Tensor] = field(default_factory=list)  # the .grad of inputs that require one
    seeds: list[torch.Tensor] = field(default_factory=list)  # the backward's starting gradients


def record_model_state(graph_module: torch.fx.GraphModule, modules: Iterable[tuple[str, torch.nn.Module]],
                       seeds: list[torch.Tensor] | None = None, inputs: Iterable[torch.Tensor] = ()) -> None:
    """Keep the modules' (fake) parameters, buffers and gradients with the graph, and the gradients of
    the inputs that require one; call before the twins are swapped back out."""
    state = ModelState(seeds=list(seeds or []))
    state.input_grads.extend(tensor.grad for tensor in inputs if isinstance(tensor.grad, torch.Tensor))
    seen: set[int] = set()
    for path, module in modules:
        for kind, tensors in (("parameters", module._parameters), ("buffers", module._buffers)):
            for name, tensor in tensors.items():
                if not isinstance(tensor, torch.Tensor) or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                qualified = f"{path}.{name}" if path else name
                getattr(state, kind)[qualified] = tensor
                grad: Any = tensor.grad if kind == "parameters" else None
                if isinstance(grad, torch.Tensor):
                    state.grads[qualified] = grad
    graph_module.meta[MODEL_STATE] = state
