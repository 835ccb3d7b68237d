"""Pipeline parallelism: the rank's capture cut into stages, one estimate per distinct pipeline rank.

The stages: the model's repeated blocks (plan.repeated_blocks) cut into pp * virtual_stages contiguous
runs, balanced by layer count (the first `layers % stages` stages hold one layer more); stage j lives on
pipeline rank j % pp (interleaved, as torch.distributed.pipelining's interleaved and looped schedules
place them). The whole forward and backward is captured once on the plan's rank, then every node is
given to a stage as torch.distributed.pipelining's tracer split (SplitPoint.BEGINNING at each stage's
first block) cuts the program: an op inside a block goes to that block's stage; an op outside every
block goes to the stage of the block that ran before it (the embedding, and whatever the model computes
before its first block, to the first stage; the final norm, head and loss to the last); a backward op
goes to the stage of the forward op it differentiates (else of its module, else of the op before it).

What crosses a cut is sent: every value an op of stage k computes and an op of a later stage reads is
one send from stage k to k+1 (and passed on, stage by stage) per micro-batch forward, and its gradient
(when it has one) is sent back the other way: `send`/`recv` records on the pp mesh dimension, derived
from the cut (torch's P2P ops `c10d.send`/`c10d.recv_` are what a real pipeline calls). Model inputs
and parameters are read where they are needed, never sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fxflops.capture.inputs import INPUT_INDEX
from fxflops.parallel.collectives import wire_bytes
from fxflops.parallel.plan import Parallel, repeated_blocks
from fxflops.results import BACKWARD, FORWARD, Captured, CountSource, Estimate, ModuleInfo, NodeCost, RankRole
from fxflops.results.parallel import RECV, SEND, Collective
from fxflops.tree import build_estimate, owning_module, parent_name

if TYPE_CHECKING:
    from fxflops.memory.records import MemoryEstimate


def layer_stages(layers: int, stages: int) -> list[int]:
    """The stage of each layer: contiguous runs, the first `layers % stages` stages one layer longer."""
    size, extra = divmod(layers, stages)
    found: list[int] = []
    for stage in range(stages):
        found += [stage] * (size + (stage < extra))
    return found


def pipeline_ranks(plan: Parallel, pp_rank: int) -> tuple[int, ...]:
    """The global ranks at pipeline position `pp_rank`: pp is the mesh's outermost dimension."""
    inner = plan.size // plan.pp
    return tuple(range(pp_rank * inner, (pp_rank + 1) * inner))


@dataclasses.dataclass(frozen=True)
class Cut:
    """A capture cut into pipeline stages: each node's stage, and the values crossing each boundary."""

    stage_of: dict[str, int]  # node name -> stage
    crossing: list[list[tuple[str, str, str, int, int]]]  # per boundary k (stage k -> k+1): (producer node,
    # producer module, first consumer module, bytes, gradient bytes) per value
    order: dict[str, int]  # node name -> position in the graph
    touched: dict[str, set[int]]  # module -> the stages whose forward ops ran in it or its submodules
    free: frozenset[str]  # ops on parameters and constants alone (given to the stages that read them)
    also: dict[str, frozenset[int]] = dataclasses.field(default_factory=dict)  # such an op -> the other stages
    # that read its value and so run it too (stage_of holds the first)


