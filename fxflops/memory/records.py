"""What the memory stage hands on: a step's timeline of live tensor bytes, its peak, and the allowance.

Plain records (no torch): kinds name what a storage is, phases when it is alive. Bytes are tensor
bytes (a storage's nbytes, each storage once however many views and in-place results share it);
the allocator's share is the separate `Allowance`, never folded into `peak_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

# what a storage holds, in report order
PARAMETERS = "parameters"  # as the rank holds them: a sharded (DTensor) parameter's local shard
GATHERED = "gathered"  # FSDP's all-gathered (unsharded) parameters while a layer runs, and its all-gather buffer
BUFFERS = "buffers"
GRADIENTS = "gradients"
OPTIMIZER = "optimizer"
INPUTS = "inputs"
ACTIVATIONS = "activations"  # forward values the backward reads (autograd saves them), and the model's output
TEMPORARIES = "temporaries"  # values freed after their last use in the same pass (incl. gradients in flight)
KINDS = (PARAMETERS, GATHERED, BUFFERS, GRADIENTS, OPTIMIZER, INPUTS, ACTIVATIONS, TEMPORARIES)

# the step's phases beyond the graph's own (forward, backward, recompute)
START = "start"
OPTIMIZER_STEP = "optimizer step"

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Point:
    """The live tensor bytes while one op runs (its inputs and outputs alive together)."""

    index: int
    node: str  # graph node name, or the phase for points that are no node ("start", "optimizer step")
    op: str
    module: str  # qualified name of the module running the op ("" = the model itself)
    phase: str
    total: int
    by_kind: dict[str, int]


@dataclass(frozen=True)
class Allowance:
    """What the device needs beyond tensor bytes: stated, adjustable, never in `peak_bytes`.

    `block_bytes`: the CUDA caching allocator rounds every allocation up to 512 bytes (computed from
    the tensors alive at the peak). `context_bytes`: the CUDA context, cuBLAS/cuDNN workspaces and
    kernels loaded (~0.5 GiB is typical on a recent GPU; measure yours as memory in use after
    `torch.cuda.init()` and one matmul). `collective_bytes`: NCCL's buffers (0 on one device; a few
    hundred MiB per communicator is common). `fragmentation`: a fraction of the tensor peak the
    allocator's 2 MiB / 20 MiB segments leave unusable (0 by default: it depends on the run).
    """

    block_bytes: int = 512
    context_bytes: int = 512 * MiB
    collective_bytes: int = 0
    fragmentation: float = 0.0

    def rounding(self, sizes: list[int]) -> int:
        """Bytes the block rounding adds to storages of these sizes."""
        if self.block_bytes <= 1:
            return 0
        return sum(math.ceil(size / self.block_bytes) * self.block_bytes - size for size in sizes)


@dataclass(frozen=True)
class AllowanceBytes:
    rounding: int
    context: int
    collectives: int
    fragmentation: int

    @property
    def total(self) -> int:
        return self.rounding + self.context + self.collectives + self.fragmentation


@dataclass
class MemoryEstimate:
    """Tensor bytes one rank holds through a step (forward, backward, optimizer step), and its peak."""

    peak_bytes: int  # tensor bytes at the peak (allowance excluded)
    by_kind: dict[str, int]  # at the peak
    peak_at: Point  # where the peak is: module, phase, op
    by_module: dict[str, int]  # at the peak: bytes of activations and temporaries by the module that made them
    timeline: list[Point]
    model_states: dict[str, int]  # parameters, buffers, gradients, optimizer: the step's persistent bytes
    optimizer: str | None = None  # how the optimizer's share was found, in words
    allowance: Allowance = field(default_factory=Allowance)
    allowance_bytes: AllowanceBytes = field(default_factory=lambda: AllowanceBytes(0, 0, 0, 0))
    notes: list[str] = field(default_factory=list)  # what this estimate assumes, in words
    # activation bytes alive when the forward ends (what autograd saved), by the module that made them
    saved_by_module: dict[str, int] = field(default_factory=dict)
    device: str | None = None  # the device the step is checked against
    capacity: int | None = None  # its memory, bytes
    # the same bytes by the graph node whose op made them ("start" for those alive before the first op): a module
    # that runs ops both before and after its blocks (the model's own forward) is told apart by where they ran
    saved_by_node: dict[str, int] = field(default_factory=dict)

    @property
    def fits(self) -> bool | None:
        """Whether the peak and the allowance fit in the device's memory (None without a device)."""
        return None if self.capacity is None else self.device_bytes <= self.capacity

    @property
    def headroom(self) -> int | None:
        """Capacity left at the peak, allowance included (negative: short by that much)."""
        return None if self.capacity is None else self.capacity - self.device_bytes

    def saved_under(self, module: str) -> int:
        """Activation bytes saved at the end of the forward by `module` and its submodules."""
        prefix = module + "."
        return sum(size for name, size in self.saved_by_module.items()
                   if not module or name == module or name.startswith(prefix))

    @property
    def device_bytes(self) -> int:
        """The peak with the allowance: what the device must have free."""
        return self.peak_bytes + self.allowance_bytes.total

    def phase_peaks(self) -> dict[str, int]:
        """The highest total in each phase, in the order phases run."""
        peaks: dict[str, int] = {}
        for point in self.timeline:
            peaks[point.phase] = max(peaks.get(point.phase, 0), point.total)
        return peaks

    @cached_property
    def module_peaks(self) -> dict[str, int]:
        """The highest total tensor bytes while each module (itself or a submodule) runs an op, forward,
        backward or recompute; "" is the whole step (the optimizer step included)."""
        peaks: dict[str, int] = {}
        for point in self.timeline:
            name = "" if point.phase in (START, OPTIMIZER_STEP) else point.module
            while True:
                if peaks.get(name, -1) < point.total:
                    peaks[name] = point.total
                if not name:
                    break
                name = name.rpartition(".")[0]
        return peaks

    def to_dict(self) -> dict:
        """Raw integers for JSON, the whole timeline included (a point per op)."""
        return {
            "peak_bytes": self.peak_bytes,
            "by_kind": dict(self.by_kind),
            "peak_at": {"module": self.peak_at.module, "phase": self.peak_at.phase, "op": self.peak_at.op,
                        "node": self.peak_at.node},
            "by_module": dict(self.by_module),
            "saved_by_module": dict(self.saved_by_module),
            "model_states": dict(self.model_states),
            "phase_peaks": self.phase_peaks(),
            "module_peaks": dict(self.module_peaks),
            "kinds": list(KINDS),
            # a point per op: [index, phase, module, op, node, total, bytes per kind in "kinds" order]
            "timeline": [[p.index, p.phase, p.module, p.op, p.node, p.total, [p.by_kind.get(kind, 0) for kind in KINDS]]
                         for p in self.timeline],
            "optimizer": self.optimizer,
            "allowance": {"rounding": self.allowance_bytes.rounding, "context": self.allowance_bytes.context,
                          "collectives": self.allowance_bytes.collectives,
                          "fragmentation": self.allowance_bytes.fragmentation,
                          "total": self.allowance_bytes.total},
            "device_bytes": self.device_bytes,
            "device": self.device,
            "capacity": self.capacity,
            "fits": self.fits,
            "headroom": self.headroom,
            "notes": list(self.notes),
        }
