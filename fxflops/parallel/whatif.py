"""What-if plans: one rank of a job that does not exist, on torch.distributed's own fake process group.

For each rank role (ranks that run the same ops), a fake process group of the plan's world size is
initialized as one of those ranks, a DeviceMesh is built over it, and the capture applies the plan to
meta twins of the model's tensors with torch's own APIs (parallelize_module, FSDP2's fully_shard; the
shards then get fake twins: capture.eager) before the forward: what the rank runs is what torch runs.
Everything the plan changed on the model is undone by the capture's isolation, torch's table of
composable states is put back, and the process group is destroyed again, also when something fails.
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
from fxflops.parallel.buckets import Gradient, bucketed
from fxflops.parallel.context import apply_context, check_context
from fxflops.parallel.experts import RoutedCounts, apply_experts, expert_roles
from fxflops.parallel.megatron import HEAD_NAMES, TiedHead, megatron_plan
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

    def capture(rank: int) -> tuple[Estimate, RoutedCounts, tuple[str, str] | None, list[Gradient]]:
        seen, units = RoutedCounts(), []  # units: apply_plan's data-parallel (unit names, group names, gradients)
        with fake_world(plan.size, rank), composable_states_restored() as forget, _loss_parallel(plan.loss_parallel):
            mesh = _mesh(plan)

            def prepare(fake_model: torch.nn.Module) -> None:
                # a capture that runs again (a re-capture without replay) applies the plan afresh: FSDP's states
                # of the run before, which its isolation took off the model, leave torch's table (fully_shard
                # refuses a module it holds one for), and the tokens routed to the experts are noted anew
                forget()
                seen.calls.clear()
                units.append(apply_plan(fake_model, plan, mesh, styles, seen))

            try:
                estimate = count(None if mesh is None else prepare, plan.pp == 1 or stage_memory is None)
            except CaptureError as error:
                if styles and plan.tp_plan is None:  # the derived plan sharded what the model's code reads whole
                    error.advice = "; ".join(filter(None, (error.advice, _DERIVED_TP_ADVICE.format(tp=plan.tp))))
                raise
            if units and units[-1][0]:
                estimate.collectives = gradient_reductions_marked(estimate.collectives, units[-1][:2])
            pp_group = mesh["pp"].get_group() if plan.pp > 1 else None
            return estimate, seen, None if pp_group is None else (pp_group.group_name, pp_group.group_desc), \
                units[-1][2] if units else []

    first = capture(0)
    estimate, seen, _, _ = first
    # tp, cp and dp ranks run the same ops; ranks whose experts receive other token counts run other ops (a
    # capture per expert role); a pipeline's stages differ (each capture cut into them): roles are both at once
    routed = expert_roles(seen, plan.degrees(), plan.size, plan.expert_dims()) if plan.ep > 1 \
        else [("every rank", tuple(range(plan.size)))]
    roles = []
    for name, ranks in routed:
        rank_estimate, _, pp_group, gradients = first if ranks[0] == 0 else capture(ranks[0])
        found = [RankRole(name, ranks, rank_estimate)]
        if pp_group is not None:
            from fxflops.parallel.pipeline import pipeline_roles

            found = [RankRole(stage.name if len(routed) == 1 else f"{stage.name}, {name}",
                              tuple(sorted(set(stage.ranks) & set(ranks))), stage.estimate)
                     for stage in pipeline_roles(model, rank_estimate, plan, pp_group, stage_memory, micro_batches)]
        for role in found:  # DDP: its gradient buckets (a pipeline rank's DDP holds its own stages' parameters)
            if gradients:
                held = None if pp_group is None else set(role.estimate.source.captured.modules)
                role.estimate.collectives = bucketed(role.estimate.collectives, gradients, plan.bucket_cap_mb, held)
        roles += found
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
def composable_states_restored() -> Iterator[Callable[[], None]]:
    """torch's table of composable states (fully_shard's, per module) as it was, on the way out: the capture's
    isolation takes the state off the module again, and a stale entry would refuse the next plan. Yields
    the function that puts the table back as it was before, for a plan applied again inside."""
    from torch.distributed._composable_state import _module_state_mapping

    before = set(_module_state_mapping.keys())

    def forget() -> None:
        for module in [m for m in list(_module_state_mapping.keys()) if m not in before]:
            _module_state_mapping.pop(module, None)

    try:
        yield forget
    finally:
        forget()


def _loss_parallel(enabled: bool) -> contextlib.AbstractContextManager:
    """torch's loss_parallel() (its cross-entropy over vocabulary-sharded logits, forward and backward) for
    the capture, or nothing."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def tp_styles(model: torch.nn.Module, plan: Parallel) -> dict[str, Any]:
    """{module path: ParallelStyle}: the user's tp_plan, else the Megatron-style plan derived from the model."""
    if plan.tp == 1:
        return {}
    styles = plan.tp_plan if plan.tp_plan is not None else \
        megatron_plan(model, plan.sequence_parallel, plan.loss_parallel)
    if not styles:
        raise ValueError(f"parallel plan: found no attention or MLP block in {type(model).__name__} to split "
                         "tensor-parallel (column-parallel q/k/v, fused c_attn or up/gate linears before one "
                         "row-parallel o/down/c_proj linear); give your own tp_plan={module path: ParallelStyle}")
    if plan.loss_parallel and plan.tp_plan is None and not any(isinstance(s, TiedHead) for s in styles.values()):
        raise ValueError(f"parallel plan: loss_parallel splits the output head's logits, and {type(model).__name__} "
                         f"has no Linear named {' or '.join(HEAD_NAMES)}; give your own tp_plan sharding its head "
                         "with output_layouts=Shard(-1), use_local_output=False")
    return styles