def cut(model: torch.nn.Module, estimate: Estimate, stages: int) -> Cut:
    """Every node of the estimate's capture given to one of `stages` stages (see the module's docstring)."""
    captured = estimate.source.captured
    blocks = [name for name, _ in repeated_blocks(model)]
    of_layer = dict(zip(blocks, layer_stages(len(blocks), stages), strict=True))
    costs = {cost.name: cost for cost in estimate.nodes}
    modules = captured.modules
    module_stage: dict[str, int] = {}  # module -> the stage of its first forward op

    def block_stage(module: str) -> int | None:
        while module:
            if module in of_layer:
                return of_layer[module]
            module = parent_name(module) or ""
        return None

    stage_of: dict[str, int] = {}
    order: dict[str, int] = {}
    touched: dict[str, set[int]] = {}
    free: list[torch.fx.Node] = []  # ops on parameters and constants alone: their readers' stage
    reads_inputs: set[str] = set()
    trained: set[str] = set()  # forward values computed from a trainable parameter
    forward_stage, backward_stage = 0, stages - 1
    in_backward = False
    for position, node in enumerate(captured.graph_module.graph.nodes):
        order[node.name] = position
        if INPUT_INDEX in node.meta or any(arg.name in reads_inputs for arg in node.all_input_nodes) \
                or (node.op == "placeholder" and in_backward and not isinstance(node.meta.get("val"), torch.nn.Parameter)):
            # a model input, what is computed from one, and what the backward reads first: the gradients'
            # seed and the tensors autograd saved (new placeholders there, parameters aside)
            reads_inputs.add(node.name)
        if not in_backward and (_trainable(node) or any(arg.name in trained for arg in node.all_input_nodes)):
            trained.add(node.name)
        cost = costs.get(node.name)
        if cost is None:
            continue
        in_backward = in_backward or cost.is_backward
        owner = owning_module(cost.module, captured.aliases, modules)
        in_block = block_stage(owner)
        if node.name not in reads_inputs and node.users:
            free.append(node)  # (an FSDP all-gather, also prefetched while another block runs)
            continue
        if cost.phase == FORWARD:
            stage = in_block if in_block is not None else forward_stage
            forward_stage = stage
            module_stage.setdefault(owner, stage)
            module: str | None = owner
            while module is not None and stage not in touched.setdefault(module, set()):
                touched[module].add(stage)
                module = parent_name(module)
        else:
            if cost.differentiates in stage_of:
                stage = stage_of[cost.differentiates]
            elif in_block is not None:
                stage = in_block
            elif len(touched.get(owner, ())) == 1:  # a module only one stage runs (the head, the embedding)
                stage = module_stage[owner]
            else:
                stage = backward_stage
            backward_stage = stage
        stage_of[node.name] = stage
    # a value from buffers and constants alone is computed by every stage that reads it, never sent (as
    # torchtitan's and Megatron's stages each build their rotary tables): its op runs on each of them. One
    # from a trainable parameter is computed once, by its first reader's stage, and sent on with its gradient
    # back: a later stage holds neither the parameter nor its gradient (the tracer split's cut)
    computed_on: dict[str, set[int]] = {}
    for node in reversed(free):  # readers come later in the graph: settled first
        readers = {stage for user in node.users
                   for stage in computed_on.get(user.name, {stage_of[user.name]} if user.name in stage_of else ())}
        cost = costs[node.name]
        owner = owning_module(cost.module, captured.aliases, modules)
        on = readers or {block_stage(owner) or 0}
        computed_on[node.name] = {min(on)} if node.name in trained else on
        stage_of[node.name] = min(on)
    also = {name: frozenset(on - {stage_of[name]}) for name, on in computed_on.items() if len(on) > 1}
    names = frozenset(node.name for node in free)
    return Cut(stage_of, _crossing(captured, costs, stage_of, stages, names - trained), order, touched, names, also)


def _trainable(node: torch.fx.Node) -> bool:
    """Whether the node is a parameter the backward differentiates (a placeholder holding one)."""
    value = node.meta.get("val")
    return node.op == "placeholder" and isinstance(value, torch.nn.Parameter) and value.requires_grad


def _crossing(captured: Captured, costs: dict[str, NodeCost], stage_of: dict[str, int],
              stages: int, free: frozenset[str]) -> list[list[tuple[str, str, str, int, int]]]:
    crossing: list[list[tuple[str, str, str, int, int]]] = [[] for _ in range(stages - 1)]
    for node in captured.graph_module.graph.nodes:
        cost = costs.get(node.name)
        if cost is None or cost.phase != FORWARD or node.name in free:  # (each reading stage computes it)
            continue
        readers = [user for user in node.users if user.name in stage_of and costs[user.name].phase == FORWARD
                   and stage_of[user.name] > stage_of[node.name]]
        if not readers:
            continue
        size, grad = _value_bytes(node.meta.get("val"))
        if not size:
            continue
        first = min(readers, key=lambda user: stage_of[user.name])
        for boundary in range(stage_of[node.name], max(stage_of[user.name] for user in readers)):
            crossing[boundary].append((node.name, cost.module, costs[first.name].module, size, grad))
    return crossing


def _value_bytes(value: Any) -> tuple[int, int]:
    """(bytes, gradient bytes) of the tensors in a node's value (a tuple's items summed)."""
    if isinstance(value, torch.Tensor):
        size = value.numel() * value.element_size()
        return size, size if value.requires_grad and (value.is_floating_point() or value.is_complex()) else 0
    if isinstance(value, list | tuple):
        sizes = [_value_bytes(item) for item in value]
        return sum(s for s, _ in sizes), sum(g for _, g in sizes)
    return 0, 0


