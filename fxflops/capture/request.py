"""What every capture method is given: the model, its example inputs and the rule table's questions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fxflops.capture.dynamic import SizePlan
from fxflops.capture.module_walk import unique_modules


def _never(module: torch.nn.Module) -> bool:
    return False


def _every_op(op: Any, function: Any) -> bool:
    return True


@dataclass(frozen=True)
class Request:
    """What capture() was asked: the model, its inputs, and how to capture them."""

    model: torch.nn.Module
    args: tuple
    kwargs: dict[str, Any]
    is_leaf: Callable[[torch.nn.Module], bool] = _never  # symbolic tracing keeps these modules whole
    is_whole: Callable[[torch.nn.Module], bool] = _never  # a rule counts these modules as a whole
    backward: bool = False  # also record the backward of loss(output)
    loss: Callable[[Any], torch.Tensor] | None = None  # None: the output's own `loss`, else the sum of its floating tensors
    sizes: SizePlan | None = None  # input axes captured as symbolic sizes (costs come out as formulas)
    # composite aten ops a rule names (by op, or by the builtin that called it: knows_op(op, function))
    # are recorded whole; the others as the ops they decompose into
    knows_op: Callable[[Any, Any], bool] = _every_op
    replay: bool = True  # a repeated block's call copies its first call's nodes where provably the same (capture.replay)
    # run on the model once its tensors are meta twins (which then get fake ones), before the forward (a
    # parallel plan applies itself there: fxflops.parallel); what it changes is undone with the rest (isolation)
    prepare: Callable[[torch.nn.Module], None] | None = None
    # what a mixture-of-experts router's topk is assumed to pick where the forward reads the picks (capture.input_values)
    routing: Any = None  # None or "balanced", "worst", or per-expert token counts

    def whole_paths(self) -> frozenset[str]:
        return frozenset(name for name, module in unique_modules(self.model) if self.is_whole(module))
