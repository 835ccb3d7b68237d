"""DDP's gradient buckets: the all-reduces a DistributedDataParallel job really runs, one per bucket.

A what-if plan's DDP (`fsdp=False`) is torch's replicate() on each repeated block and the root, which
all-reduces each unit's gradients at once. torch's DistributedDataParallel instead packs the gradients into
buckets and all-reduces each bucket as soon as all its gradients are ready, buckets in order. After its
first iteration the Reducer rebuilds the buckets from the order the gradients became ready
(Reducer::rebuild_buckets -> compute_bucket_assignment_by_size in torch/csrc/distributed/c10d/reducer.cpp,
`torch.distributed._compute_bucket_assignment_by_size` from Python): walking the gradients in that order,
per dtype, a bucket is closed as soon as its bytes reach the limit, the first bucket's limit being 1 MiB
(`dist._DEFAULT_FIRST_BUCKET_BYTES`) when `bucket_cap_mb` is DDP's default 25, and every bucket's
`bucket_cap_mb` MiB when it is given. The gradients' order here is the reverse of the parameters'
registration order (DDP's own assumption before its first backward: the layers defined first are used
first, their gradients ready last); where autograd makes a module's gradients in another order (a
block's w1/w3 after its w2) a bucket boundary can fall elsewhere than in the real job, the bytes not.
Each bucket is one all-reduce, recorded for the module whose gradient completes it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fxflops.parallel.collectives import wire_bytes
from fxflops.results.parallel import ALL_REDUCE, Collective

MIB = 1 << 20
DEFAULT_CAP_MB = 25  # torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB
FIRST_BUCKET_BYTES = MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, with the default cap only


@dataclass(frozen=True)
class Gradient:
    """One parameter's gradient on this rank: its name, the data-parallel unit that reduces it, its local
    bytes (a tensor-parallel shard's) and dtype."""

    name: str
    unit: str
    bytes: int
    dtype: str
    group: str = ""  # the process group the unit reduces it over

    @property
    def module(self) -> str:
        """The module holding the parameter."""
        return self.name.rpartition(".")[0]


def check_bucket_cap(cap_mb: object, where: str = "") -> None:
    """Raise where `cap_mb` is no bucket size DDP could use (a finite number of MiB > 0); `where` starts the
    message ("parallel plan: ")."""
    if isinstance(cap_mb, bool) or not isinstance(cap_mb, int | float) or not math.isfinite(cap_mb) or cap_mb <= 0:
        raise ValueError(f"{where}bucket_cap_mb must be a finite number of MiB > 0 (DDP's gradient bucket size); "
                         f"got {cap_mb!r}")


def bucket_limits(cap_mb: float | None) -> list[int]:
    """The bucket byte limits DDP's Reducer walks (the last one repeats): DDP's defaults, or `cap_mb` for all."""
    if cap_mb is None:
        return [FIRST_BUCKET_BYTES, DEFAULT_CAP_MB * MIB]
    return [int(cap_mb * MIB)]


def assign_buckets(gradients: list[Gradient], limits: list[int]) -> list[list[int]]:
    """Indices into `gradients` (in the order they become ready) per bucket, in the order the buckets are
    reduced: reducer.cpp's compute_bucket_assignment_by_size given the ready order (one open bucket per
    dtype, closed once its bytes reach its limit; the limits advance per dtype, the last one repeats)."""
    open_buckets: dict[str, tuple[list[int], int]] = {}
    limit_at: dict[str, int] = {}
    closed: list[list[int]] = []
    for index, gradient in enumerate(gradients):
        indices, size = open_buckets.get(gradient.dtype, ([], 0))
        indices, size = [*indices, index], size + gradient.bytes
        at = limit_at.setdefault(gradient.dtype, 0)
        if size >= limits[at]:
            closed.append(indices)
            open_buckets.pop(gradient.dtype, None)
            limit_at[gradient.dtype] = min(at + 1, len(limits) - 1)
        else:
            open_buckets[gradient.dtype] = (indices, size)
    return closed + sorted((indices for indices, _ in open_buckets.values()), key=min)


def bucketed(collectives: list[Collective], gradients: list[Gradient], cap_mb: float | None,
             held: set[str] | None = None) -> list[Collective]:
    """The collectives with DDP's per-unit gradient all-reduces (per_step, over the groups `gradients`
    name) replaced by DDP's bucket all-reduces over the same groups: the gradients of the modules in `held`
    (a pipeline rank's: its stages'; None: all), per group, in reverse registration order, bucketed as DDP's
    Reducer does. A bucket is recorded for the module holding the gradient that completes it, at the first
    unit all-reduce whose gradients are all ready by then (a unit reduces once its last gradient is ready:
    the head's bucket goes before the last block's, the embedding's at the end). A group whose all-reduces
    do not carry exactly those gradients' bytes is left as recorded."""
    groups = {gradient.group for gradient in gradients}
    records = [c for c in collectives if c.op == ALL_REDUCE and c.per_step and c.group in groups]
    replaced: dict[int, list[Collective]] = {}  # id(unit all-reduce) -> the buckets recorded there
    for group in dict.fromkeys(c.group for c in records):
        mine = [g for g in reversed(gradients) if g.group == group and (held is None or g.module in held)]
        theirs = [c for c in records if c.group == group]
        record_of = _unit_records(mine, theirs)
        if record_of is None:
            continue
        ready = {g.unit: index for index, g in enumerate(mine)}  # a unit's last gradient, in ready order
        by_time = sorted(ready, key=ready.__getitem__)
        for c in theirs:
            replaced[id(c)] = []
        for indices in assign_buckets(mine, bucket_limits(cap_mb)):
            last = mine[indices[-1]]
            unit = record_of[next(unit for unit in by_time if ready[unit] >= indices[-1])]
            size = sum(mine[i].bytes for i in indices)
            replaced[id(unit)].append(dataclasses.replace(
                unit, module=last.module, dtype=last.dtype, bytes=size,
                wire_bytes=wire_bytes(ALL_REDUCE, size, unit.group_size)))
    found: list[Collective] = []
    for c in collectives:
        found += replaced.get(id(c), [c])
    return found


def _unit_records(gradients: list[Gradient], records: list[Collective]) -> dict[str, Collective] | None:
    """Each unit's gradient all-reduce: the one recorded at the unit, else (a unit reduced from the root's
    final callback, as an embedding fed integer ids is: recorded at the root) the next one no unit claims;
    None where the all-reduces do not carry exactly the gradients' bytes."""
    if not gradients or sum(g.bytes for g in gradients) != sum(c.bytes for c in records):
        return None
    units = list(dict.fromkeys(g.unit for g in gradients))
    named = {c.module: c for c in records if c.module in units}
    spare = iter([c for c in records if c.module not in named])
    found = {unit: named.get(unit) or next(spare, None) for unit in units}
    return None if None in found.values() else found
