"""The text report's lines on a plan's step: micro-batches and global batch, and which work is replicated."""

from __future__ import annotations

from fxflops.report.text_layout import _row
from fxflops.results import Estimate


def step_lines(estimate: Estimate) -> list[str]:
    """The micro-batches a step runs, the global batch, and the replicated work of the tp ranks."""
    plan = estimate.parallel or {}
    lines = []
    if plan.get("microbatches") is not None:
        batch = plan.get("batch")
        lines.append(_row("micro-batches per step:", f"{plan['microbatches']:,} of {plan.get('microbatch') or '?'} samples "
                          f"per data-parallel rank (global batch {f'{batch:,}' if batch else '?'}); the rank's "
                          "figures are per micro-batch, job totals per step"))
    replicated = plan.get("replicated")
    if replicated is not None:
        extra = sum(item["extra_flops"] for item in replicated)
        lines.append(_row("replicated work:", "none: the tp ranks together run the unsharded model's FLOPs" if not extra else
                          f"{extra:,} flops per micro-batch and tp group above the unsharded model's "
                          f"({len(replicated)} module{'s' if len(replicated) != 1 else ''} run on each tp rank)"))
        for item in replicated[:8]:
            how = f"whole on each of {item['ranks']} tp ranks" if item["whole"] else f"more than 1/{item['ranks']} on each"
            lines.append(_row(f"  {item['module']}:", f"{item['flops']:,} flops per rank, {how} ({item['role']})"))
        if len(replicated) > 8:
            lines.append(_row("  ...", f"{len(replicated) - 8} more (Estimate.parallel['replicated'])"))
    return lines