def pipeline_roles(model: torch.nn.Module, estimate: Estimate, plan: Parallel, group: tuple[str, str],
                   stage_memory: Callable[..., MemoryEstimate] | None = None, micro_batches: int = 1) -> list[RankRole]:
    """One RankRole per set of pipeline ranks that run the same ops (first, middle, last stage), each with
    its ranks and the estimate of what it runs per micro-batch. `group`: the pp mesh group (name, desc).
    `stage_memory(captured, nodes=, holds=)` (under memory=): each pipeline rank's memory from its own
    ops and the parameters it holds, with the micro-batches the plan's schedule keeps in flight on it
    (`micro_batches` per step)."""
    stages = plan.stages
    split = cut(model, estimate, stages)
    by_stage: dict[int, list[NodeCost]] = {}
    for cost in estimate.nodes:  # grouped once: a plan may have dozens of pipeline ranks
        by_stage.setdefault(split.stage_of.get(cost.name, 0), []).append(cost)
        for stage in split.also.get(cost.name, ()):
            by_stage.setdefault(stage, []).append(cost)
    per_rank = [_rank_estimate(estimate, split, plan, tuple(range(r, stages, plan.pp)), by_stage, group)
                for r in range(plan.pp)]
    if stage_memory is not None:
        _stage_memories(per_rank, estimate.source.captured, split, plan, stage_memory, micro_batches)
    groups: dict[Any, list[int]] = {}
    for r, rank_estimate in enumerate(per_rank):
        groups.setdefault(_signature(rank_estimate), []).append(r)
    roles = []
    for members in sorted(groups.values()):
        ranks = tuple(rank for r in members for rank in pipeline_ranks(plan, r))
        roles.append(RankRole(_role_name(members, plan), ranks, per_rank[members[0]]))
    return roles


def _stage_memories(per_rank: list[Estimate], captured: Captured, split: Cut, plan: Parallel,
                    stage_memory: Callable[..., MemoryEstimate], micro_batches: int) -> None:
    """Each pipeline rank's estimate given its memory: its ops, its parameters, its micro-batches in flight."""
    from fxflops.memory.pipeline import with_micro_batches_in_flight

    stage_at: dict[str, int] = {}
    current = 0
    for node in captured.graph_module.graph.nodes:  # an op without a cost goes with the op before it
        if node.op == "call_function":
            current = stage_at[node.name] = split.stage_of.get(node.name, current)
    home = _homes(captured, split)

    def owner_home(name: str) -> int:
        module = parent_name(name)
        while module is not None and module not in home:
            module = parent_name(module)
        return min(home.get(module or "", {0}))

    for r, rank_estimate in enumerate(per_rank):
        mine = set(range(r, plan.stages, plan.pp))
        memory = stage_memory(captured, nodes={name for name, stage in stage_at.items() if stage in mine},
                              holds=lambda name, mine=mine: owner_home(name) in mine)
        rank_estimate.memory = with_micro_batches_in_flight(memory, plan.pipeline_schedule, plan.pp, r,
                                                            micro_batches, plan.virtual_stages)


def _homes(captured: Captured, split: Cut) -> dict[str, set[int]]:
    """Module -> the stages that run it (a module that runs no op: its parent's)."""
    home: dict[str, set[int]] = {}
    for name in captured.modules:  # pre-order: a parent before its children
        home[name] = split.touched.get(name) or home.get(parent_name(name) or "", {0})
    return home


def _rank_estimate(estimate: Estimate, split: Cut, plan: Parallel, mine: tuple[int, ...],
                   by_stage: dict[int, list[NodeCost]], group: tuple[str, str]) -> Estimate:
    source = estimate.source
    captured = source.captured
    nodes = list({id(cost): cost for stage in mine for cost in by_stage.get(stage, [])}.values())
    if len(mine) > 1 or split.also:  # virtual stages, ops a later stage runs again: back in graph order
        nodes.sort(key=lambda cost: split.order[cost.name])
    kept = {cost.name for cost in nodes}
    modules = _stage_modules(captured, split, mine)
    mine_captured = dataclasses.replace(captured, modules=modules)
    result = build_estimate(estimate.model_type, mine_captured, nodes, estimate.conventions, estimate.attention)
    result.source = CountSource(mine_captured, source.table)
    ordered = [(split.order.get(c.node, 0), c) for c in estimate.collectives if c.node in kept]
    ordered += _boundary_records(split, plan, mine, nodes, group)
    result.collectives = [c for _, c in sorted(ordered, key=lambda item: item[0])]
    return result


