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

from fxflops.capture.module_walk import walk_modules
from fxflops.parallel.megatron import megatron_plan
from fxflops.parallel.plan import Parallel, repeated_blocks
from fxflops.results import Estimate, RankRole
from fxflops.results.parallel import ALL_REDUCE, REDUCE_SCATTER, Collective
from fxflops.tree import parent_name

Prepare = Callable[[torch.nn.Module], None]


def estimate_plan(model: torch.nn.Module, parallel: Parallel | dict[str, Any] | str,
                  count: Callable[[Prepare | None, bool], Estimate], inputs: Any = (),
                  stage_memory: Callable[..., Any] | None = None) -> Estimate:
    """`count(prepare, whole_memory)` (estimate()'s own capture and count, with `prepare` applied to the fake
    model; its memory= only with `whole_memory`: pipeline ranks read theirs from their stages) run
    on the plan's rank 0, one estimate per rank role (tp, cp and data-parallel ranks run the same ops; a
    pipeline's stages differ: fxflops.parallel.pipeline); the first role's estimate, with every role in
    `ranks`. `inputs`: estimate()'s inputs, positional then keyword: one micro-batch (the first tensor's
    leading dimension is its size). `stage_memory(captured, nodes=, holds=)`: a pipeline stage's memory
    (estimate_memory with estimate()'s optimizer and options), for each pipeline rank under memory=."""
    plan = Parallel.of(parallel)
    plan.check(model)
    micro, micro_batches, batch = plan.batches(_leading_dimension(inputs))
    if dist.is_available() and dist.is_initialized():
        raise ValueError("a what-if plan (parallel=...) builds its own fake process group, and one is already "
                         "initialized: to count your own sharded model, call estimate() without parallel=")
    styles = tp_styles(model, plan)
    with fake_world(plan.size, 0), composable_states_restored():
        mesh = _mesh(plan)
        estimate = count(None if mesh is None else lambda fake_model: apply_plan(fake_model, plan, mesh, styles),
                         plan.pp == 1 or stage_memory is None)
        if plan.dp > 1:
            estimate.collectives = gradient_reductions_marked(estimate.collectives, plan, mesh)
        if plan.pp > 1:
            from fxflops.parallel.pipeline import pipeline_roles

            pp_group = mesh["pp"].get_group()
            roles = pipeline_roles(model, estimate, plan, (pp_group.group_name, pp_group.group_desc),
                                   stage_memory, micro_batches)
        else:
            roles = [RankRole("every rank", tuple(range(plan.size)), estimate)]
    record = {**plan.as_dict(), "microbatch": micro, "microbatches": micro_batches, "batch": batch}
    if plan.tp > 1:
        from fxflops.parallel.replicated import replicated_work

        record["replicated"] = replicated_work(roles, count(None, False), plan.tp)
    # the roles keep their own estimates (no cycle through `ranks`); replace() keeps the capture behind
    # explain() and compare(), which a copy (through __getstate__) would drop
    return dataclasses.replace(roles[0].estimate, parallel=record, ranks=roles)


def gradient_reductions_marked(collectives: list[Collective], plan: Parallel, mesh: DeviceMesh) -> list[Collective]:
    """The collectives, the backward all-reduces and reduce-scatters over a data-parallel group marked
    per_step (gradient synchronisation: once per optimizer step, see Collective.per_step)."""
    groups = {mesh[dim].get_group().group_name for dim in plan.data_parallel_dims()}
    return [dataclasses.replace(c, per_step=True) if c.is_backward and c.op in (ALL_REDUCE, REDUCE_SCATTER)
            and c.group in groups else c for c in collectives]


def _leading_dimension(inputs: Any) -> int | None:
    """The first input's first dimension (the micro-batch's samples), if that input is a tensor."""
    first = inputs[0] if isinstance(inputs, tuple | list) and inputs else None
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
                         "tensor-parallel (column-parallel q/k/v or up/gate linears before one row-parallel "
                         "o/down linear); give your own tp_plan={module path: ParallelStyle}")
    return styles


def apply_plan(model: torch.nn.Module, plan: Parallel, mesh: DeviceMesh, styles: dict[str, Any]) -> None:
    """Shard the (fake-tensor) model as the plan says, with torch's own APIs (`styles`: see tp_styles)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if styles:
        parallelize_module(model, mesh["tp"], styles)
    if plan.dp > 1:
        dims = plan.data_parallel_dims()
        dp_mesh = mesh[dims[0]] if len(dims) == 1 else mesh[dims]  # 2-D under HSDP: replicate, shard
        if plan.fsdp:
            from torch.distributed.fsdp import fully_shard

            def wrap(module: torch.nn.Module) -> None:
                fully_shard(module, mesh=dp_mesh, reshard_after_forward=plan.reshard_after_forward)
        else:  # DDP as torch builds it on FSDP2's machinery: parameters whole, gradients all-reduced per unit
            from torch.distributed._composable.replicate_with_fsdp import replicate

            def wrap(module: torch.nn.Module) -> None:
                replicate(module, mesh=dp_mesh)
        for unit in data_parallel_units(model, plan):
            wrap(unit)
        wrap(model)


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
