"""A torch.distributed.pipelining schedule: what one `schedule.step(...)` runs and sends on this rank.

estimate(schedule, args, kwargs) stands for one `schedule.step(*args, **kwargs)` call of this rank (the same
arguments: the whole batch on the first stage, `target=` on the last, nothing on a middle one):

- the send/recv records are what torch's own schedule issues: its step runs once, on fake tensors (the
  stages' modules get fake twins, put back after, as a capture does), and each point-to-point op it calls
  (`c10d.send` / `c10d.recv_`, whether from `batch_isend_irecv`, `isend`/`irecv` or `send`/`recv`) is
  recorded with its bytes, peer, phase, stage and micro-batch, and never reaches the process group, fake
  or real (nothing waits on another rank). The schedule and its stages are left as they were.
- the FLOPs are each of the rank's stages counted on one micro-batch as the schedule splits it (the first
  stage: the schedule's own split of the step's inputs; another stage: the activations its metadata says it
  receives), with the schedule's loss on the last stage's micro-batch of `target`; forward and backward as
  the schedule runs them (backward when it has a loss function). A split backward (the zero-bubble schedules'
  input-gradient and weight-gradient passes) is the same stage backward, each part once.
- stages from torch's tracer splitter (`pipeline(...).build_stage(...)`) count under the names their modules
  have; the one-time warm-up of their communicators on a first step is not the step's traffic.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxflops.results import BACKWARD, FORWARD, Estimate, RankRole
from fxflops.results.parallel import RECV, SEND, Collective
from fxflops.parallel.collectives import wire_bytes
from fxflops.capture.torch_versions import microbatch_inputs, stage_input_metas, stage_peer_global_rank

# c10d's point-to-point ops (the target a record names) -> kind
_P2P = {"send": SEND, "recv_": RECV}

# count(stage, args, kwargs, loss, backward) -> the stage's Estimate on one micro-batch
StageCount = Callable[[Any, tuple, dict, Any, bool], Estimate]


def schedule_stages(schedule: Any) -> list[Any]:
    """The stages this rank runs: one for a single-stage schedule (GPipe, 1F1B), several for the looped ones."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def estimate_schedule(schedule: Any, args: tuple, kwargs: dict, count: StageCount) -> Estimate:
    """One `schedule.step(*args, **kwargs)` of this rank: its first stage's estimate per micro-batch, the step's
    send/recv records (then the stage's own collectives, once per micro-batch) and, for a rank holding several
    stages, one RankRole per stage in `ranks` (see the module's docstring)."""
    stages = schedule_stages(schedule)
    step_options = {key: kwargs.pop(key) for key in ("target", "losses", "return_outputs", "loss_kwargs", "arg_mbs",
                                                    "kwarg_mbs", "target_mbs") if key in kwargs}
    backward = bool(schedule._has_backward)
    records, received = recorded_p2p(schedule, args, {**kwargs, **step_options})
    args_split, kwargs_split, targets = microbatch_inputs(
        schedule, args, kwargs, step_options.get("target"), step_options.get("arg_mbs"), step_options.get("kwarg_mbs"),
        step_options.get("target_mbs"))
    n = schedule._n_microbatches
    estimates = []
    for stage in stages:
        if stage.is_first:
            stage_args, stage_kwargs = tuple(args_split[0]), dict(kwargs_split[0])
        else:
            stage_args, stage_kwargs = received_inputs(stage.stage_index, received[stage.stage_index]), {}
        loss = None
        if stage.is_last and backward:
            target = targets[0] if targets else None
            loss_kwargs = step_options.get("loss_kwargs")
            # (loss_kwargs only where given: torch 2.11's _compute_loss takes the output and target alone)
            loss = lambda output, target=target, loss_kwargs=loss_kwargs: schedule._compute_loss(  # noqa: E731
                output, target, *([loss_kwargs] if loss_kwargs else []))
        estimates.append(count(stage, stage_args, stage_kwargs, loss, backward))
    # the collectives the stage's own capture recorded (tensor parallelism's, FSDP's), not the send/recv a
    # stage's estimate derives from its inputs and outputs: the schedule's step said which it really issues
    own = [dataclasses.replace(c, micro_batch=i, stage=stage.stage_index)
           for stage, e in zip(stages, estimates, strict=True) for i in range(n) for c in e.collectives if c.node]
    result = dataclasses.replace(estimates[0], collectives=records + own)
    if len(stages) > 1:
        import torch.distributed as dist

        rank = dist.get_rank()
        # each stage's entry holds that stage's share of the step's records (not the whole step's on the first,
        # nor the send/recv a stage's estimate derives from one micro-batch on the others): summed over the
        # entries, the step's
        result.ranks = [RankRole(f"pipeline stage {stage.stage_index}", (rank,), dataclasses.replace(
                            e, collectives=[c for c in (*records, *own) if c.stage == stage.stage_index]))
                        for stage, e in zip(stages, estimates, strict=True)]
    return result