def _boundary_records(split: Cut, plan: Parallel, mine: tuple[int, ...], nodes: list[NodeCost],
                      group: tuple[str, str]) -> list[tuple[float, Collective]]:
    """send/recv of each value crossing a boundary of these stages, forward, and of its gradient, backward,
    placed after the stage's last (before its first) forward or backward op."""
    first: dict[tuple[int, bool], int] = {}
    last: dict[tuple[int, bool], int] = {}
    for cost in nodes:
        if cost.name in split.free:  # (FSDP's and DDP's parameter work can run ahead of the stage)
            continue
        key, position = (split.stage_of[cost.name], cost.is_backward), split.order[cost.name]
        first[key] = min(first.get(key, position), position)
        last[key] = max(last.get(key, position), position)
    records: list[tuple[float, Collective]] = []

    def record(kind: str, phase: str, module: str, size: int, node: str, at: float) -> None:
        records.append((at, Collective(
            op=kind, target="c10d.send.default" if kind == SEND else "c10d.recv_.default", module=module,
            phase=phase, group=group[0], group_desc=group[1], group_size=plan.pp, dtype="", bytes=size,
            wire_bytes=wire_bytes(kind, size, plan.pp), node=node)))

    for stage in mine:
        if stage + 1 < plan.stages:  # this stage's outputs go on; their gradients come back
            for node, producer, _, size, grad in split.crossing[stage]:
                record(SEND, FORWARD, producer, size, node, last.get((stage, False), 0) + 0.5)
                if grad:
                    record(RECV, BACKWARD, producer, grad, node, first.get((stage, True), 0) - 0.5)
        if stage > 0:  # its inputs come in; their gradients go back
            for node, _, consumer, size, grad in split.crossing[stage - 1]:
                record(RECV, FORWARD, consumer, size, node, first.get((stage, False), 0) - 0.5)
                if grad:
                    record(SEND, BACKWARD, consumer, grad, node, last.get((stage, True), 0) + 0.5)
    return records


def _stage_modules(captured: Captured, split: Cut, mine: tuple[int, ...]) -> dict[str, ModuleInfo]:
    """The captured modules these stages run (and their parents), each with the parameters these stages
    hold: a module's own parameters belong to the stage that runs it (the first of them, for a container
    that several stages run; the parent's, for a module that runs no op)."""
    modules = captured.modules
    home = _homes(captured, split)
    own = {name: info.params - sum(modules[c].params for c in info.children if c in modules)
           for name, info in modules.items()}
    kept = {name for name in modules if home[name] & set(mine)}
    params: dict[str, int] = {}
    for name in reversed(list(modules)):  # children before their parents
        if name not in kept:
            continue
        counted = own[name] if min(home[name]) in mine else 0
        params[name] = counted + sum(params.get(child, 0) for child in modules[name].children if child in kept)
    return {name: dataclasses.replace(info, params=params[name],
                                      children=tuple(c for c in info.children if c in kept))
            for name, info in modules.items() if name in kept}


def _signature(estimate: Estimate) -> tuple:
    """What makes two pipeline ranks one role: the same ops, costs, collectives and parameter count."""
    return (estimate.total_params, estimate.memory and estimate.memory.peak_bytes,
            tuple((c.op, c.phase, c.macs, c.flops, c.output_shapes) for c in estimate.nodes),
            tuple((c.op, c.phase, c.bytes, c.group_size) for c in estimate.collectives))


def _role_name(members: list[int], plan: Parallel) -> str:
    """"pipeline stage 0 (first)", "pipeline stages 1-2 (middle)", "pipeline stage 3 (last)"; with virtual
    stages, the pp ranks and the stages each holds."""
    where = [("first" if 0 == r else "last" if r == plan.pp - 1 else "middle") for r in members]
    kind = "/".join(dict.fromkeys(where))
    if plan.virtual_stages == 1:
        label = "stage" if len(members) == 1 else "stages"
    else:
        label = "rank" if len(members) == 1 else "ranks"
    span = str(members[0]) if len(members) == 1 else (
        f"{members[0]}-{members[-1]}" if members == list(range(members[0], members[-1] + 1))
        else ", ".join(map(str, members)))
    held = "" if plan.virtual_stages == 1 else \
        f"; stages {', '.join(str(s) for s in range(members[0], plan.stages, plan.pp))}{' ...' if len(members) > 1 else ''}"
    return f"pipeline {label} {span} ({kind}{held})"
