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

from fxflops.parallel.context import apply_context, check_context
from fxflops.parallel.experts import RoutedCounts, apply_experts, expert_roles
from fxflops.parallel.megatron import megatron_plan
from fxflops.parallel.plan import Parallel, repeated_blocks
from fxflops.results import Estimate, RankRole

Prepare = Callable[[torch.nn.Module], None]


def estimate_plan(model: torch.nn.Module, parallel: Parallel | dict[str, Any] | str,
                  count: Callable[[Prepare | None], Estimate], inputs: tuple[tuple, dict] = ((), {})) -> Estimate:
    """`count(prepare)` (estimate()'s own capture and count, with `prepare` applied to the fake model) run
    once per rank role under the plan; the first role's estimate, with every role in `ranks`. `inputs`
    (args, kwargs): the example inputs, checked against the plan."""
    plan = Parallel.of(parallel)
    plan.check(model)
    if plan.cp > 1:
        check_context(plan.cp, *inputs)
    if dist.is_available() and dist.is_initialized():
        raise ValueError("a what-if plan (parallel=...) builds its own fake process group, and one is already "
                         "initialized: to count your own sharded model, call estimate() without parallel=")
    styles = tp_styles(model, plan)

    def capture(rank: int) -> tuple[Estimate, RoutedCounts]:
        seen = RoutedCounts()
        with fake_world(plan.size, rank), composable_states_restored():
            mesh = _mesh(plan)
            return count(None if mesh is None else
                         lambda fake_model: apply_plan(fake_model, plan, mesh, styles, seen)), seen

    first, seen = capture(0)
    done = [RankRole("every rank", tuple(range(plan.size)), first)]  # tp and FSDP ranks all run the same ops
    if plan.ep > 1:  # ranks whose experts receive other token counts run other ops: a role each
        roles = expert_roles(seen, plan.degrees(), plan.size)
        done = [RankRole(name, ranks, first if ranks[0] == 0 else capture(ranks[0])[0]) for name, ranks in roles]
    # the roles keep their own estimates (no cycle through `ranks`); replace() keeps the capture behind
    # explain() and compare(), which a copy (through __getstate__) would drop
    return dataclasses.replace(done[0].estimate, parallel=plan.as_dict(), ranks=done)


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


def apply_plan(model: torch.nn.Module, plan: Parallel, mesh: DeviceMesh, styles: dict[str, Any],
               seen: RoutedCounts | None = None) -> None:
    """Shard the (fake-tensor) model as the plan says, with torch's own APIs (`styles`: see tp_styles;
    `seen` collects the tokens routed to each expert under expert parallelism)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if styles:
        parallelize_module(model, mesh["tp"], styles)
    experts = apply_experts(model, mesh["ep"], seen if seen is not None else RoutedCounts()) if plan.ep > 1 else []
    if plan.cp > 1:
        apply_context(model, mesh["cp"])
    if plan.dp > 1 or plan.cp > 1:
        from torch.distributed.fsdp import fully_shard

        dims = plan.data_parallel_dims()
        if len(dims) == 1:
            dp_mesh = mesh[dims[0]]
        elif plan.ep > 1 or plan.cp > 1:  # one FSDP dimension over both (flattened)
            dp_mesh = mesh[dims]._flatten("_".join(dims))
        else:
            dp_mesh = mesh[dims]  # 2-D under HSDP: replicate, shard
        if plan.ep > 1 and plan.dp > plan.ep:
            # the expert parameters: sharded over the dp ranks holding the same experts (torchtitan's dp_mod_ep)
            for module in {id(m): m for m in _owners(model, experts)}.values():
                fully_shard(module, mesh=mesh["dp_mod_ep"], reshard_after_forward=plan.reshard_after_forward)
            experts = []
        ignored = set(experts)  # dp == ep: each rank's experts are its own whole
        for _, block in repeated_blocks(model):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=plan.reshard_after_forward, ignored_params=ignored)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=plan.reshard_after_forward, ignored_params=ignored)


def _owners(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[torch.nn.Module]:
    """The modules holding `params` directly."""
    wanted = {id(p) for p in params}
    return [m for m in model.modules() if any(id(p) in wanted for p in m.parameters(recurse=False))]
