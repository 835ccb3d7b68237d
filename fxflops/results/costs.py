"""What count and tree produce: per-node costs, per-op and per-module totals, unknown ops.

`count` fills one `NodeCost` per graph node (counted, zero or unknown: the status constants);
`tree` sums them into `OpTotals` per op and per rule, `ModuleStats` per module (inclusive and
exclusive) and the `UnknownOp` list. Attention ops are read both ways (`AttentionTotals`), and an
optimizer step's elementwise FLOPs are an `OptimizerStep`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fxflops.results.captured import FORWARD

COUNTED = "counted"
ZERO = "zero"
UNKNOWN = "unknown"
ROOT_LABEL = "(root)"  # how reports, messages and traces name the model itself (qualified name "")
UNKNOWN_RULE = "(unknown)"  # the per-rule key of the op nodes no rule or zero list matched


@dataclass(frozen=True)
class FusedCall:
    """A forward op that one call of a composite ran, where CUDA runs the call as one fused kernel (see
    fxflops.capture.recorder.FUSED_COMPOSITES): which call, the op's place in it, and the element sizes of what
    the fused kernel reads and writes, which the decomposition's own ops (upcast to fp32) do not tell. Its sizes
    come from the ops' shapes (the first op's first input is the call's input)."""

    kind: str  # the composite: "rms_norm"
    call: int  # its call's number in the capture (a replayed block's copies keep their reference's)
    step: int  # the op's place among the call's recorded ops, from 0
    input_item: int  # element sizes in bytes: the input's, the weight's (0 without a weight), the output's
    weight_item: int
    output_item: int


@dataclass(frozen=True)
class NodeCost:
    """The cost of one graph node and where it sits in the module hierarchy."""

    name: str  # FX node name
    op: str  # canonical op key, e.g. "aten.linear.default", "torch.nn.Conv2d", "operator.matmul"
    status: str  # COUNTED | ZERO | UNKNOWN
    rule: str | None  # name of the rule that counted it (or the zero list), None when unknown
    module: str  # qualified name of the innermost module ("" = the root model)
    module_type: str  # class name of that module
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    macs: int
    flops: int
    source: str | None = None  # the user's source line that produced the op, when known
    phase: str = FORWARD  # FORWARD, BACKWARD or RECOMPUTE
    differentiates: str | None = None  # a backward op: the name of the forward node it differentiates
    bytes: int = 0  # memory read (each distinct input once) plus written (each output), see fxflops.traffic
    # attention ops (rules with effective formulas): macs/flops above are the estimate's reading of
    # them; both readings and what the mask keeps ("causal", "sliding window 4096", "mask from data")
    attention: str | None = None
    dense_macs: int | None = None
    dense_flops: int | None = None
    effective_macs: int | None = None  # None: the kept pairs depend on data (macs/flops are dense)
    effective_flops: int | None = None
    kept_pairs: Any = None  # the (query, key) pairs its mask keeps over B·Hq·Lq·Lk (None: every pair, or data)
    # a forward op one call of a composite ran that CUDA runs as one fused kernel (rms_norm): the time model
    # times the call's ops, and their backward's, as one kernel each; counts are the ops' own
    fused_call: FusedCall | None = None
    # a batch norm or convolution whose 4-D/5-D activation is channels-last in memory (strides[1] == 1), as the capture's
    # fake tensors carry it: torch's CUDA batch norm then launches its channels-last kernels, and cuDNN converts nothing
    channels_last: bool = False
    # a layer norm's tensor inputs (by position) that are not contiguous in memory, as the capture's fake tensors carry
    # them: torch's CUDA layer norm copies each one to a contiguous tensor first (cuda_kernels.layer_norm_launches)
    strided_inputs: tuple[int, ...] = ()

    @property
    def rule_key(self) -> str:
        """The node's key in per-rule totals: its rule, or UNKNOWN_RULE."""
        return self.rule or UNKNOWN_RULE

    @property
    def is_backward(self) -> bool:
        """Work of the backward pass (recomputed forwards included)."""
        return self.phase != FORWARD


@dataclass(frozen=True)
class OpTotals:
    """The totals of the nodes that share an op (or a rule): their count, MACs and FLOPs."""

    count: int
    macs: int  # forward + backward
    flops: int
    bwd_macs: int = 0  # the backward's share (recomputed forwards included)
    bwd_flops: int = 0
    statuses: tuple[str, ...] = ()  # how its nodes were counted: "counted", "zero", "unknown", sorted