def received_inputs(index: int, metas: Any) -> tuple:
    """A stage's micro-batch inputs as it receives them: meta tensors of its metadata's shapes and dtypes,
    requiring a gradient where the metadata says so (the gradient the stage sends back)."""
    if metas is None:
        raise ValueError(f"pipeline stage {index} has no input metadata; give PipelineStage its input_args= "
                         "(and output_args=)")
    return tuple(torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta").requires_grad_(m.requires_grad)
                 if m is not None else None for m in metas)


def recorded_p2p(schedule: Any, args: tuple, kwargs: dict) -> tuple[list[Collective], dict[int, Any]]:
    """The point-to-point ops one `schedule.step(*args, **kwargs)` issues on this rank, in order (see the
    module's docstring), and each stage's input metadata (stage index -> TensorMetas) as the step had it; the
    schedule, its stages, their modules and the inputs are left as they were."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxflops.capture.eager import FakeTwins
    from fxflops.capture.isolation import isolated
    from fxflops.capture.reach import Reach
    from fxflops.capture.twins import swap_tensors

    stages = schedule_stages(schedule)
    _check_initialized(schedule, stages)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    twins = FakeTwins(mode, torch.device(stages[0].device))
    # the schedule and its stages are reached from the inputs: their bookkeeping (recv buffers, caches,
    # metadata, initialization flags) is put back with the rest
    reach = Reach((schedule, args, kwargs))
    with contextlib.ExitStack() as stack:
        for index, stage in enumerate(stages):
            modules = stack.enter_context(isolated(stage.submod, reach if index == 0 else None))
            swap_tensors(modules, twins)
        fake_args, fake_kwargs = Reach((args, kwargs)).with_twins(twins)
        recorder = _P2PRecorder(schedule, stages)
        with torch.enable_grad(), mode, recorder:
            schedule.step(*fake_args, **fake_kwargs)
        # what each stage receives, as the step settled it (the user's static metadata, or inferred)
        inputs = {stage.stage_index: stage_input_metas(stage) for stage in stages}
    return recorder.records, inputs


def _check_initialized(schedule: Any, stages: list[Any]) -> None:
    """Under a real process group a schedule's first step has its ranks vote on how to learn the stages' shapes
    (values another rank sends, which a step on fake tensors cannot receive): estimate it after a real step.
    Stages from torch's tracer splitter know their shapes from the trace: their first step only warms up the
    communicators (answered here, nothing sent), so they need no real step first."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    if _initialized(schedule) or all(dist.get_backend(stage.group) == "fake" or not isinstance(stage, PipelineStage)
                                     for stage in stages):
        return
    raise ValueError(f"{type(schedule).__name__} has not run a step yet: its first step votes with the other ranks "
                     "over the process group, which an estimate does not reach. Estimate it after one real step, or "
                     "under torch.distributed's fake process group (FakeStore)")


