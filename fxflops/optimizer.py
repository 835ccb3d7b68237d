"""One optimizer step's FLOPs: elementwise work per trainable parameter element, counted from the
update PyTorch's own implementation performs (torch.optim, single-tensor form; the foreach and fused
forms do the same arithmetic). Per-tensor scalar work (bias corrections) is not counted.

Each update is a sum of terms, one per tensor operation, counted like the elementwise rules:
a multiply, add, sqrt or divide is 1 FLOP; `add(x, alpha=a)` and `addcmul`/`addcdiv` scale and add,
`lerp` is a + w·(b − a).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fxflops.results import OptimizerStep

if TYPE_CHECKING:  # torch is imported when a step is counted: the CLI lists NAMES before that
    import torch

NAMES = ("sgd", "adam", "adamw")


def optimizer_step(optimizer: str | torch.optim.Optimizer, model: torch.nn.Module,
                   parameters: list[torch.Tensor] | None = None) -> OptimizerStep:
    """The FLOPs of one step of `optimizer` (a name, using torch's defaults, or an instance). `parameters`:
    the ones one rank steps (its local shards under a parallel plan) instead of the model's or the
    instance's groups (counted with the instance's defaults)."""
    import torch

    if isinstance(optimizer, str):
        name = optimizer.lower()
        if name not in NAMES:
            raise ValueError(f"optimizer must be one of {', '.join(NAMES)} or a torch.optim.Optimizer; got {optimizer!r}")
        defaults = {"sgd": {}, "adam": {}, "adamw": {"weight_decay": 1e-2}}[name]
        groups = [(_trainable(model.parameters()), defaults)]
    elif isinstance(optimizer, torch.optim.Optimizer):
        # AdamW before Adam: a subclass of either counts as its base does
        known = [(torch.optim.AdamW, "adamw"), (torch.optim.Adam, "adam"), (torch.optim.SGD, "sgd")]
        name = next((label for cls, label in known if isinstance(optimizer, cls)), "")
        if not name:
            raise ValueError(f"optimizer {type(optimizer).__name__} has no FLOP formula yet; known: "
                             f"{', '.join(NAMES)}. Count it as one of those, or leave optimizer= out")
        groups = [(_trainable(group["params"]), group) for group in optimizer.param_groups] \
            if parameters is None else [(0, optimizer.defaults)]
    else:
        raise TypeError(f"optimizer must be a name ({', '.join(NAMES)}) or a torch.optim.Optimizer; "
                        f"got {type(optimizer).__name__}")
    if parameters is not None:
        groups = [(sum(p.numel() for p in parameters), groups[0][1])]  # trainable ones, as the caller chose
    params = 0
    flops = 0
    formulas = []
    for count, options in groups:
        per_param, formula = _per_param(name, options)
        params += count
        flops += count * per_param
        if formula not in formulas:
            formulas.append(formula)
    per_param = flops // params if params else _per_param(name, groups[0][1])[0]
    return OptimizerStep(name, params, per_param, flops, "; ".join(formulas))


def _trainable(parameters: Any) -> int:
    return sum(p.numel() for p in parameters if p.requires_grad)


def _per_param(name: str, options: dict) -> tuple[int, str]:
    """(FLOPs per parameter element, the terms that make them up)."""
    decoupled = bool(options.get("decoupled_weight_decay", name == "adamw"))  # Adam(decoupled_weight_decay=True)
    terms = _sgd_terms(options) if name == "sgd" else _adam_terms(options, decoupled=decoupled)
    total = sum(flops for _, flops in terms)
    return total, f"{name}: " + " + ".join(f"{flops} {what}" for what, flops in terms) + f" = {total}"


def _sgd_terms(options: dict) -> list[tuple[str, int]]:
    terms = []
    if options.get("weight_decay", 0):
        terms.append(("weight decay g + wd·p", 2))
    if options.get("momentum", 0):
        terms.append(("momentum b·m + (1−d)·g", 3))
        if options.get("nesterov", False):
            terms.append(("nesterov g + m·b", 2))
    terms.append(("update p − lr·g", 2))
    return terms


def _adam_terms(options: dict, decoupled: bool) -> list[tuple[str, int]]:
    terms = []
    if options.get("weight_decay", 0):
        terms.append(("decoupled decay p·(1 − lr·wd)", 1) if decoupled else ("weight decay g + wd·p", 2))
    terms += [("first moment lerp(m, g, 1−β1)", 3), ("second moment β2·v + (1−β2)·g·g", 4)]
    if options.get("amsgrad", False):
        terms.append(("amsgrad max(v̂, v)", 1))
    terms += [("denominator sqrt(v)/c2 + eps", 3), ("update p − s·m/denom", 3)]
    return terms
