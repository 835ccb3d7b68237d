"""The public entry points: estimate() a model's cost, annotate() a graph someone already has."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxflops.capture import capture, inputs_from_shape, tensors_in, uncompiled
from fxflops.capture.attribution import label_modules
from fxflops.capture.input_values import routing_assumed, routing_spread
from fxflops.capture.inputs import values_from_tensor_meta
from fxflops.capture.methods import AUTO
from fxflops.capture.module_walk import walk_modules
from fxflops.collector import collector_paused
from fxflops.count import count_nodes
from fxflops.count.attention import DENSE, check_attention
from fxflops.rules.formula import clip
from fxflops.rules.table import resolve_name
from fxflops.optimizer import optimizer_step
from fxflops.parallel.collectives import collectives
from fxflops.parallel.pipelining import is_pipeline_schedule, is_pipeline_stage
from fxflops.results import ROOT_LABEL, Captured, CountSource, Estimate, NodeCost, UnknownOp
from fxflops.rules import RuleSpec, RuleTable, load_table, load_user_entries, preset, table_with
from fxflops.spelling import spelled_keywords
from fxflops.tree import build_estimate


class CautionWarning(UserWarning):
    """The count is of a forward that would not run as captured on real weights (see Estimate.cautions)."""


class UnknownOpsWarning(UserWarning):
    """Some ops in the graph matched no rule and no zero list: their cost is not in the totals."""


class UnknownOpsError(ValueError):
    """estimate(strict=True) (the CLI's --fail-on-unknown): some ops matched no rule, so the totals are
    incomplete. `unknown` lists them (op, count, modules)."""

    def __init__(self, unknown: list[UnknownOp]) -> None:
        self.unknown = list(unknown)
        super().__init__(f"{_unknown_listing(unknown)}; strict counting refuses an incomplete count. Add a rule "
                         "for them (rules=[...], the CLI's --rules) or declare them zero-cost")


# The deepest module nesting counted: Python's recursion limit is raised as far as a model needs (torch
# walks modules recursively), but the C stack is not Python's to raise, and a forward through ~4,500
# nested modules overflowed 8 MiB of it (a crash, not an exception).
MAX_MODULE_DEPTH = 2_000


@contextlib.contextmanager
def deep_enough(model: Any) -> Iterator[None]:
    """Python's recursion limit raised for the duration as far as the model's nesting needs (each level
    takes a few frames of torch's named_modules() and of a forward), then as it was; a model nested
    deeper than MAX_MODULE_DEPTH is one clear error instead of a RecursionError or a crash."""
    if not isinstance(model, torch.nn.Module):
        yield
        return
    depth = max((name.count(".") + 1 for name, _, _ in walk_modules(model) if name), default=0)
    if depth > MAX_MODULE_DEPTH:
        raise ValueError(f"{type(model).__name__} nests modules {depth} deep; fxflops counts models up to "
                         f"{MAX_MODULE_DEPTH:,} deep (deeper, a forward can overflow the C stack)")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 1000 + 8 * depth))
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


def deep_models(function: Callable, also: Iterable[str] = ()) -> Callable:
    """An entry point whose first argument is the model, run under `deep_enough(model)`; a keyword it does
    not take is a TypeError naming the closest one it does (convention= for conventions=; `also`: what a
    function taking **options passes them on to takes, see spelling.spelled_keywords)."""

    @functools.wraps(function)
    def entry(model: Any, *args: Any, **kwargs: Any) -> Any:
        with deep_enough(model):
            return function(model, *args, **kwargs)

    return spelled_keywords(entry, also)  # (the signature read is function's: wraps sets __wrapped__)


@deep_models
def estimate(
    model: torch.nn.Module,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    input_shape: Sequence[int] | Sequence[Sequence[int]] | None = None,
    method: str = AUTO,
    conventions: str = "deepspeed",
    rules: Iterable[RuleSpec] | RuleSpec | None = None,
    leaf_modules: Iterable[type | str] | None = None,
    backward: bool = False,
    loss: Callable[[Any], torch.Tensor] | None = None,
    optimizer: str | torch.optim.Optimizer | None = None,
    progress: Callable[[str], None] | None = None,
    attention: str = "dense",
    strict: bool = False,
    memory: Any = False,
    parallel: Any = None,
    routing: str | Sequence[int] | None = None,
    replay: bool = True,
) -> Estimate:
    """MACs, FLOPs and parameters of one forward of `model` (and its backward), per module, without running it.

    `args`/`kwargs` may be real or meta tensors (only their shapes and dtypes are used), or give
    `input_shape=(1, 3, 224, 224)`. `method` is "eager" (the model's own forward on fake tensors),
    "export", "symbolic", "trace" (one real forward, for control flow that depends on tensor values)
    or "auto" (each in that order). The model is left exactly as it was. `conventions` names a counting
    preset of rules/presets.toml (one of fxflops.CONVENTIONS: "deepspeed" by default; "torch" counts
    as FlopCounterMode does; others reproduce other tools). `rules` adds TOML rule files or
    {op: callable} maps; `leaf_modules` lists module classes (or qualified class names) to count as a
    whole by their rule.

    `backward=True` also counts the backward autograd would run for `loss(output)` (default: the
    output's own `loss` when it has one, else the sum of its floating tensors), op by op on fake tensors: frozen parameters get no gradient,
    activation checkpointing's recomputation counts as backward work. Then total_* = fwd_* + bwd_*.
    `optimizer` ("sgd", "adam", "adamw" or an optimizer instance) adds one step's FLOPs
    (`Estimate.optimizer`, not in total_*). `progress` is called with "capture" and "count" as
    each stage starts (the CLI shows them on a terminal).

    `attention` says how attention ops count: "dense" (every (query, key) pair, as FlopCounterMode)
    or "effective" (only the pairs the mask keeps: is_causal, sliding windows and other masks the
    model builds from positions; a mask that is data stays dense, and says so). Both readings are in
    every attention node and `Estimate.attention_totals()`.

    `strict=True` raises UnknownOpsError, naming the ops and their modules, when any op matched no rule
    (a CI check that the count is complete), instead of warning and leaving them out of the totals.

    `memory=True` (or a `fxflops.memory.MemoryOptions`) also reads the captured step as a timeline of
    live tensors: `Estimate.memory` (a `fxflops.memory.MemoryEstimate`) has the peak tensor bytes, what
    is alive there by kind, where it is, and the timeline (with `optimizer`, its state and step too).

    Inside an initialized process group (torchrun, or torch.distributed's fake one) a model sharded with
    torch's own APIs (DTensor, parallelize_module, fully_shard) counts the calling rank's local work, and
    `Estimate.collectives` lists each collective it calls with its group and bytes. `parallel` (a
    fxflops.Parallel, a dict such as {"tp": 8, "dp": 4} or text "tp=8,dp=4") estimates a plan without
    the ranks: on a fake process group, the plan applied with torch's own APIs, one capture per rank
    role (`Estimate.ranks`); `args` are then one data-parallel rank's micro-batch. A
    torch.distributed.pipelining `PipelineStage` counts its stage module on one micro-batch of its inputs,
    with the send/recv of its activations and their gradients. A pipelining schedule (`ScheduleGPipe`,
    `Schedule1F1B`, `ScheduleInterleaved1F1B` ...) stands for one `schedule.step(*args, **kwargs)` of this
    rank (`kwargs` may hold step's `target=`): its stage per micro-batch, and in `collectives` every send/recv
    the schedule's own step issues (run once on fake tensors, nothing sent), with peer, stage and micro-batch.

    Values the forward reads (`.item()`, `nonzero` on a mask) are computed from the real example inputs
    they derive from (a real tensor may stand in `input_shape=`'s list for such an input). Where they
    derive from the weights — a mixture-of-experts router's picks — `routing` says what topk is assumed
    to pick: "balanced" (default), "worst", or per-expert token counts; the cautions say which was used.

    `replay=False` runs every call of a repeated block; by default a call that provably runs the
    program an earlier call of its kind ran is copied from it instead, its backward too (the eager method;
    FXFLOPS_VERIFY_REPLAY=1 in the environment runs those calls too and warns at any difference).
    """
    if loss is not None and not backward:
        raise ValueError("loss= is what the backward differentiates: pass backward=True with it")
    _check_method(method)
    if is_pipeline_schedule(model):  # one schedule.step(*args, **kwargs) of this rank: its stages, its send/recv
        from fxflops.parallel.schedule import estimate_schedule

        def count_stage(stage: Any, stage_args: tuple, stage_kwargs: dict, stage_loss: Any,
                        stage_backward: bool) -> Estimate:
            return estimate(stage, stage_args, stage_kwargs, method=method, conventions=conventions, rules=rules,
                            leaf_modules=leaf_modules, backward=stage_backward, loss=stage_loss, progress=progress,
                            attention=attention, strict=strict, memory=memory, routing=routing, replay=replay)

        step_args = args if isinstance(args, tuple) else (args,)
        return estimate_schedule(model, step_args, dict(kwargs or {}), count_stage)
    stage = None
    if is_pipeline_stage(model):  # torch.distributed.pipelining's stage: its module, with what it sends and receives
        stage, model = model, model.submod
    args, kwargs = normalize_inputs(model, args, kwargs, input_shape)
    if stage is not None:
        from fxflops.parallel.stage import stage_inputs, stage_records  # imported on use: a pipelining stage only

        args = stage_inputs(stage, args, backward)
        result = _estimate(model, args, kwargs, method, conventions, rules, leaf_modules, backward, loss, optimizer,
                           progress, attention, strict, memory, routing=routing, replay=replay)
        result.collectives = stage_records(stage, args, result)
        return result
    model = uncompiled(model)  # a torch.compile'd model: its original module (not run through dynamo)
    if parallel is not None:
        from fxflops.parallel.whatif import estimate_plan

        # each rank steps (and holds the optimizer state of) its own shards: counted from its capture.
        # The routing named (balanced by default): a plan's capture does not capture worst-case routing beside
        # it (expert parallelism's rank roles come from one routing); routing="worst" shows that case
        count = functools.partial(_estimate, model, args, kwargs, method, conventions, rules, leaf_modules, backward,
                                  loss, optimizer, progress, attention, strict,
                                  routing="balanced" if routing is None else routing)
        # replay of repeated blocks as without a plan (the rank's forward; the unsharded capture's backward too): a
        # block carrying tensor parallelism's
        # hooks and DTensor parameters is keyed with them (capture.block_hooks), one carrying FSDP's runs.
        # Not under memory=: a copied block's values share the reference's fake storages, which the memory
        # timeline (by storage) reads as one longer life. memory= only for the whole rank (whole_memory):
        # pipeline ranks read theirs from their stages. The collector paused throughout (see collector_paused):
        # the roles' cut and the replicated-work capture allocate as much as a capture
        with collector_paused():
            return estimate_plan(model, parallel, lambda prepare, whole_memory=True: count(
                                     memory=memory if whole_memory else False, prepare=prepare,
                                     replay=replay and (prepare is None or not memory)),
                                 (args, kwargs), _stage_memory(memory, optimizer if backward else None))
    return _estimate(model, args, kwargs, method, conventions, rules, leaf_modules, backward, loss, optimizer,
                     progress, attention, strict, memory, routing=routing, replay=replay)


def _estimate(model: torch.nn.Module, args: tuple, kwargs: dict, method: str, conventions: str, rules: Any,
              leaf_modules: Any, backward: bool, loss: Any, optimizer: Any, progress: Any, attention: str,
              strict: bool, memory: Any, **capture_options: Any) -> Estimate:
    stage = progress or _no_progress
    if memory:
        # a replayed block's values share its reference's fake storages, which the memory timeline (by storage)
        # would read as one longer life: a different peak. Under memory= every call runs
        capture_options["replay"] = False
    with collector_paused():  # the rule table's first load too: a collection then cost 0.18 s
        counting = Counting.prepare(conventions, rules, leaf_modules, attention)
        stage("capture")
        captured = counting.capture(model, args, kwargs, method, backward=backward, loss=loss, **capture_options)
        stage("count")
        result = build_estimate(type(model).__name__, captured, counting.count(captured), conventions, attention)
        result.source = CountSource(captured, counting.table)
        result.collectives = collectives(captured.graph_module, result.nodes)
        if capture_options.get("routing") is None and routing_assumed(captured.cautions):
            # the spread the default (balanced) routing assumption hides
            worst = counting.capture(model, args, kwargs, method, backward=backward, loss=loss,
                                     **{**capture_options, "routing": "worst"})
            worst_flops = build_estimate(type(model).__name__, worst, counting.count(worst), conventions,
                                         attention).total_flops
            result.cautions.append(routing_spread(result.total_flops, worst_flops))
    if strict and result.unknown:
        raise UnknownOpsError(result.unknown)
    if optimizer is not None:
        result.optimizer = optimizer_step(optimizer, model, rank_parameters(captured))
    if memory:
        from fxflops.memory import MemoryOptions, estimate_memory  # imported on use: estimate's first call stays lean

        options = memory if isinstance(memory, MemoryOptions) else None
        result.memory = estimate_memory(captured, optimizer if backward else None, options)
    warn_unknown(result.unknown)
    warn_cautions(result.cautions)
    return result


def _stage_memory(memory: Any, optimizer: Any) -> Callable[..., Any] | None:
    """memory= for one pipeline stage of a capture: estimate_memory(captured, nodes=, holds=) as estimate()
    was asked for it; None without memory=."""
    if not memory:
        return None
    from fxflops.memory import MemoryOptions, estimate_memory

    options = memory if isinstance(memory, MemoryOptions) else None
    return functools.partial(estimate_memory, optimizer=optimizer, options=options)


def rank_parameters(captured: Captured) -> list[torch.Tensor] | None:
    """The local shards of a sharded (DTensor) model's parameters, as the capture held them: what one rank's
    optimizer steps; None for a model none of whose parameters is sharded (the model's own are stepped)."""
    from fxflops.capture.model_state import MODEL_STATE
    from fxflops.capture.sharded import is_dtensor

    state = captured.graph_module.meta.get(MODEL_STATE)
    if state is None or not any(is_dtensor(p) for p in state.parameters.values()):
        return None
    return [p._local_tensor if is_dtensor(p) else p for p in state.parameters.values() if p.requires_grad]


@dataclass(frozen=True)
class Counting:
    """What estimate() settles before capturing: the rule table, its conventions, and which modules
    rules count as a whole. Prepared once, it captures and counts any number of times (sweeps do)."""

    table: RuleTable
    conventions: str
    is_whole: Callable[[torch.nn.Module], bool]
    attention: str = DENSE  # how attention ops count: fxflops.count.attention.ATTENTION_READINGS

    @classmethod
    def prepare(cls, conventions: str, rules: Iterable[RuleSpec] | RuleSpec | None,
                leaf_modules: Iterable[type | str] | None, attention: str = DENSE) -> Counting:
        _check_conventions(conventions)
        _check_attention(attention)
        user_entries = load_user_entries(rules)  # each file read and checked once
        table = table_with(user_entries)
        user_table = RuleTable(user_entries) if user_entries else None
        return cls(table, conventions, _whole_predicate(user_table, leaf_modules, preset(conventions).whole_modules),
                   attention)

    def capture(self, model: torch.nn.Module, args: tuple, kwargs: dict, method: str, **options: Any) -> Captured:
        # a backward is recorded as autograd runs it, and a real forward guards its writes with version
        # counters: torch.inference_mode() around the call would stop both
        with torch.inference_mode(False):
            return capture(model, args, kwargs, method, is_leaf=lambda m: self.table.knows_module(m) or self.is_whole(m),
                           is_whole=self.is_whole, knows_op=self.table.knows_op, **options)

    def count(self, captured: Captured, lazy: bool = False) -> list[NodeCost]:
        """count_nodes of the capture (`lazy`: see there)."""
        return count_nodes(captured, self.table, self.conventions, self.attention, lazy)


@spelled_keywords
def annotate(graph: torch.fx.GraphModule | torch.export.ExportedProgram, *, conventions: str = "deepspeed",
             rules: Iterable[RuleSpec] | RuleSpec | None = None) -> torch.fx.GraphModule:
    """Write each op node's cost into node.meta["fxflops"] (macs, flops, rule, status, module); return the graph.

    Takes an ExportedProgram or an FX GraphModule whose nodes carry shapes: meta["val"] (torch.export,
    make_fx, FakeTensorProp) or ShapeProp's meta["tensor_meta"], from which a meta["val"] is made.
    A graph without shapes raises ValueError rather than costing every op 0.
    """
    _check_conventions(conventions)
    graph_module = graph.graph_module if isinstance(graph, torch.export.ExportedProgram) else graph
    missing = values_from_tensor_meta(graph_module)
    if missing:
        raise ValueError(
            f"annotate() needs the shape of every node; {len(missing)} op nodes have none "
            f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}). Propagate shapes first: "
            "torch.fx.passes.shape_prop.ShapeProp(gm).propagate(*example_inputs), or pass torch.export's program."
        )
    label_modules(graph_module, prefix="", root_type=type(graph_module).__name__)
    captured = Captured(graph_module, "given", {}, {}, {})
    costs = count_nodes(captured, load_table(rules), conventions)
    nodes = {node.name: node for node in graph_module.graph.nodes}
    for cost in costs:
        node = nodes.get(cost.name)
        if node is not None:
            node.meta["fxflops"] = {
                "macs": cost.macs, "flops": cost.flops, "rule": cost.rule, "status": cost.status,
                "module": cost.module, "op": cost.op,
            }
    return graph_module


def _no_progress(stage: str) -> None:
    pass


def _check_conventions(conventions: str) -> None:
    preset(conventions)  # a ValueError naming the valid presets (and the closest) for any other name


def _check_attention(attention: str) -> None:
    check_attention(attention)  # likewise for the attention readings


def _check_method(method: str) -> None:
    from fxflops.capture.methods import CHOICES

    def check(method: str) -> None:  # (capture() checks it too; here it fails before the inputs are made)
        if method not in CHOICES:
            raise ValueError(f"method must be one of {', '.join(CHOICES)}; got {method!r}")

    _spelled(check, method, CHOICES)


def _spelled(check: Callable[[Any], Any], value: Any, choices: Iterable[str]) -> None:
    """`check(value)`; its ValueError says the closest valid spelling too (conventions="deepspeeed")."""
    try:
        check(value)
    except ValueError as error:
        from fxflops.spelling import did_you_mean

        raise ValueError(f"{error}{did_you_mean(value, choices)}") from None


def normalize_inputs(model: torch.nn.Module, args: Any, kwargs: dict | None, input_shape: Any) -> tuple[tuple, dict]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fxflops counts a torch.nn.Module; got {type(model).__name__} {clip(repr(model), 60)}. "
                        "Wrap a function in a module whose forward calls it")
    if input_shape is not None:
        if args not in ((), [], None):
            raise ValueError("give either input_shape or args, not both")
        args = inputs_from_shape(model, input_shape)
    if args is None:
        args = ()
    elif not isinstance(args, tuple | list):
        args = (args,)
    args, kwargs = tuple(args), dict(kwargs or {})
    if any(tensor.is_nested for tensor in tensors_in((args, kwargs))):
        raise ValueError("nested tensors (torch.nested) have ragged sizes, which fxflops cannot count as one "
                         "shape: pass x.to_padded_tensor(0) for the padded batch's cost, or estimate each "
                         "sequence on its own and add the counts")
    return args, kwargs


def _whole_predicate(user_table: RuleTable | None, leaf_modules: Iterable[type | str] | None,
                     preset_whole: Iterable[str] = ()) -> Callable[[torch.nn.Module], bool]:
    classes = tuple(c for c in (leaf_modules or ()) if isinstance(c, type))
    names = {c for c in (leaf_modules or ()) if isinstance(c, str)}
    # the preset's own (rules/presets.toml `whole_modules`): exactly those classes, as the tool it
    # reproduces hooks type(module); a name that does not import (an absent package) matches nothing
    exact = frozenset(c for c in map(resolve_name, preset_whole) if isinstance(c, type))

    def is_whole(module: torch.nn.Module) -> bool:
        if type(module) in exact:
            return True
        if classes and isinstance(module, classes):
            return True
        if names and any(f"{c.__module__}.{c.__qualname__}" in names or c.__name__ in names
                         for c in type(module).__mro__):
            return True
        return user_table is not None and user_table.knows_module(module)

    return is_whole


def _callers_level() -> int:
    """The `stacklevel` of the innermost frame outside the fxflops package, for a warnings.warn() made by
    our caller: a warning points at the user's line that called estimate() or a sweep, however many of
    our own frames (decorators, facades) lie between."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(2), 2  # our caller's caller: stacklevel 2 for the function that warns
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def warn_cautions(cautions: list[str], stacklevel: int | None = None) -> None:
    """One CautionWarning per thing a real forward would do differently from the count, pointing at the
    user's line (`stacklevel`: by default the first frame outside fxflops)."""
    stacklevel = stacklevel or _callers_level()
    for caution in cautions:
        warnings.warn(caution, CautionWarning, stacklevel=stacklevel)


def warn_unknown(unknown: list[UnknownOp], stacklevel: int | None = None) -> None:
    """One UnknownOpsWarning listing the ops that matched no rule, if any, pointing at the user's line."""
    stacklevel = stacklevel or _callers_level()
    if unknown:
        warnings.warn(f"{_unknown_listing(unknown)}. Add a rule for them (rules=[...]) or declare them zero-cost; "
                      "see Estimate.unknown.", UnknownOpsWarning, stacklevel=stacklevel)


def _unknown_listing(unknown: list[UnknownOp]) -> str:
    listed = ", ".join(f"{u.op} x{u.count} (in {', '.join(m or ROOT_LABEL for m in u.modules[:3])}"
                       f"{f' and {len(u.modules) - 3} more' if len(u.modules) > 3 else ''})" for u in unknown[:8])
    more = f", and {len(unknown) - 8} more ops" if len(unknown) > 8 else ""
    return f"{sum(u.count for u in unknown)} op calls matched no rule and are not in the totals: {listed}{more}"
