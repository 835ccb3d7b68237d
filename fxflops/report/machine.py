"""Machine-readable output: JSON (a stable, versioned schema) and CSV (one row per module).

All counts are raw integers and all times are seconds (floats); nothing is human-formatted.

JSON schema `fxflops.estimate`, version 1 — top-level object:

    schema            "fxflops.estimate"
    schema_version    1 (bumped only when a field changes meaning or disappears)
    fxflops_version   str        torch_version  str
    model_type        str        class name of the model
    method            str        capture method that succeeded: "eager" | "export" | "symbolic" | "trace"
    counted           str        what that method counted, in words (the eager path on fake tensors, ...)
    conventions       str        counting preset: a name of fxflops.CONVENTIONS (rules/presets.toml)
    dtype             str|null   the model's floating dtype as counted, e.g. "float32", "bfloat16"
    training          bool|null  the model's training flag as counted (dropout and batch norm depend on it)
    input_shapes      the captured inputs' shapes as [args, kwargs], each tensor's shape a list
                      of ints, e.g. [[[1024, 1, 32, 32]], {}] or [[], {"input_ids": [1, 128]}]
    input_values      str|null   what the inputs were when the model ran on inputs the caller did not
                      give (the CLI's all-zero inputs from --input-shape); null otherwise
    attempts          [{"method": str, "error": str}]   capture methods that failed first
    cautions          [str]      what a real forward would do differently, e.g. an embedding looked
                      up past its rows (a sequence longer than the model's positions)
    totals            {"macs": int, "flops": int, "params": int, "bytes": int}   forward + backward when
                      the backward was counted; bytes: memory read + written by every op
    backward          bool       whether the backward was counted
    fwd / bwd         {"macs": int, "flops": int}   the forward's and the backward's shares of totals
                      (bwd: zeros unless counted; recomputed forwards of activation checkpointing are bwd)
    bwd_fwd_ratio     float|null backward FLOPs / forward FLOPs, when the backward was counted
    optimizer         null, or {"name", "params", "flops_per_param", "flops", "formula"}: one
                      optimizer step over the trainable parameters (not in totals)
    node_status       {"counted": int, "zero": int, "unknown": int}   graph nodes per outcome
    attention         {"reading": "dense"|"effective" (which one totals count), "totals": null or
                      {dense_macs, dense_flops, effective_macs, effective_flops, nodes, unknown,
                      patterns: [str]}}   attention ops read both ways (fwd + bwd); unknown: nodes
                      whose mask is data (their dense count stands in the effective total)
    modules           [module], pre-order (parents first); the root has name ""
        module = {name, type, depth, params, macs, flops, self_macs, self_flops, calls,
                  extra_repr, children: [qualified names], latency: float|null (seconds per
                  step, all calls), latency_calls: int|null, achieved_flops: float|null,
                  bwd_macs, bwd_flops (inclusive, 0 without backward), self_bwd_macs, self_bwd_flops,
                  bwd_latency: float|null,
                  fwd_macs, fwd_flops, bwd_fwd_ratio: float|null, achieved_bwd_flops: float|null,
                  bytes, self_bytes (memory read + written by its ops, inclusive / own; see
                  fxflops.traffic), intensity: float|null (flops per byte),
                  predicted_latency: float|null, bound: "compute"|"memory"|null (with a prediction),
                  shared: {name: name} tied weights under the module that `params` leaves out because
                  an earlier module holds them: the parameter's name relative to the module -> the first
                  owner's qualified name, e.g. {"weight": "transformer.wte.weight"} for GPT-2's lm_head;
                  each parameter counts once, at its first owner, so module params add up to totals,
                  peak_memory: int|null (with memory=: the highest tensor bytes alive while the module
                  or a submodule runs an op, fxflops.memory.MemoryEstimate.module_peaks),
                  collective_calls, collective_bytes, collective_wire_bytes (the collectives it and its
                  submodules call: count, payload, wire bytes)}
    by_op             {op key: {"count", "macs", "flops", "bwd_macs", "bwd_flops", "status"}}   e.g.
                      "aten.mm.default"; status: "counted", "zero" or "unknown" ("/"-joined when mixed)
    by_rule           {rule name: {"count", "macs", "flops", "bwd_macs", "bwd_flops", "status"}}
    unknown           [{"op": str, "count": int, "modules": [str]}]   ops no rule counts
    prediction        null, or the roofline prediction (Estimate.predict): {"device", "dtype",
                      "peak_flops", "vector_flops", "bandwidth" (bytes/s), "latency" (s),
                      "memory_bound_share", "ridge" (flops per byte), "source"}
    measurements      null, or every `fxflops.results.Measurements` field (seconds, FLOP/s)
                      plus derived "achieved_flops", "utilization", "hook_overhead"
    memory            present only with estimate(memory=...) (fxflops.memory.MemoryEstimate): tensor
                      bytes one rank holds through the step: {"peak_bytes", "by_kind" (parameters,
                      buffers, gradients, optimizer, inputs, activations, temporaries at the peak),
                      "peak_at": {module, phase, op, node}, "by_module" (activations and temporaries
                      alive at the peak, by the module that made them), "saved_by_module" (activations
                      alive when the forward ends), "model_states", "phase_peaks" {phase: bytes},
                      "optimizer" (its formula, in words), "allowance" {rounding, context, collectives,
                      fragmentation, total} (apart: not in peak_bytes), "device_bytes" (peak +
                      allowance), "device", "capacity", "fits", "headroom" (null without a device), "notes",
                      "module_peaks" {module: the highest total while it (or a submodule) runs an op; "":
                      the whole step}, "kinds" [kind names], "timeline" [[index, phase, module, op, node,
                      total, [bytes per kind, in "kinds" order]]] a point per op: the whole step}
    collectives       [{op, target, module, phase, group, group_desc, group_size, dtype, bytes, wire_bytes,
                      node, per_step, peer, stage, micro_batch}]   every collective call of the counted rank in one
                      step (fxflops.results.Collective; peer/stage/micro_batch: a pipelining schedule's send/recv)
    collective_bytes  {"bytes": int, "wire_bytes": int}   their payload and wire bytes summed
    parallel          null, or a what-if plan's fields {"tp", "dp", "pp", "ep", "cp", "sequence_parallel", ...}
    ranks             [{"name", "ranks": [int], "flops", "collective_wire_bytes", "peak_bytes" (only with memory=:
                      the role's own peak tensor bytes)}]   the plan's rank roles
                      (this estimate is the first's rank); job_flops: int, every rank's flops together
    nodes             present only with include_nodes=True: [{name, op, status, rule, module,
                      module_type, input_shapes, output_shapes, macs, flops, source, phase
                      ("forward" | "backward" | "recompute"), differentiates (forward node name), bytes,
                      attention (what its mask keeps, attention ops only), dense_macs, dense_flops,
                      effective_macs, effective_flops (null: not knowable without data), fused_call (null, or
                      {kind, call, step, input_item, weight_item, output_item}: a forward op of a
                      composite call CUDA runs as one fused kernel, rms_norm), channels_last (a batch norm's or
                      convolution's activation is channels-last), strided_inputs ([int]: a layer norm's inputs, by
                      position, that are not contiguous)}]

Readers must ignore keys they do not know: later versions may add keys without bumping.
CSV columns are `CSV_COLUMNS`; latency and achieved_flops are empty when not measured, peak_memory without memory=, predicted_latency
and bound without a prediction; shared is `name=first owner` pairs joined by `;` (empty: none). Numbers are
written as numbers. A text cell (a module's name, type or extra_repr) that starts like a spreadsheet formula
(=, +, -, @, tab, CR) is written with a leading `'`, as OWASP's CSV-injection guidance advises, and control
characters in text cells as escapes (`\x1b`); JSON escapes them itself.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import networkx as nx

from fxflops.capture.methods import describe
from fxflops.report.collectives import module_collectives
from fxflops.report.formats import ENCODING_ERRORS, csv_cell
from fxflops.results.costs import FusedCall
from fxflops.results import (
    AttentionTotals,
    Collective,
    Estimate,
    Measurements,
    ModuleStats,
    NodeCost,
    OpTotals,
    OptimizerStep,
    Profile,
    UnknownOp,
)

SCHEMA = "fxflops.estimate"
SCHEMA_VERSION = 1

MODULE_FIELDS = (
    "name",
    "type",
    "depth",
    "params",
    "macs",
    "flops",
    "self_macs",
    "self_flops",
    "calls",
    "extra_repr",
    "children",
    "latency",
    "latency_calls",
    "bwd_macs",
    "bwd_flops",
    "bwd_latency",
    "self_bwd_macs",
    "self_bwd_flops",
    "bytes",
    "self_bytes",
    "shared",
)
DERIVED_FIELDS = ("fwd_macs", "fwd_flops", "bwd_fwd_ratio", "achieved_flops", "achieved_bwd_flops", "intensity")  # written, not read back
PREDICTED_FIELDS = ("predicted_latency", "bound")  # empty without a prediction
# with memory=, and where collectives were called (zeros otherwise); in JSON's module records and the CSV
STEP_FIELDS = ("peak_memory", "collective_calls", "collective_bytes", "collective_wire_bytes")
# shared after the older columns, so they keep their places; its cell reads `weight=transformer.wte.weight`;
# the newer columns after it
CSV_COLUMNS = (tuple(field for field in MODULE_FIELDS if field not in ("children", "shared"))
               + DERIVED_FIELDS + PREDICTED_FIELDS + ("shared",) + STEP_FIELDS)


def jsonable(value: Any) -> Any:
    """Plain JSON types for shapes, dtypes and other pytree leaves (tuples become lists)."""
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        return int(value)  # SymInt and numpy integers that are concrete
    except (TypeError, ValueError):
        return str(value)


def _versions() -> dict[str, str]:
    import torch

    import fxflops

    return {"fxflops_version": fxflops.__version__, "torch_version": torch.__version__}


def _totals(values: dict[str, OpTotals]) -> dict[str, dict[str, Any]]:
    return {
        key: {"count": item.count, "macs": item.macs, "flops": item.flops, "bwd_macs": item.bwd_macs,
              "bwd_flops": item.bwd_flops, "status": "/".join(item.statuses)}
        for key, item in values.items()
    }


def _step_fields(estimate: Estimate) -> dict[str, dict[str, Any]]:
    """Module -> its STEP_FIELDS: peak memory (null without memory=) and the collectives under it."""
    peaks = estimate.memory.module_peaks if estimate.memory is not None else {}
    calls = module_collectives(estimate.collectives)
    return {name: {"peak_memory": peaks.get(name) if estimate.memory is not None else None,
                   **dict(zip(STEP_FIELDS[1:], calls.get(name, (0, 0, 0))))} for name in estimate.modules}


def _module_dict(stats: ModuleStats, backward: bool, prediction: Any = None,
                 step: dict[str, Any] | None = None) -> dict[str, Any]:
    record = {field: getattr(stats, field) for field in MODULE_FIELDS}
    record.update(step or dict.fromkeys(STEP_FIELDS))
    record["children"] = list(stats.children)
    record["shared"] = dict(stats.shared)
    for field in DERIVED_FIELDS:
        record[field] = getattr(stats, field)
    if not backward:  # no backward counted: no ratio, rather than 0
        record["bwd_fwd_ratio"] = None
    predicted = prediction.modules.get(stats.name) if prediction is not None else None
    record["predicted_latency"] = predicted.latency if predicted is not None else None
    record["bound"] = predicted.bound if predicted is not None else None
    return record


def _prediction_dict(prediction: Any) -> dict[str, Any] | None:
    if prediction is None:
        return None
    return {"device": prediction.device, "dtype": prediction.dtype, "peak_flops": prediction.peak_flops,
            "vector_flops": prediction.vector_flops, "bandwidth": prediction.bandwidth,
            "latency": prediction.latency, "memory_bound_share": prediction.memory_bound_share,
            "ridge": prediction.ridge, "source": prediction.source}


def _measurements_dict(estimate: Estimate) -> dict[str, Any] | None:
    m = estimate.measurements
    if m is None:
        return None
    record = jsonable(dataclasses.asdict(m))
    achieved = estimate.fwd_flops / m.fwd_latency if m.fwd_latency else None
    record["achieved_flops"] = achieved
    record["utilization"] = achieved / m.peak_flops if achieved and m.peak_flops else None
    record["hook_overhead"] = m.hook_overhead
    return record


def _attention_dict(estimate: Estimate) -> dict[str, Any]:
    totals = estimate.attention_totals()
    return {"reading": estimate.attention, "totals": jsonable(dataclasses.asdict(totals)) if totals else None}


def _attention_from(record: dict[str, Any] | None) -> AttentionTotals | None:
    totals = (record or {}).get("totals")
    if not totals:
        return None
    known = {field.name for field in dataclasses.fields(AttentionTotals)}  # a newer writer's keys are ignored
    return AttentionTotals(**{**{k: v for k, v in totals.items() if k in known},
                              "patterns": tuple(totals.get("patterns", ()))})


def _rank_dict(role: Any) -> dict[str, Any]:
    record = {"name": role.name, "ranks": list(role.ranks), "flops": role.estimate.total_flops,
              "collective_wire_bytes": role.estimate.collective_wire_bytes}
    if role.estimate.memory is not None:  # the role's own peak, with memory=
        record["peak_bytes"] = role.estimate.memory.peak_bytes
    return record


def _node_dict(node: NodeCost) -> dict[str, Any]:
    return jsonable(dataclasses.asdict(node))


def to_dict(estimate: Estimate, include_nodes: bool = False) -> dict[str, Any]:
    """The estimate as plain JSON-ready data (schema in this module's docstring)."""
    record: dict[str, Any] = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION}
    step = _step_fields(estimate)
    record.update(_versions())
    record.update(
        model_type=estimate.model_type,
        method=estimate.method,
        counted=describe(estimate.method),
        conventions=estimate.conventions,
        dtype=estimate.dtype,
        training=estimate.training,
        input_shapes=jsonable(estimate.input_shapes),
        input_values=estimate.input_values,
        attempts=[{"method": method, "error": error} for method, error in estimate.attempts],
        cautions=list(estimate.cautions),
        totals={
            "macs": estimate.total_macs,
            "flops": estimate.total_flops,
            "params": estimate.total_params,
            "bytes": estimate.total_bytes,
        },
        backward=estimate.backward,
        fwd={"macs": estimate.fwd_macs, "flops": estimate.fwd_flops},
        bwd={"macs": estimate.bwd_macs, "flops": estimate.bwd_flops},
        bwd_fwd_ratio=estimate.bwd_fwd_ratio,
        optimizer=dataclasses.asdict(estimate.optimizer) if estimate.optimizer is not None else None,
        node_status=estimate.node_status_counts(),
        attention=_attention_dict(estimate),
        modules=[_module_dict(stats, estimate.backward, estimate.prediction, step.get(stats.name))
                 for stats in estimate.modules.values()],
        by_op=_totals(estimate.by_op),
        by_rule=_totals(estimate.by_rule),
        unknown=[
            {"op": op.op, "count": op.count, "modules": list(op.modules)}
            for op in estimate.unknown
        ],
        prediction=_prediction_dict(estimate.prediction),
        measurements=_measurements_dict(estimate),
        collectives=[dataclasses.asdict(c) for c in estimate.collectives],
        collective_bytes={"bytes": estimate.collective_bytes, "wire_bytes": estimate.collective_wire_bytes},
        parallel=estimate.parallel,
        ranks=[_rank_dict(role) for role in estimate.ranks],
        job_flops=estimate.job_flops,
    )
    if estimate.memory is not None:  # estimate(memory=...): peak tensor bytes, by kind, allowance, fit
        record["memory"] = estimate.memory.to_dict()
    if include_nodes:
        record["nodes"] = [_node_dict(node) for node in estimate.nodes]
    return record


