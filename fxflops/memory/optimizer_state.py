"""What torch.optim holds and allocates for one step, from the trainable parameters' shapes and dtypes.

Read from torch.optim's own implementations (torch/optim/adam.py, sgd.py), the forms torch picks by
default: the single-tensor loop on CPU and meta tensors, `foreach` on CUDA (or when asked). Optimizer
state exists at the start of a step (a step after the first); what a step allocates is temporaries:

- Adam/AdamW state per parameter: exp_avg and exp_avg_sq like the parameter, a float32 `step`
  scalar (4 bytes); amsgrad adds max_exp_avg_sq. Single-tensor step: `grad.add(param, wd)` for Adam's
  coupled weight decay, then `denom = (exp_avg_sq.sqrt() / c).add_(eps)` — the sqrt and the quotient
  both alive for a moment — while the previous parameter's `denom` is still bound (freed when the
  name is rebound). Foreach step: per device-and-dtype group, `_foreach_sqrt` of every exp_avg_sq
  (and, coupled decay, a copy of every gradient, deleted before it), the previous group's alive.
  Fused step (`fused=True`: torch._fused_adam(w)_, CUDA and CPU): one kernel updates each group in
  place, no temporaries.
- SGD: momentum_buffer per parameter when momentum != 0; a step's temporaries are the coupled weight
  decay's `grad.add(param)` and nesterov's `grad.add(buf)`.
- Mixed precision with fp32 master weights (Megatron/DeepSpeed style, not torch.optim's own): the
  master copy and the moments are float32, 4 bytes each per parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxflops.optimizer import NAMES  # the optimizers whose step fxflops counts: the same names here

_STEP_BYTES = 4  # torch.optim keeps Adam's `step` as a float32 scalar tensor per parameter


@dataclass(frozen=True)
class OptimizerMemory:
    state_bytes: int  # held from one step to the next (incl. fp32 master weights when asked for)
    step_bytes: int  # the most a step's temporaries hold at once
    how: str  # the form and formula, in words


def optimizer_memory(optimizer: str | torch.optim.Optimizer, params: Sequence[torch.Tensor], *,
                     master_weights: bool = False) -> OptimizerMemory:
    """State and step temporaries of `optimizer` over `params` (tensors whose shape, dtype and device
    stand for the trainable parameters, in the optimizer's order). An instance whose param groups hold `params`
    themselves (not local shards of them) is read per group: each group's own options (amsgrad, momentum, weight_decay, foreach, fused), its
    state summed, its step's temporaries freed before the next group's step call (torch steps each group in its
    own call); else the instance's defaults."""
    name, options = _name_and_options(optimizer)
    wanted = {id(p) for p in params}
    groups = [[p for p in group["params"] if id(p) in wanted] for group in getattr(optimizer, "param_groups", [])]
    if params and sum(len(group) for group in groups) == len(params):
        found = [_memory(name, {**options, **settings}, group, master_weights)
                 for settings, group in zip(optimizer.param_groups, groups) if group]
        if len(found) == 1:
            return found[0]
        hows = dict.fromkeys(memory.how for memory in found)  # the groups' forms, each once
        return OptimizerMemory(sum(memory.state_bytes for memory in found), max(memory.step_bytes for memory in found),
                               f"{len(found)} param groups, each its own step: " + "; ".join(hows))
    return _memory(name, options, params, master_weights)


def _memory(name: str, options: dict[str, Any], params: Sequence[torch.Tensor], master_weights: bool) -> OptimizerMemory:
    """State and step temporaries of one param group's step: `name` with `options` over `params`."""
    foreach = options.get("foreach")
    if foreach is None:  # torch's default: foreach on CUDA (and other foreach devices), the loop elsewhere
        foreach = bool(params) and all(p.device.type == "cuda" for p in params)
    dtype_of = (lambda p: torch.float32) if master_weights else (lambda p: p.dtype)  # noqa: E731
    sizes = [p.numel() * dtype_of(p).itemsize for p in params]
    groups: dict[tuple[str, torch.dtype], int] = {}
    for p, size in zip(params, sizes):
        key = (p.device.type, dtype_of(p))
        groups[key] = groups.get(key, 0) + size
    master = sum(p.numel() * 4 for p in params) if master_weights else 0
    if name == "sgd":
        momentum = bool(options.get("momentum", 0))
        state = sum(sizes) if momentum else 0
        per_param = int(bool(options.get("weight_decay", 0))) + int(bool(options.get("nesterov", False)))
        step = 0 if options.get("fused") else per_param * (sum(groups.values()) if foreach else max(sizes, default=0))
        formula = f"sgd: momentum buffer {'1' if momentum else '0'}× params; step {per_param}× " + \
                  ("each group" if foreach else "the largest parameter")
    else:
        copies = 3 if options.get("amsgrad", False) else 2
        state = copies * sum(sizes) + _STEP_BYTES * len(sizes)
        coupled = name == "adam" and bool(options.get("weight_decay", 0)) and \
            not options.get("decoupled_weight_decay", False)
        fused = bool(options.get("fused"))
        step = 0 if fused else _adam_foreach_step(list(groups.values())) if foreach else _adam_loop_step(sizes, coupled)
        moments = "exp_avg + exp_avg_sq" + (" + max_exp_avg_sq" if copies == 3 else "")
        temporaries = "none (one fused kernel per group, in place)" if fused else \
            "foreach sqrt of each group" if foreach else "sqrt and quotient of one parameter"
        formula = f"{name}: {moments} like each parameter + a 4-byte step; step: {temporaries}"
    form = "fused" if options.get("fused") else "foreach" if foreach else "single-tensor"
    master_note = ", fp32 master weights and moments; the gradients cast to fp32 not counted" if master_weights else ""
    how = f"{formula} ({form} form{master_note})"
    return OptimizerMemory(state + master, step, how)


def _adam_loop_step(sizes: list[int], coupled: bool) -> int:
    """The loop's peak: the previous `denom`, this parameter's decayed grad copy, sqrt and quotient."""
    peak = 0
    previous = 0
    for size in sizes:
        peak = max(peak, previous + (size if coupled else 0) + 2 * size)
        previous = size
    return peak


def _adam_foreach_step(groups: list[int]) -> int:
    """Each group's `_foreach_sqrt` list, made while the previous group's is still bound."""
    peak = 0
    previous = 0
    for size in groups:
        peak = max(peak, previous + size)
        previous = size
    return peak


def _name_and_options(optimizer: str | torch.optim.Optimizer) -> tuple[str, dict[str, Any]]:
    if isinstance(optimizer, str):
        name = optimizer.lower()
        if name not in NAMES:
            raise ValueError(f"optimizer must be one of {', '.join(NAMES)} or a torch.optim.Optimizer; "
                             f"got {optimizer!r}")
        return name, {"adamw": {"weight_decay": 1e-2}}.get(name, {})
    known = [(torch.optim.AdamW, "adamw"), (torch.optim.Adam, "adam"), (torch.optim.SGD, "sgd")]
    name = next((label for cls, label in known if isinstance(optimizer, cls)), "")
    if not name:
        raise ValueError(f"optimizer {type(optimizer).__name__} has no memory formula yet; known: "
                         f"{', '.join(NAMES)}. Estimate it as one of those, or leave optimizer= out")
    return name, dict(optimizer.defaults)
