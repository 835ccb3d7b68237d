"""The Estimate: one forward's (and backward's) MACs, FLOPs and params over the module hierarchy.

An `Estimate` holds the per-node costs and the per-module, per-op and per-rule totals summed from
them, with the questions it answers (`explain`, `compare`, `predict`) and its outputs (`print`,
`to_json`, `to_csv`, `to_html`), each rendered by `fxflops.report` and imported on use. A `Profile`
is an Estimate whose modules carry the latencies a timed pass measured (`Measurements`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fxflops.spelling import spelled_keywords
from fxflops.results.costs import (
    COUNTED,
    UNKNOWN,
    ZERO,
    AttentionTotals,
    ModuleStats,
    NodeCost,
    OpTotals,
    OptimizerStep,
    UnknownOp,
    attention_totals,
)

if TYPE_CHECKING:
    from fxflops.results.parallel import Collective, RankRole
    import networkx as nx


class Deferred:
    """A field's value given as the function that makes it from the record it is in (`make(record)`):
    made on the field's first read, then kept. A sweep's point fills its totals at once and its
    per-module and per-node tables this way, so a caller that reads only the totals pays only for
    them. (The record is passed, not closed over: a closure over it would make every point a
    reference cycle for the garbage collector.)"""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[Any], Any]) -> None:
        self.make = make


_REQUIRED = object()


class _DeferredField:
    """A dataclass field that may hold a Deferred (resolved on first read), or, given `derive`, be left
    None and derived from the rest of the record on first read (the module tree from the modules)."""

    def __init__(self, default: Any = _REQUIRED, derive: Callable[[Any], Any] | None = None) -> None:
        self._default = None if derive is not None else default
        self._derive = derive

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            if self._default is _REQUIRED:
                raise AttributeError(self._name)  # no class-level value: dataclass makes the field required
            return self._default
        value = obj.__dict__[self._name]
        if type(value) is Deferred:
            value = obj.__dict__[self._name] = value.make(obj)
        elif value is None and self._derive is not None:
            value = obj.__dict__[self._name] = self._derive(obj)
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self._name] = value


def module_tree(modules: dict[str, ModuleStats]) -> nx.DiGraph:
    """Parent -> child edges over qualified names; each node carries its ModuleStats as "stats".

    networkx is imported here, when a tree is first asked for: it costs ~0.25 s to import, and a count
    needs no graph algorithm."""
    import networkx as nx

    tree = nx.DiGraph()
    for name, stats in modules.items():
        tree.add_node(name, stats=stats)
        for child in stats.children:
            tree.add_edge(name, child)
    return tree

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


@dataclass(repr=False)  # its own one-line __repr__ below (the generated one, 33 fields, went unused)
class Estimate:
    """Static MAC/FLOP/param estimate of one forward, attributed to the module hierarchy."""

    model_type: str
    method: str  # a name from fxflops.capture.methods.METHODS: "eager" | "export" | "symbolic" | "trace"
    conventions: str  # the counting preset: a name of fxflops.CONVENTIONS (rules/presets.toml)
    total_macs: int
    total_flops: int
    total_params: int
    # the tables may be given as Deferred (made on first read): a sweep's point does
    modules: dict[str, ModuleStats] = _DeferredField()  # qualified name -> stats, pre-order (parents first)
    nodes: list[NodeCost] = _DeferredField()
    by_op: dict[str, OpTotals] = _DeferredField()
    by_rule: dict[str, OpTotals] = _DeferredField()
    unknown: list[UnknownOp] = _DeferredField()
    # edges parent -> child over qualified names, node attr "stats": made from `modules` on first read
    tree: nx.DiGraph = _DeferredField(derive=lambda estimate: module_tree(estimate.modules))
    input_shapes: Any = _DeferredField(default=())  # (args, kwargs) with every tensor replaced by its shape
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
    memory: Any = None  # a fxflops.memory.MemoryEstimate when estimate(memory=...) asked for it
    # every collective call of the counted rank (fxflops.parallel.collectives), in execution order
    collectives: list[Collective] = field(default_factory=list)
    # a what-if parallel plan (estimate(..., parallel=...)): the plan as {"tp": 8, ...}, and one role per
    # set of ranks that run the same ops; this estimate is the first role's rank
    parallel: dict[str, Any] | None = None
    ranks: list[RankRole] = field(default_factory=list)

    def __getstate__(self) -> dict[str, Any]:
        # the capture behind explain()/compare() holds graph modules (and, under symbolic tracing, the
        # model's own parameters): a pickled or copied Estimate is its numbers, without them
        state = dict(self.__dict__)
        state["source"] = None
        for name, value in state.items():
            if type(value) is Deferred:
                state[name] = getattr(self, name)
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
    def collective_bytes(self) -> int:
        """Payload bytes of every collective the counted rank calls in one step (see Collective.bytes)."""
        return sum(c.bytes for c in self.collectives)

    @property
    def collective_wire_bytes(self) -> int:
        """Bytes the counted rank puts on the wire in one step (ring algorithms, see Collective.wire_bytes)."""
        return sum(c.wire_bytes for c in self.collectives)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step and data-parallel rank under a plan (gradient accumulation steps,
        a pipeline's micro-batches); 1 without one. Every per-rank figure is of one micro-batch."""
        return (self.parallel or {}).get("microbatches") or 1

    @property
    def job_flops(self) -> int:
        """FLOPs of every rank of the plan together per optimizer step: each role's FLOPs per micro-batch x
        its ranks x micro_batches (this estimate's total_flops without a plan)."""
        if not self.ranks:
            return self.total_flops
        return self.micro_batches * sum(r.estimate.total_flops * len(r.ranks) for r in self.ranks)

    @property
    def job_collective_wire_bytes(self) -> int:
        """Bytes every rank of the plan puts on the wire together per optimizer step: each collective once per
        micro-batch, the data-parallel gradient reductions once per step (Collective.per_step)."""
        if not self.ranks:
            return self.collective_wire_bytes
        n = self.micro_batches
        return sum(len(r.ranks) * sum(c.wire_bytes * (1 if c.per_step else n) for c in r.estimate.collectives)
                   for r in self.ranks)

    def collective_totals(self, by: str = "op") -> dict[Any, dict[str, int]]:
        """{"count", "bytes", "wire_bytes"} per value of a Collective field (`by`: "op", "module", "phase",
        "group", "group_desc"; or a tuple of them), in first-call order."""
        keys = (by,) if isinstance(by, str) else tuple(by)
        totals: dict[Any, dict[str, int]] = {}
        for c in self.collectives:
            key = getattr(c, keys[0]) if len(keys) == 1 else tuple(getattr(c, k) for k in keys)
            entry = totals.setdefault(key, {"count": 0, "bytes": 0, "wire_bytes": 0})
            entry["count"] += 1
            entry["bytes"] += c.bytes
            entry["wire_bytes"] += c.wire_bytes
        return totals

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
    @spelled_keywords
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