def to_json(
    estimate: Estimate,
    path: str | Path | None = None,
    include_nodes: bool = False,
    indent: int | None = 2,
) -> str:
    """The estimate as JSON text; also written to `path` when given."""
    document = json.dumps(to_dict(estimate, include_nodes), indent=indent) + "\n"
    if path is not None:
        Path(path).write_text(document, encoding="utf-8", errors=ENCODING_ERRORS)
    return document


def csv_rows(estimate: Estimate) -> list[dict[str, Any]]:
    """One dict per module in pre-order with the `CSV_COLUMNS` keys."""
    rows = []
    step = _step_fields(estimate)
    for stats in estimate.modules.values():
        record = _module_dict(stats, estimate.backward, estimate.prediction, step.get(stats.name))
        row = {column: record[column] for column in CSV_COLUMNS}
        row["shared"] = ";".join(f"{name}={owner}" for name, owner in stats.shared.items())
        rows.append(row)
    return rows


def to_csv(estimate: Estimate, path: str | Path | None = None) -> str:
    """One CSV row per module (raw integers, seconds); also written to `path` when given."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(CSV_COLUMNS), lineterminator="\n")
    writer.writeheader()
    for row in csv_rows(estimate):
        writer.writerow({key: "" if value is None else csv_cell(value) for key, value in row.items()})
    document = buffer.getvalue()
    if path is not None:
        Path(path).write_text(document, encoding="utf-8", errors=ENCODING_ERRORS, newline="")
    return document


# ----------------------------------------------------------------------------- reading back


def _module_from(record: dict[str, Any]) -> ModuleStats:
    values = {field: record[field] for field in MODULE_FIELDS if field in record}
    values["children"] = list(values.get("children", []))
    values["shared"] = dict(values.get("shared", {}))
    return ModuleStats(**values)


def _measurements_from(record: dict[str, Any] | None) -> Measurements | None:
    if record is None:
        return None
    names = {field.name for field in dataclasses.fields(Measurements)}
    values = {key: value for key, value in record.items() if key in names}
    for key in ("unmatched_measured", "unmatched_graph"):
        values[key] = tuple(values.get(key, ()))
    return Measurements(**values)


def _node_from(record: dict[str, Any]) -> NodeCost:
    def shapes(items: list) -> tuple:
        return tuple(tuple(shape) if isinstance(shape, list) else shape for shape in items)

    values = dict(record)
    values["input_shapes"] = shapes(values.get("input_shapes", []))
    values["output_shapes"] = shapes(values.get("output_shapes", []))
    if values.get("fused_call") is not None:
        values["fused_call"] = FusedCall(**values["fused_call"])
    values["strided_inputs"] = tuple(values.get("strided_inputs", ()))
    return NodeCost(**values)


def _tree_from(modules: dict[str, ModuleStats]) -> nx.DiGraph:
    tree = nx.DiGraph()
    for name, stats in modules.items():
        tree.add_node(name, stats=stats)
    for name, stats in modules.items():
        tree.add_edges_from((name, child) for child in stats.children)
    return tree


def from_dict(record: dict[str, Any]) -> Estimate:
    """Rebuild an Estimate (a Profile when measured) from `to_dict` output.

    Per-node costs come back only when they were written (`include_nodes=True`).
    """
    if record.get("schema") != SCHEMA:
        raise ValueError(f"not an fxflops estimate (schema {record.get('schema')!r})")
    if record.get("schema_version", 0) > SCHEMA_VERSION:
        raise ValueError(
            f"schema version {record['schema_version']} is newer than this fxflops reads "
            f"({SCHEMA_VERSION}); upgrade fxflops"
        )
    modules = {item["name"]: _module_from(item) for item in record["modules"]}
    measurements = _measurements_from(record.get("measurements"))
    cls = Profile if measurements is not None else Estimate
    return cls(
        model_type=record["model_type"],
        method=record["method"],
        conventions=record["conventions"],
        total_macs=record["totals"]["macs"],
        total_flops=record["totals"]["flops"],
        total_params=record["totals"]["params"],
        modules=modules,
        nodes=[_node_from(item) for item in record.get("nodes", [])],
        by_op={key: _op_totals_from(value) for key, value in record["by_op"].items()},
        by_rule={key: _op_totals_from(value) for key, value in record["by_rule"].items()},
        unknown=[
            UnknownOp(op=item["op"], count=item["count"], modules=tuple(item["modules"]))
            for item in record["unknown"]
        ],
        tree=_tree_from(modules),
        input_shapes=record.get("input_shapes", []),
        input_values=record.get("input_values"),
        attempts=[(item["method"], item["error"]) for item in record.get("attempts", [])],
        cautions=list(record.get("cautions", [])),
        measurements=measurements,
        dtype=record.get("dtype"),
        training=record.get("training"),
        backward=record.get("backward", False),
        bwd_macs=record.get("bwd", {}).get("macs", 0),
        bwd_flops=record.get("bwd", {}).get("flops", 0),
        optimizer=OptimizerStep(**record["optimizer"]) if record.get("optimizer") else None,
        saved_node_status=record.get("node_status"),
        attention=(record.get("attention") or {}).get("reading", "dense"),
        saved_attention=_attention_from(record.get("attention")),
        collectives=[Collective(**item) for item in record.get("collectives", [])],
        parallel=record.get("parallel"),
    )


def _op_totals_from(record: dict[str, Any]) -> OpTotals:
    values = dict(record)
    status = values.pop("status", "")
    return OpTotals(**values, statuses=tuple(status.split("/")) if status else ())


def from_json(source: str | Path) -> Estimate:
    """Read an estimate back from a JSON file path or JSON text."""
    text = str(source)
    if not text.lstrip().startswith("{"):
        text = Path(source).read_text(encoding="utf-8")
    return from_dict(json.loads(text))
