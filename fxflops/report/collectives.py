"""The text report's parallel section: the plan and its rank roles, then what the counted rank sends per
step, by phase, kind and group."""

from __future__ import annotations

from tabulate import tabulate

from fxflops.report.formats import bytes_to_string
from fxflops.report.parallel_work import step_lines
from fxflops.report.text_layout import _row
from fxflops.results import ROOT_LABEL, Collective, Estimate


def module_collectives(collectives: list[Collective]) -> dict[str, tuple[int, int, int]]:
    """Module -> (calls, payload bytes, wire bytes) of the collectives it and its submodules call
    ("" holds them all)."""
    totals: dict[str, tuple[int, int, int]] = {}
    for c in collectives:
        name = c.module
        while True:
            calls, payload, wire = totals.get(name, (0, 0, 0))
            totals[name] = (calls + 1, payload + c.bytes, wire + c.wire_bytes)
            if not name:
                break
            name = name.rpartition(".")[0]
    return totals


def plan_lines(estimate: Estimate) -> list[str]:
    """A what-if plan's degrees, its rank roles and the job's totals (nothing without a plan)."""
    plan = estimate.parallel
    if plan is None:
        return []
    degrees = ", ".join(f"{key}={plan[key]}" for key in ("pp", "dp", "cp", "tp", "ep") if plan.get(key, 1) > 1)
    options = [key for key in ("sequence_parallel", "loss_parallel") if plan.get(key)]
    dp, cp = plan.get("dp", 1), plan.get("cp", 1)
    if dp * cp > 1:  # gradients are reduced over dp x cp (cp's ranks hold other positions of the same samples)
        over = "" if cp == 1 else " over cp" if dp == 1 else " over dp x cp"
        if plan.get("fsdp", True):
            options.append(f"FSDP2{over}, reshard_after_forward={plan.get('reshard_after_forward')}")
        else:
            cap = plan.get("bucket_cap_mb")
            buckets = f"of {cap} MiB" if cap is not None else "(DDP's default: 1 MiB first, then 25 MiB)"
            options.append(f"DDP (torch's replicate){over}, gradients all-reduced in DDP's buckets {buckets}")
    ranks = sum(len(role.ranks) for role in estimate.ranks)
    lines = ["", "Parallel plan (what if; torch.distributed's fake process group):",
             _row("plan:", f"{degrees or 'one rank'}{' (' + '; '.join(options) + ')' if options else ''}, {ranks:,} ranks"),
             _row("counted rank:", "rank 0; the figures above are this rank's local work")]
    for role in estimate.ranks:
        lines.append(_row(f"rank role '{role.name}':", f"{len(role.ranks):,} ranks, {role.estimate.total_flops:,} flops each"))
    lines += step_lines(estimate)
    lines.append(_row("job flops (every rank):", f"{estimate.job_flops:,}"))
    lines.append(_row("job wire bytes (every rank):", bytes_to_string(estimate.job_collective_wire_bytes)))
    return lines


def collective_lines(estimate: Estimate) -> list[str]:
    """The plan (if any); collective totals, then one row per (phase, collective, process group): calls,
    payload and wire bytes, and the modules that call it. Nothing without a plan or collectives."""
    if not estimate.collectives:
        return plan_lines(estimate)
    lines = plan_lines(estimate) + ["", "Collectives of this rank per step (under a plan: per micro-batch; payload = the buffer per rank; "
                                         "wire = bytes sent, ring algorithms):",
             _row("collective calls:", f"{len(estimate.collectives):,}"),
             _row("payload bytes:", f"{bytes_to_string(estimate.collective_bytes)} ({estimate.collective_bytes:,} B)"),
             _row("wire bytes:", f"{bytes_to_string(estimate.collective_wire_bytes)} "
                                 f"({estimate.collective_wire_bytes:,} B)")]
    modules: dict[tuple, list[str]] = {}
    for c in estimate.collectives:
        names = modules.setdefault((c.phase, c.op, c.group_desc or c.group, c.group_size), [])
        if (c.module or ROOT_LABEL) not in names:
            names.append(c.module or ROOT_LABEL)
    totals = estimate.collective_totals(("phase", "op", "group_desc", "group_size"))
    rows = []
    for key, total in totals.items():
        names = modules.get(key, [])
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} modules)" if len(names) > 3 else "")
        rows.append([key[0], key[1], key[2], key[3], total["count"], bytes_to_string(total["bytes"]),
                     bytes_to_string(total["wire_bytes"]), shown])
    lines.append(tabulate(rows, headers=["phase", "collective", "group", "ranks", "calls", "payload", "wire", "modules"],
                          tablefmt="simple"))
    return lines
