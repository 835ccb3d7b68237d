"""What-if plans: one rank of a job that does not exist, on torch.distributed's own fake process group.

For each rank role (ranks that run the same ops), a fake process group of the plan's world size is
initialized as one of those ranks, a DeviceMesh is built over it, and the capture applies the plan to
the model's fake twins with torch's own APIs (parallelize_module, FSDP2's fully_shard) before the
forward: what the rank runs is what torch runs. Everything the plan changed on the model is undone by
the capture's isolation, torch's table of composable states is put back, and the process group is
destroyed again, also when something fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fxflops.capture.diagnosis import CaptureError
from fxflops.capture.module_walk import walk_modules
from fxflops.parallel.context import apply_context, check_context
from fxflops.parallel.experts import RoutedCounts, apply_experts, expert_roles
from fxflops.parallel.megatron import megatron_plan
from fxflops.parallel.plan import Parallel, repeated_blocks
from fxflops.results import Estimate, RankRole
from fxflops.results.parallel import ALL_REDUCE, REDUCE_SCATTER, Collective
from fxflops.tree import parent_name

Prepare = Callable[[torch.nn.Module], None]
# what a capture that fails under the derived tensor-parallel plan most often needs (see docs/guide/parallel.md)
_DERIVED_TP_ADVICE = ("under tp={tp} the derived Megatron-style plan shards the attention and MLP linears, so the "
                      "model's code must take widths and head counts from the local tensors (e.g. "
                      "view(b, s, -1, head_dim), not the input's width); else give your own tp_plan={{path: "
                      "ParallelStyle}}")


def estimate_plan(model: torch.nn.Module, parallel: Parallel | dict[str, Any] | str,
                  count: Callable[[Prepare | None, bool], Estimate], inputs: tuple[tuple, dict] = ((), {}),
                  stage_memory: Callable[..., Any] | None = None) -> Estimate:
    """`count(prepare, whole_memory)` (estimate()'s own capture and count, with `prepare` applied to the fake
    model; its memory= only with `whole_memory`: pipeline ranks read theirs from their stages) run
    on the plan's rank 0, one estimate per rank role (tp, cp and data-parallel ranks run the same ops; a
    pipeline's stages differ: fxflops.parallel.pipeline; so do expert-parallel ranks whose experts receive
    other token counts: a capture each); the first role's estimate, with every role in `ranks`. `inputs`:
    estimate()'s (args, kwargs), one micro-batch (the first tensor's leading dimension is its size).
    `stage_memory(captured, nodes=, holds=)`: a pipeline stage's memory (estimate_memory with estimate()'s
    optimizer and options), for each pipeline rank under memory=."""
    plan = Parallel.of(parallel)
    plan.check(model)
    micro, micro_batches, batch = plan.batches(_leading_dimension(inputs))
    if plan.cp > 1:
        check_context(plan.cp, *inputs)
    if dist.is_available() and dist.is_initialized():
        raise ValueError("a what-if plan (parallel=...) builds its own fake process group, and one is already "
                         "initialized: to count your own sharded model, call estimate() without parallel=")
    styles = tp_styles(model, plan)

    def capture(rank: int) -> tuple[Estimate, RoutedCounts, tuple[str, str] | None]:
        seen, units = RoutedCounts(), []  # units: apply_plan's data-parallel (unit names, group names)
        with fake_world(plan.size, rank), composable_states_restored():
            mesh = _mesh(plan)
            try:
                estimate = count(None if mesh is None else
                                 lambda fake_model: units.append(apply_plan(fake_model, plan, mesh, styles, seen)),
                                 plan.pp == 1 or stage_memory is None)
            except CaptureError as error:
                if styles and plan.tp_plan is None:  # the derived plan sharded what the model's code reads whole
                    error.advice = "; ".join(filter(None, (error.advice, _DERIVED_TP_ADVICE.format(tp=plan.tp))))
                raise
            if units and units[-1][0]:
                estimate.collectives = gradient_reductions_marked(estimate.collectives, units[-1])
            pp_group = mesh["pp"].get_group() if plan.pp > 1 else None
            return estimate, seen, None if pp_group is None else (pp_group.group_name, pp_group.group_desc)

    estimate, seen, pp_group = capture(0)
    if pp_group is not None:
        from fxflops.parallel.pipeline import pipeline_roles

        roles = pipeline_roles(model, estimate, plan, pp_group, stage_memory, micro_batches)
    elif plan.ep > 1:  # ranks whose experts receive other token counts run other ops: a capture per role
        roles = [RankRole(name, ranks, estimate if ranks[0] == 0 else capture(ranks[0])[0])
                 for name, ranks in expert_roles(seen, plan.degrees(), plan.size)]
    else:
        roles = [RankRole("every rank", tuple(range(plan.size)), estimate)]  # tp, cp and dp ranks run the same ops
    record = {**plan.as_dict(), "microbatch": micro, "microbatches": micro_batches, "batch": batch}
    if plan.tp > 1:
        from fxflops.parallel.replicated import replicated_work

        record["replicated"] = replicated_work(roles, count(None, False), plan.tp)
    # the roles keep their own estimates (no cycle through `ranks`); replace() keeps the capture behind
    # explain() and compare(), which a copy (through __getstate__) would drop
    return dataclasses.replace(roles[0].estimate, parallel=record, ranks=roles)


def gradient_reductions_marked(collectives: list[Collective], units: tuple[set[str], set[str]]) -> list[Collective]:
    """The collectives, the backward all-reduces and reduce-scatters that FSDP or DDP run for a unit they
    wrapped, over a data-parallel group, marked per_step (gradient synchronisation: once per optimizer step,
    see Collective.per_step); `units`: apply_plan's (unit names, group names). The unit's name, not the group
    alone: ring attention's backward reduce-scatters k/v gradients over the cp group, which FSDP shares
    under cp, once per micro-batch."""
    names, groups = units
    return [dataclasses.replace(c, per_step=True) if c.is_backward and c.op in (ALL_REDUCE, REDUCE_SCATTER)
            and c.group in groups and c.module in names else c for c in collectives]


def _leading_dimension(inputs: tuple[tuple, dict]) -> int | None:
    """The first input tensor's first dimension (the micro-batch's samples), positional then keyword."""
    args, kwargs = inputs
    first = next((value for value in (*args, *kwargs.values()) if value is not None), None)
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else None


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """torch.distributed's fake process group of `world_size` ranks as `rank`, destroyed on the way out."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mesh(plan: Parallel) -> DeviceMesh | None:
    degrees = plan.degrees()
    if not degrees:
        return None
    return init_device_mesh("cpu", tuple(degrees.values()), mesh_dim_names=tuple(degrees))