@dataclass(frozen=True)
class AttentionTotals:
    """Attention ops read both ways, summed from their nodes (forward + backward): dense counts every
    (query, key) pair, effective only those the masks keep; where a mask is data (`unknown` nodes) its
    dense count stands in the effective total."""

    dense_macs: int
    dense_flops: int
    effective_macs: int
    effective_flops: int
    nodes: int  # attention op nodes
    unknown: int  # of them, nodes whose kept pairs depend on data
    patterns: tuple[str, ...]  # what their masks keep, distinct, first seen first ("causal", ...)

    @property
    def differ(self) -> bool:
        """Whether the two readings give different totals (or one is not known)."""
        return self.dense_flops != self.effective_flops or self.dense_macs != self.effective_macs or self.unknown > 0


def attention_totals(nodes: list[NodeCost]) -> AttentionTotals | None:
    """Both readings of the attention ops among `nodes`; None when there are none."""
    found = [node for node in nodes if node.attention is not None]
    if not found:
        return None
    unknown = [node for node in found if node.effective_macs is None]
    return AttentionTotals(
        dense_macs=sum(node.dense_macs for node in found),
        dense_flops=sum(node.dense_flops for node in found),
        effective_macs=sum(node.dense_macs if node.effective_macs is None else node.effective_macs for node in found),
        effective_flops=sum(node.dense_flops if node.effective_flops is None else node.effective_flops for node in found),
        nodes=len(found),
        unknown=len(unknown),
        patterns=tuple(dict.fromkeys(node.attention for node in found)),
    )


@dataclass(frozen=True)
class UnknownOp:
    """An op no rule counts and no zero list declares: reported, never silently 0."""

    op: str
    count: int
    modules: tuple[str, ...]


@dataclass
class ModuleStats:
    """One module of the hierarchy. MACs/FLOPs are inclusive; self_* excludes submodules."""

    name: str  # qualified name, "" for the root
    type: str  # class name
    depth: int  # root = 0
    params: int  # parameters of this module and its submodules, each counted once at its first owner
    macs: int
    flops: int
    self_macs: int
    self_flops: int
    calls: int  # how many times the module's forward ran in the captured graph
    extra_repr: str = ""
    children: list[str] = field(default_factory=list)  # qualified names, definition order
    latency: float | None = None  # seconds per forward step (all calls summed), when measured
    latency_calls: int | None = None  # forward calls seen by the timed pass per step
    bwd_macs: int = 0  # inclusive, the backward's share of macs (0 unless the backward was counted)
    bwd_flops: int = 0
    bwd_latency: float | None = None  # seconds per backward step, when measured
    self_bwd_macs: int = 0  # the backward's share of self_macs / self_flops
    self_bwd_flops: int = 0
    bytes: int = 0  # inclusive memory traffic: bytes its ops read and write (fxflops.traffic)
    self_bytes: int = 0
    # tied weights under this module that `params` leaves out because an earlier module (in definition
    # order) holds them: name relative to this module -> the first owner's qualified parameter name
    shared: dict[str, str] = field(default_factory=dict)

    @property
    def intensity(self) -> float | None:
        """Arithmetic intensity: FLOPs per byte moved (None when nothing is moved)."""
        return self.flops / self.bytes if self.bytes else None

    @property
    def fwd_macs(self) -> int:
        return self.macs - self.bwd_macs

    @property
    def fwd_flops(self) -> int:
        return self.flops - self.bwd_flops

    @property
    def bwd_fwd_ratio(self) -> float | None:
        """Backward FLOPs / forward FLOPs (None without forward FLOPs)."""
        return self.bwd_flops / self.fwd_flops if self.fwd_flops else None

    @property
    def achieved_bwd_flops(self) -> float | None:
        """Backward FLOP/s achieved by this module, when its backward was timed."""
        if not self.bwd_latency:
            return None
        return self.bwd_flops / self.bwd_latency

    @property
    def achieved_flops(self) -> float | None:
        """FLOP/s achieved by this module, when its latency was measured."""
        if not self.latency:
            return None
        return self.fwd_flops / self.latency


@dataclass(frozen=True)
class OptimizerStep:
    """The elementwise FLOPs of one optimizer step over the trainable parameters."""

    name: str  # "sgd", "adam", "adamw", ...
    params: int  # trainable parameter elements it updates
    flops_per_param: int
    flops: int
    formula: str  # how flops_per_param was derived
