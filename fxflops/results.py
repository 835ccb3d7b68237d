"""Plain result records every stage hands to the next: per-node costs, per-module stats, the Estimate.

These are data only. `count` fills NodeCost, `tree` fills ModuleStats and the Estimate, `latency`
fills Measurements and ModuleStats.latency, and `report` reads them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import networkx as nx

if TYPE_CHECKING:
    import torch

COUNTED = "counted"
ZERO = "zero"
UNKNOWN = "unknown"
ROOT_LABEL = "(root)"  # how reports, messages and traces name the model itself (qualified name "")
UNKNOWN_RULE = "(unknown)"  # the per-rule key of the op nodes no rule or zero list matched

# which pass ran an op
FORWARD = "forward"
BACKWARD = "backward"
RECOMPUTE = "recompute"  # a forward run again inside the backward (activation checkpointing): backward work
PHASE = "fxflops_phase"  # node.meta key holding the phase, in graphs captured with the backward


# --- what capture hands to count -----------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """One capture method that failed: why, and where (module, op, the user's source line)."""

    method: str
    reason: str
    module: str | None = None  # qualified name of the module whose forward raised, when known
    source: str | None = None  # "file:line: code" of the user's line where capture broke
    op: str | None = None  # the op being run when it broke, when known


@dataclass(frozen=True)
class WholeCall:
    """One call of a module that a rule counts as a whole: the module, its inputs and its output."""

    module: str  # qualified name
    target: Any  # the nn.Module itself, whose attributes the rule's formula reads
    args: tuple
    kwargs: dict
    out: Any
    phase: str = FORWARD  # RECOMPUTE when activation checkpointing ran it again in the backward


@dataclass(frozen=True)
class ModuleInfo:
    """One module of the model as the captured forward saw it (lazy modules materialized)."""

    type: str  # class name
    extra_repr: str
    children: tuple[str, ...]  # qualified names, definition order
    params: int  # parameters of this module and its submodules, shared ones once


@dataclass
class Captured:
    """A captured graph plus what the later stages need to attribute it.

    Every op node of `graph_module` carries meta["val"] (fake or meta values: shapes, no data) and
    meta["fxflops_module"] = (qualified name, class name) of the innermost module that ran it.
    """

    graph_module: torch.fx.GraphModule
    method: str  # a name from fxflops.capture.methods.METHODS
    modules: dict[str, ModuleInfo]  # qualified name -> module, pre-order, each module by its first name
    aliases: dict[str, str]  # second and later names of a module registered twice -> its first name
    module_calls: dict[str, int]  # qualified name -> forward calls seen while capturing
    whole_paths: frozenset[str] = frozenset()  # modules a rule counts as a whole
    whole_calls: list[WholeCall] = field(default_factory=list)  # their calls, inputs and outputs
    input_shapes: Any = ()  # (args, kwargs) with every tensor replaced by its shape
    attempts: list[Attempt] = field(default_factory=list)  # failed attempts before this one
    dtype: str | None = None  # the model's floating dtype as captured ("float32", "bfloat16")
    training: bool | None = None  # the model's training flag as captured (dropout, batch norm count differently)
    cautions: list[str] = field(default_factory=list)  # what a real forward would do differently (lookups)
    backward: bool = False  # the graph holds the backward too (nodes carry meta["fxflops_phase"])
    sizes: Any = None  # capture.dynamic.SizeSymbols when named sizes were symbolic, else None


@dataclass(frozen=True)
class CountSource:
    """What an Estimate was counted from: its capture and the rule table (ours plus the user's)."""

    captured: Captured
    table: Any  # fxflops.rules.RuleTable


# --- what count and tree produce ------------------------------------------------------------------


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
    params: int  # parameters owned by this module and its submodules, shared ones once
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


@dataclass
class Measurements:
    """What a timed eager pass adds to an estimate. Times are seconds; None = not measured."""

    device: str  # "cpu", "cuda:0", ...
    device_name: str  # e.g. "NVIDIA H100 80GB HBM3" or the CPU model
    timer: str  # "cuda-event" | "perf_counter"
    warm_up: int
    steps: int
    fwd_latency: float  # mean whole-model forward latency measured outside the hooks
    fwd_latency_min: float
    fwd_latency_median: float
    fwd_latency_max: float
    hooked_fwd_latency: float | None = None  # mean forward latency with per-module hooks on
    peak_flops: float | None = None  # device peak used for utilization
    peak_flops_source: str | None = None  # "table: H100 SXM bf16 dense", "user"
    batch_size: int | None = None
    bwd_latency: float | None = None
    step_latency: float | None = None
    iter_latency: float | None = None
    world_size: int | None = None
    dp_size: int | None = None
    mp_size: int | None = None
    unmatched_measured: tuple[str, ...] = ()  # modules that ran but have no graph counterpart
    unmatched_graph: tuple[str, ...] = ()  # graph modules the timed pass never saw run
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hook_overhead(self) -> float | None:
        """Hooked / plain forward latency (1.0 = the hooks cost nothing)."""
        if self.hooked_fwd_latency is None or not self.fwd_latency:
            return None
        return self.hooked_fwd_latency / self.fwd_latency


@dataclass
class Estimate:
    """Static MAC/FLOP/param estimate of one forward, attributed to the module hierarchy."""

    model_type: str
    method: str  # a name from fxflops.capture.methods.METHODS: "eager" | "export" | "symbolic" | "trace"
    conventions: str  # the counting preset: a name of fxflops.CONVENTIONS (rules/presets.toml)
    total_macs: int
    total_flops: int
    total_params: int
    modules: dict[str, ModuleStats]  # qualified name -> stats, pre-order (parents first)
    nodes: list[NodeCost]
    by_op: dict[str, OpTotals]
    by_rule: dict[str, OpTotals]
    unknown: list[UnknownOp]
    tree: nx.DiGraph  # edges parent -> child over qualified names; node attr "stats"
    input_shapes: Any = ()  # (args, kwargs) with every tensor replaced by its shape
    attempts: list[tuple[str, str]] = field(default_factory=list)  # (method, failure) before success
    measurements: Measurements | None = None
    dtype: str | None = None  # the model's floating dtype as counted
    training: bool | None = None  # the model's training flag as counted
    backward: bool = False  # the backward was counted: total_* = fwd_* + bwd_*
    bwd_macs: int = 0
    bwd_flops: int = 0
    optimizer: OptimizerStep | None = None  # the optimizer step, when asked for (not in total_*)
    # what the inputs a run of the model saw were, when not the caller's own (e.g. the CLI's zeros)
    input_values: str | None = None
    cautions: list[str] = field(default_factory=list)  # what a real forward would do differently
    aliases: dict[str, str] = field(default_factory=dict)  # a shared module's other paths -> its first name
    # a fxflops.device.roofline.Prediction the reports show (predicted latency, bound); set by whoever asks for it
    prediction: Any = None
    # node_status_counts() of an estimate read back without its per-node costs (JSON without nodes)
    saved_node_status: dict[str, int] | None = None
    # the capture and rule table it was counted from (a CountSource), which explain() and compare()
    # count again; None for an estimate read back from JSON or evaluated at a sweep point
    source: Any = field(default=None, repr=False, compare=False)
    attention: str = "dense"  # how attention ops are in the totals: "dense" or "effective" (see attention_totals)
    saved_attention: AttentionTotals | None = None  # attention_totals() of an estimate read back without nodes

    def __getstate__(self) -> dict[str, Any]:
        # the capture behind explain()/compare() holds graph modules (and, under symbolic tracing, the
        # model's own parameters): a pickled or copied Estimate is its numbers, without them
        state = dict(self.__dict__)
        state["source"] = None
        return state

    def attention_totals(self) -> AttentionTotals | None:
        """Attention's dense and effective MACs/FLOPs side by side (None without attention ops)."""
        if not self.nodes and self.saved_attention is not None:
            return self.saved_attention
        return attention_totals(self.nodes)

    @property
    def root(self) -> ModuleStats:
        return self.modules[""]

    @property
    def total_bytes(self) -> int:
        """Bytes read and written by every op (each op's inputs once, its outputs once)."""
        return self.root.bytes

    @property
    def intensity(self) -> float | None:
        """The whole model's arithmetic intensity: FLOPs per byte moved."""
        return self.root.intensity

    @property
    def fwd_macs(self) -> int:
        return self.total_macs - self.bwd_macs

    @property
    def fwd_flops(self) -> int:
        return self.total_flops - self.bwd_flops

    @property
    def bwd_fwd_ratio(self) -> float | None:
        """Backward FLOPs / forward FLOPs: 2.0 is the usual rule of thumb, rarely exact."""
        return self.bwd_flops / self.fwd_flops if self.backward and self.fwd_flops else None

    def __repr__(self) -> str:
        # one line: the dataclass default prints every node and module (100+ KB in a notebook)
        return (f"{type(self).__name__}(model={self.model_type}, method={self.method}, "
                f"conventions={self.conventions}, macs={self.total_macs:_}, flops={self.total_flops:_}, "
                + (f"bwd_flops={self.bwd_flops:_}, " if self.backward else "")
                + f"params={self.total_params:_}, modules={len(self.modules)}, nodes={len(self.nodes)}, "
                f"unknown ops={sum(u.count for u in self.unknown)})")

    def statuses(self, by: str = "op") -> dict[str, str]:
        """"counted", "zero" or "unknown" ("/"-joined when mixed) per op key (`by="op"`) or rule name
        (`by="rule"`)."""
        totals = self.by_op if by == "op" else self.by_rule
        return {key: "/".join(value.statuses) for key, value in totals.items()}

    def node_status_counts(self) -> dict[str, int]:
        """How many graph nodes were counted by a rule, declared zero, or unknown."""
        if not self.nodes and self.saved_node_status is not None:
            return dict(self.saved_node_status)
        counts = {COUNTED: 0, ZERO: 0, UNKNOWN: 0}
        for node in self.nodes:
            counts[node.status] += 1
        return counts

    def predict(self, device: str | None = None, *, dtype: Any = None, peak_flops: float | None = None,
                bandwidth: float | None = None) -> Any:
        """The roofline latency of every module (a fxflops.device.roofline.Prediction): each op takes
        max(flops / peak, bytes / bandwidth) on `device` ("H100 SXM"; default the current GPU), in
        `dtype` (default the model's), or on the given peak_flops (FLOP/s) and bandwidth (bytes/s)."""
        from fxflops.device.roofline import predict

        return predict(self, device, dtype=dtype, peak_flops=peak_flops, bandwidth=bandwidth)

    # Rendering lives in fxflops.report; imported lazily because report imports this module.
    def print(
        self,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
        as_string: bool = False,
        fold: bool = True,
        by_rule: bool = True,
    ) -> str | None:
        """DeepSpeed-style text report (see `fxflops.report.text`)."""
        from fxflops.report.text import text

        return text(
            self,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
            as_string=as_string,
            fold=fold,
            by_rule=by_rule,
        )

    def explain(self, name: str = "") -> Any:
        """Why module `name` (or the op node called `name`) costs what it does: for each op, the rule,
        its formulas as written, the values their names took and the result; zero-cost ops by the list
        that declared them; unknown ops with a rule stub that counts them (a fxflops.explain.Explanation,
        whose str() reads as a report)."""
        from fxflops.explain import explain

        return explain(self, name)

    def compare(self, presets: Any = None) -> Any:
        """The same capture counted under every preset (or those named), side by side per module and per
        op, each difference from this estimate's conventions attributed to the convention that causes it
        (a fxflops.compare.Comparison, whose str() reads as a report)."""
        from fxflops.compare import compare

        return compare(self, presets)

    def to_dict(self, include_nodes: bool = False) -> dict[str, Any]:
        """JSON-ready data, schema in `fxflops.report.machine`."""
        from fxflops.report.machine import to_dict

        return to_dict(self, include_nodes=include_nodes)

    def to_json(self, path: str | None = None, include_nodes: bool = False) -> str:
        """JSON text (also written to `path` when given)."""
        from fxflops.report.machine import to_json

        return to_json(self, path, include_nodes=include_nodes)

    def to_csv(self, path: str | None = None) -> str:
        """One CSV row per module (also written to `path` when given)."""
        from fxflops.report.machine import to_csv

        return to_csv(self, path)

    def to_html(self, path: str | None = None) -> str:
        """A self-contained HTML page: summary, a zoomable icicle of the modules, sortable tables
        (also written to `path` when given; see `fxflops.report.html`)."""
        from fxflops.report.html import to_html

        return to_html(self, path)


class Profile(Estimate):
    """An Estimate whose modules carry measured latencies (see `fxflops.profile`)."""

    @property
    def fwd_latency(self) -> float | None:
        return self.measurements.fwd_latency if self.measurements else None

    @property
    def achieved_flops(self) -> float | None:
        """Whole-model forward FLOP/s from the latency measured outside the hooks."""
        if not self.measurements or not self.measurements.fwd_latency:
            return None
        return self.fwd_flops / self.measurements.fwd_latency

    def to_chrome_trace(self, path: str) -> None:
        """Write one step's module timeline as Chrome/Perfetto trace-event JSON."""
        from fxflops.report.chrome_trace import write_chrome_trace

        write_chrome_trace(self, path)

    @property
    def utilization(self) -> float | None:
        """Achieved / peak FLOP/s, when a peak is known for the device and dtype."""
        achieved = self.achieved_flops
        if achieved is None or not self.measurements.peak_flops:
            return None
        return achieved / self.measurements.peak_flops


# --- what a sweep produces ------------------------------------------------------------------------


@dataclass
class SweepFormula:
    """Formulas of one or more of a sweep's captures (pieces with the same formulas are merged)."""

    formulas: dict[str, str]  # "macs" | "flops" | "params" (| "bwd_macs" | "bwd_flops") -> sympy text
    holds_for: list[str]  # where they hold, one line per piece merged
    conditions: list[list[str]]  # each merged piece's conditions (all must hold), checked per point


@dataclass(frozen=True)
class SweepModule:
    """One of a point's top modules: its inclusive MACs and FLOPs there."""

    name: str
    type: str
    macs: int
    flops: int


@dataclass(frozen=True)
class SweepPoint:
    """A grid point's totals, equal to `Sweep.at(**sizes)`'s: what the sweep reports show of it.
    A grid keeps these, not whole Estimates (an Estimate holds every node; a grid can hold 10,000)."""

    sizes: dict[str, int]
    macs: int  # forward + backward, as Estimate.total_macs
    flops: int
    params: int
    bwd_macs: int = 0
    bwd_flops: int = 0
    top_modules: tuple[SweepModule, ...] = ()  # the top modules at the depth asked for, by MACs
    cautions: tuple[str, ...] = ()  # what a real forward would do differently there (a lookup past a table)

    @property
    def fwd_macs(self) -> int:
        return self.macs - self.bwd_macs

    @property
    def fwd_flops(self) -> int:
        return self.flops - self.bwd_flops


@dataclass
class SweepResult:
    """A sweep's formulas and its totals at a set of points, as the reports take them."""

    model_type: str
    names: tuple[str, ...]  # the named sizes, in the order the user gave them
    example: dict[str, int]  # the example inputs' sizes
    formulas: list[SweepFormula]  # the first is the formula at the example's sizes (captured first)
    points: list[SweepPoint]
    captures: int = 1  # pieces captured: more than one where a size changes the forward's path
    backward: bool = False  # the points count the backward too (bwd_macs, bwd_flops)
    depth: int = 1  # the depth of the points' top modules

    @property
    def cautions(self) -> list[str]:
        """Each distinct caution of any point (a lookup past a position table states its region)."""
        return list(dict.fromkeys(caution for point in self.points for caution in point.cautions))
