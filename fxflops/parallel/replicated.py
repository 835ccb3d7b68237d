"""Which work is replicated: modules each tensor-parallel rank runs whole (or more than its share of).

Tensor parallelism splits the matmuls, but whatever runs on tensors every rank of the tp group holds
whole — norms, dropout, residual adds, activations outside the split MLP, and without sequence parallelism
the output head and the loss — runs on every one of them. Per module, the rank's own FLOPs times the tp
ranks that share its micro-batch are compared with the unsharded model's: the excess is the replicated
work, so that the sum over ranks is the unsharded model's FLOPs plus these excesses (per data-parallel
copy and micro-batch), never a mystery.
"""

from __future__ import annotations

from typing import Any

from fxflops.results import ROOT_LABEL, Estimate, RankRole


def replicated_work(roles: list[RankRole], unsharded: Estimate, ranks: int) -> list[dict[str, Any]]:
    """One record per (role, module) whose `ranks` ranks together run more FLOPs than the unsharded model's
    module: {"role", "module", "flops" (one rank's, the module's own ops), "unsharded_flops", "ranks",
    "extra_flops" (ranks * flops - unsharded_flops), "whole" (each rank runs all of it)}."""
    found = []
    for role in roles:
        for name, stats in role.estimate.modules.items():
            whole = unsharded.modules.get(name)
            full = whole.self_flops if whole is not None else 0
            extra = ranks * stats.self_flops - full
            if extra:
                found.append({"role": role.name, "module": name or ROOT_LABEL, "flops": stats.self_flops,
                              "unsharded_flops": full, "ranks": ranks, "extra_flops": extra,
                              "whole": stats.self_flops == full})
    return found