@contextlib.contextmanager
def composable_states_restored() -> Iterator[None]:
    """torch's table of composable states (fully_shard's, per module) as it was, on the way out: the capture's
    isolation takes the state off the module again, and a stale entry would refuse the next plan."""
    from torch.distributed._composable_state import _module_state_mapping

    before = set(_module_state_mapping.keys())
    try:
        yield
    finally:
        for module in [m for m in list(_module_state_mapping.keys()) if m not in before]:
            _module_state_mapping.pop(module, None)


def tp_styles(model: torch.nn.Module, plan: Parallel) -> dict[str, Any]:
    """{module path: ParallelStyle}: the user's tp_plan, else the Megatron-style plan derived from the model."""
    if plan.tp == 1:
        return {}
    styles = plan.tp_plan if plan.tp_plan is not None else megatron_plan(model, plan.sequence_parallel)
    if not styles:
        raise ValueError(f"parallel plan: found no attention or MLP block in {type(model).__name__} to split "
                         "tensor-parallel (column-parallel q/k/v, fused c_attn or up/gate linears before one "
                         "row-parallel o/down/c_proj linear); give your own tp_plan={module path: ParallelStyle}")
    return styles


def apply_plan(model: torch.nn.Module, plan: Parallel, mesh: DeviceMesh, styles: dict[str, Any],
               seen: RoutedCounts | None = None) -> tuple[set[str], set[str]]:
    """Shard the (fake-tensor) model as the plan says, with torch's own APIs (`styles`: see tp_styles;
    `seen` collects the tokens routed to each expert under expert parallelism). Returns the names of the
    modules FSDP or DDP wrapped as units and the names of the process groups they reduce gradients over."""
    from torch.distributed.tensor.parallel import parallelize_module

    if styles:
        parallelize_module(model, mesh["tp"], styles)
    experts = apply_experts(model, mesh["ep"], seen if seen is not None else RoutedCounts()) if plan.ep > 1 else []
    if plan.cp > 1:
        apply_context(model, mesh["cp"])
    if plan.dp == 1 and plan.cp == 1:
        return set(), set()
    dims = plan.data_parallel_dims()
    if len(dims) == 1:
        dp_mesh = mesh[dims[0]]
    elif plan.ep > 1 or plan.cp > 1:  # one FSDP dimension over both (flattened)
        dp_mesh = mesh[dims]._flatten("_".join(dims))
    else:
        dp_mesh = mesh[dims]  # 2-D under HSDP: replicate, shard
    groups = {dp_mesh.get_group(dim).group_name for dim in range(dp_mesh.ndim)}
    wrapped: list[torch.nn.Module] = []
    if plan.fsdp:
        from torch.distributed.fsdp import fully_shard

        if plan.ep > 1 and plan.dp > plan.ep:
            # the expert parameters: sharded over the dp ranks holding the same experts (torchtitan's dp_mod_ep)
            for module in {id(m): m for m in _owners(model, experts)}.values():
                fully_shard(module, mesh=mesh["dp_mod_ep"], reshard_after_forward=plan.reshard_after_forward)
                wrapped.append(module)
            groups.add(mesh["dp_mod_ep"].get_group().group_name)
            experts = []
        ignored = set(experts)  # dp == ep: each rank's experts are its own whole

        def wrap(module: torch.nn.Module) -> None:
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=plan.reshard_after_forward, ignored_params=ignored)
    else:  # DDP as torch builds it on FSDP2's machinery: parameters whole, gradients all-reduced per unit
        from torch.distributed._composable.replicate_with_fsdp import replicate

        def wrap(module: torch.nn.Module) -> None:
            replicate(module, mesh=dp_mesh)
    for unit in [*data_parallel_units(model, plan), model]:
        wrap(unit)
        wrapped.append(unit)
    ids = {id(module) for module in wrapped}
    return {name for name, module in model.named_modules() if id(module) in ids}, groups


def data_parallel_units(model: torch.nn.Module, plan: Parallel) -> list[torch.nn.Module]:
    """The modules sharded (or replicated) as one unit each before the root: every repeated block; under a
    pipeline also each module outside the blocks that holds parameters (the embedding, the final norm, the
    head), so that each stage gathers and reduces only what it holds, as a pipeline's stage modules do."""
    blocks = repeated_blocks(model)
    units = [block for _, block in blocks]
    if plan.pp > 1:
        inside = tuple(f"{name}." for name, _ in blocks)
        containers = {""} | {name.rsplit(".", i)[0] for name, _ in blocks for i in range(1, name.count(".") + 1)}
        for name, module, alias in walk_modules(model):
            if alias is None and name not in containers and not name.startswith(inside) \
                    and (parent_name(name) or "") in containers and next(module.parameters(), None) is not None \
                    and all(name != block for block, _ in blocks):
                units.append(module)
    return units


def _owners(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[torch.nn.Module]:
    """The modules holding `params` directly."""
    wanted = {id(p) for p in params}
    return [m for m in model.modules() if any(id(p) in wanted for p in m.parameters(recurse=False))]