def apply_plan(model: torch.nn.Module, plan: Parallel, mesh: DeviceMesh, styles: dict[str, Any],
               seen: RoutedCounts | None = None) -> tuple[set[str], set[str], list[Gradient]]:
    """Shard the model (its tensors meta twins: capture.eager) as the plan says, with torch's own APIs
    (`styles`: see tp_styles; `seen` collects the tokens routed to each expert under expert parallelism).
    Returns the names of the modules FSDP or DDP wrapped as units, the names of the process groups they
    reduce gradients over, and under DDP the gradients each unit reduces (for DDP's buckets:
    fxflops.parallel.buckets)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if styles:
        parallelize_module(model, mesh["tp"], styles)
    seen = seen if seen is not None else RoutedCounts()
    flattened: dict[tuple[str, ...], DeviceMesh] = {}  # (torch asks that flattened meshes be kept, not sliced)
    experts = apply_experts(model, _flat(mesh, plan.expert_dims(), flattened), seen) if plan.ep > 1 else []
    if plan.cp > 1:
        apply_context(model, mesh["cp"])
    replicated, sharded = plan.gradient_dims()
    if not replicated and not sharded:
        return set(), set(), []
    groups: set[str] = set()
    wrapped: list[torch.nn.Module] = []
    reduced_over: dict[int, str] = {}  # id(unit) -> the group DDP all-reduces its gradients over

    def wrap(module: torch.nn.Module, dims: tuple[tuple[str, ...], tuple[str, ...]], ignored: set) -> bool:
        """FSDP2's fully_shard over the sharded dims (HSDP: a 2-D mesh, replicas outside), else torch's
        replicate() (DDP on FSDP2's machinery: parameters whole, gradients all-reduced) over the replicated
        ones; False where neither has a rank to reduce with."""
        replicate_over, shard_over = (_flat(mesh, names, flattened) if names else None for names in dims)
        if shard_over is None and replicate_over is None:
            return False
        if shard_over is not None:
            from torch.distributed.fsdp import fully_shard

            unit_mesh = shard_over if replicate_over is None else \
                DeviceMesh._concatenate([replicate_over, shard_over])  # HSDP's 2-D (replicate, shard) mesh
            fully_shard(module, mesh=unit_mesh, reshard_after_forward=plan.reshard_after_forward,
                        ignored_params=ignored)
        else:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            unit_mesh = replicate_over
            replicate(module, mesh=unit_mesh, ignored_params=ignored)
        groups.update(unit_mesh.get_group(dim).group_name for dim in range(unit_mesh.ndim))
        reduced_over[id(module)] = unit_mesh.get_group(unit_mesh.ndim - 1).group_name
        wrapped.append(module)
        return True

    ignored: set[torch.nn.Parameter] = set()
    units = [*data_parallel_units(model, plan), model]
    owners = list({id(m): m for m in _owners(model, experts)}.values())
    if experts and not any(plan.gradient_dims(experts=True)):
        # where no other rank holds a rank's experts (dp*cp == ep, no replicas) they are its own whole, which
        # the other units leave be
        ignored, owners = set(experts), []
    gradients = [] if plan.fsdp else _gradients(model, [*owners, *units], ignored)
    for module in owners:
        # the expert parameters: reduced over the data-parallel ranks holding the same experts (torchtitan's
        # dp_mod_ep, Megatron's expert-data-parallel group)
        wrap(module, plan.gradient_dims(experts=True), set())
    for unit in units:
        wrap(unit, (replicated, sharded), ignored)
    ids = {id(module) for module in wrapped}
    names = {name: module for name, module in model.named_modules() if id(module) in ids}
    gradients = [dataclasses.replace(g, group=reduced_over.get(id(names.get(g.unit)), "")) for g in gradients]
    return set(names), groups, gradients


def _gradients(model: torch.nn.Module, units: list[torch.nn.Module], ignored: set) -> list[Gradient]:
    """Each parameter's gradient a DDP unit reduces, in registration order, with its unit (the innermost
    unit holding it) and its local bytes (a tensor-parallel shard's)."""
    from torch.distributed.tensor import DTensor

    names = {id(module): name for name, module in model.named_modules()}
    prefixes = sorted((names[id(unit)] for unit in units), key=len, reverse=True)
    found = []
    for name, param in model.named_parameters():
        if param in ignored or not param.requires_grad:
            continue
        unit = next(p for p in prefixes if not p or name.startswith(p + "."))
        local = param.to_local() if isinstance(param, DTensor) else param
        found.append(Gradient(name, unit, local.numel() * local.element_size(),
                              str(local.dtype).removeprefix("torch.")))
    return found


def _flat(mesh: DeviceMesh, names: tuple[str, ...], flattened: dict[tuple[str, ...], DeviceMesh]) -> DeviceMesh:
    """The 1-D mesh over `names`: one dimension, or several flattened into one named by joining them (once:
    `flattened` keeps them)."""
    if len(names) == 1:
        return mesh[names[0]]
    if names not in flattened:
        flattened[names] = mesh[names]._flatten("_".join(names))
    return flattened[names]


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