def _initialized(schedule: Any) -> bool:
    """Whether the schedule has set its stages up (its first step's initialization is over)."""
    return bool(getattr(schedule, "_stages_forward_initialized",  # (looped schedules; single-stage ones)
                        getattr(schedule, "_stage_forward_initialized", False)))


class _P2PRecorder(TorchDispatchMode):
    """Records each c10d send/recv as a Collective and answers it with a finished work item (nothing is sent
    or received). The phase, stage and micro-batch come from the stages' own bookkeeping at that moment: a
    forward receive fills one of a stage's activation buffers, a backward one a gradient buffer; a forward
    send sends (a detached view of) an output the stage holds for that micro-batch; any other send is a
    gradient going back, of the micro-batch whose backward the stage began last (it took that micro-batch's
    forward cache). What the schedule sends while it sets its stages up on its first step (the warm-up exchange
    of a traced stage's communicators: one float each way per neighbour) is answered but not recorded: it is
    not the step's traffic, and a later step does not repeat it."""

    def __init__(self, schedule: Any, stages: list[Any]) -> None:
        super().__init__()
        self.schedule = schedule
        self.stages = stages
        self.records: list[Collective] = []
        self._cached: list[set[int]] = [set() for _ in stages]  # each stage's forward-cache keys at the last op
        self._last_backward: tuple[Any, int] | None = None  # (stage, micro-batch) of the latest backward begun

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self._observe()
        kind = _P2P.get(func._overloadpacket.__name__) if func.namespace == "c10d" else None
        if kind is None:
            return func(*args, **(kwargs or {}))
        from torch._C._distributed_c10d import FakeWork

        tensors, group, peer = args[0], args[1], int(args[2])
        for tensor in tensors if _initialized(self.schedule) else ():
            self.records.append(self._record(kind, tensor, group, peer))
        return FakeWork().boxed()

    def _record(self, kind: str, tensor: torch.Tensor, boxed_group: Any, peer: int) -> Collective:
        import torch.distributed as dist

        group = dist.ProcessGroup.unbox(boxed_group)
        peer = dist.get_global_rank(group, peer)
        phase, stage, micro_batch = self._where(kind, tensor, peer)
        payload = tensor.numel() * tensor.element_size()
        return Collective(op=kind, target=f"c10d.{'send' if kind == SEND else 'recv_'}.default", module="",
                          phase=phase, group=group.group_name, group_desc=getattr(group, "group_desc", "") or "",
                          group_size=group.size(), dtype=str(tensor.dtype).removeprefix("torch."), bytes=payload,
                          wire_bytes=wire_bytes(kind, payload, group.size()), peer=peer, stage=stage,
                          micro_batch=micro_batch)

    def _where(self, kind: str, tensor: torch.Tensor, peer: int) -> tuple[str, int | None, int | None]:
        for stage in self.stages:
            if kind == RECV:
                for infos, phase in ((stage.args_recv_info, FORWARD), (stage.grad_recv_info, BACKWARD)):
                    for chunk, held in infos.items():
                        if any(getattr(info, "buffer", None) is tensor for info in held):
                            return phase, stage.stage_index, chunk
            else:
                for chunk, (outputs, _) in stage.fwd_cache.items():
                    if any(_same_storage(tensor, out) for out in _tensors(outputs)):
                        return FORWARD, stage.stage_index, chunk
        if kind == SEND and self._last_backward is not None:  # a gradient sent back after that stage's backward
            stage, chunk = self._last_backward
            if not stage.is_first and stage_peer_global_rank(stage, stage.stage_index - 1) == peer:
                return BACKWARD, stage.stage_index, chunk
        return BACKWARD, None, None

    def _observe(self) -> None:
        """A stage's backward of a micro-batch starts by taking its forward's cache entry: seen at the next op."""
        for index, stage in enumerate(self.stages):
            now = set(stage.fwd_cache)
            gone = self._cached[index] - now
            if gone:
                self._last_backward = (stage, min(gone))
            self._cached[index] = now


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


def _same_storage(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    if not isinstance(b, torch.Tensor):
        return False
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        return StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return a is b
