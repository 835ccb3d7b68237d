"""Which plan is fastest: enumerate parallel plans, drop those that do not fit, rank by predicted step time.

`plan(model, ...)` captures the model once per (tensor-parallel degree, micro-batch) as per-layer costs
(`layers.LayerCosts`) and derives every other choice from them without capturing again: pipeline depth
and virtual stages (the layers cut into chunks, simulated micro-batch by micro-batch), data parallelism
(FSDP or replicated with a distributed optimizer), recomputation (none, selective, full). Memory per rank
comes from the same captures: the activations each layer saves (fxflops.memory's timeline) times the
micro-batches the schedule keeps in flight on the rank, plus parameters, gradients and optimizer state
divided as the plan divides them. `model` may be a callable building the model at a given depth: the
captures then run at a shallow depth (the same blocks, fewer of them), which is what keeps a search over
a 70B model in seconds. Every step time is a prediction (a model with a stated error), not a measurement.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fxflops.predict.comm_time import ranks_per_node
from fxflops.predict.hardware import Cluster, with_device
from fxflops.predict.layers import LayerCosts
from fxflops.predict.optimizer_time import resolve as resolve_optimizer
from fxflops.predict.schedule import GPIPE, ONE_F_ONE_B
from fxflops.predict.step import (DEEPSPEED, ERROR_STATEMENT, MEGATRON, PIPELINE_ENGINES, StepPlan, StepPrediction,
                                  capture_costs, dim_ranks_per_node, kernels_notes, simulate_plan,
                                  user_constants_note)
from fxflops.predict.step_memory import fits

GiB = 1 << 30
PROBE_LAYERS = 2  # depth a model factory is captured at: two blocks give the per-layer costs


@dataclass
class PlanRow:
    """One plan: its degrees and choices, the predicted step, and the memory per rank it needs."""

    plan: StepPlan
    prediction: StepPrediction
    peak_bytes: int  # the highest predicted memory of any rank (tensor bytes + allowance)
    memory: dict[str, int]  # that rank's tensor bytes by kind (step_memory.MEMORY_KINDS)
    fits: bool  # peak_bytes and the search's memory_margin within the device's memory

    @property
    def parallel(self) -> dict[str, Any]:
        """The plan as predict_step's parallel dict."""
        p = self.plan
        return {"tp": p.tp, "pp": p.pp, "dp": p.dp, "virtual_stages": p.virtual_stages, "fsdp": p.fsdp,
                "sequence_parallel": p.sequence_parallel, **{k: getattr(p, k) for k in ("cp", "ep") if getattr(p, k) > 1},
                **({"dp_shard": p.dp_shard} if p.dp_shard is not None else {})}

    @property
    def step_time(self) -> float:
        return self.prediction.step_time

    @property
    def schedule(self) -> str:
        """The pipeline schedule the plan runs (predict_step's `schedule=`): "interleaved" with virtual stages."""
        return "interleaved" if self.plan.virtual_stages > 1 else self.plan.schedule

    def record(self) -> dict[str, Any]:
        p, pred = self.plan, self.prediction
        return {"tp": p.tp, "pp": p.pp, "virtual_stages": p.virtual_stages, "schedule": self.schedule, "dp": p.dp,
                "cp": p.cp, "ep": p.ep,
                "fsdp": p.fsdp, "dp_shard": p.shard if p.fsdp else None, "sequence_parallel": p.sequence_parallel,
                "tp_comm_overlap": p.tp_comm_overlap, "pipeline_engine": p.pipeline_engine, "micro_batch": p.micro_batch,
                "microbatches": p.microbatches, "recompute": p.recompute, "step_time_s": pred.step_time,
                **{f"{k}_s": v for k, v in pred.breakdown.items()}, "mfu": pred.mfu, "hfu": pred.hfu,
                "tokens_per_sec": pred.tokens_per_sec, "peak_memory_gib": self.peak_bytes / GiB,
                **{f"{k}_gib": v / GiB for k, v in self.memory.items()}, "fits": self.fits}


@dataclass
class PlanSearch:
    """The plans a search ranked (fastest first), those it dropped for memory, and what it assumed."""

    rows: list[PlanRow]  # the plans that fit, fastest first
    dropped: list[PlanRow]  # the plans that do not fit in memory
    gpus: int
    cluster: str
    device: str
    capacity: int
    global_batch: int
    captures: int
    notes: list[str] = field(default_factory=list)
    error: str = ERROR_STATEMENT

    @property
    def best(self) -> PlanRow | None:
        return self.rows[0] if self.rows else None

    @property
    def evaluated(self) -> int:
        return len(self.rows) + len(self.dropped)

    def table(self, top: int = 10) -> str:
        """The top plans with their breakdown, one line each."""
        # cp and ep columns where a shown plan has them
        extra = [k for k in ("cp", "ep") if any(getattr(r.plan, k) > 1 for r in self.rows[:top])]
        hsdp = any(r.plan.dp_shard is not None for r in self.rows[:top])
        overlap = any(r.plan.tp_comm_overlap for r in self.rows[:top])
        head = (f"{'#':>3} {'tp':>3} {'pp':>3} {'v':>2} {'sched':>5} {'dp':>5} "
                + "".join(f"{k:>3} " for k in extra) + f"{'fsdp':>5} " + (f"{'shard':>5} " if hsdp else "")
                + (f"{'tpov':>5} " if overlap else "") + f"{'mb':>3} {'recompute':>9} "
                + f"{'step s':>8} {'compute':>8} {'comm':>7} {'bubble':>7} {'optim':>6} {'MFU':>6} {'mem GiB':>8}")
        lines = [head]
        for i, row in enumerate(self.rows[:top], 1):
            p, b = row.plan, row.prediction.breakdown
            lines.append(f"{i:>3} {p.tp:>3} {p.pp:>3} {p.virtual_stages:>2} {row.schedule[:5]:>5} {p.dp:>5} "
                         + "".join(f"{getattr(p, k):>3} " for k in extra) + f"{str(p.fsdp):>5} "
                         + (f"{p.shard if p.fsdp else '':>5} " if hsdp else "")
                         + (f"{str(p.tp_comm_overlap):>5} " if overlap else "")
                         + f"{p.micro_batch:>3} {p.recompute:>9} {row.step_time:>8.3f} {b['compute']:>8.3f} "
                         f"{b['exposed_comm']:>7.3f} {b['bubble']:>7.3f} {b['optimizer']:>6.3f} "
                         f"{row.prediction.mfu:>6.1%} {row.peak_bytes / GiB:>8.1f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()

    def render(self, top: int = 10) -> str:
        """The summary, the `top` fastest plans that fit, the notes and the stated error."""
        lines = [f"plans for {self.gpus} x {self.device} ({self.cluster}), global batch {self.global_batch}: "
                 f"{self.evaluated} evaluated from {self.captures} captures, {len(self.rows)} fit in "
                 f"{self.capacity / GiB:.0f} GiB, {len(self.dropped)} do not", self.table(top)]
        lines += [f"note: {note}" for note in self.notes]
        lines.append(f"({self.error})")
        return "\n".join(lines)

    def frontier(self) -> list[PlanRow]:
        """The plans that fit and that no other fitting plan beats on both step time and memory, by memory."""
        from fxflops.predict.frontier import frontier_rows

        return frontier_rows(self.rows)

    def to_html(self, path: str | Path | None = None) -> str:
        """An HTML page plotting every plan's predicted step time against its memory per rank, the frontier
        joined, the device's memory marked; written to `path` when given."""
        from fxflops.predict.frontier import frontier_html

        page = frontier_html(self)
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page

    def to_csv(self, path: str | Path | None = None, include_dropped: bool = True) -> str:
        rows = [r.record() for r in self.rows + (self.dropped if include_dropped else [])]
        out = io.StringIO()
        if rows:
            writer = csv.DictWriter(out, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        if path is not None:
            Path(path).write_text(out.getvalue())
        return out.getvalue()

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps({"gpus": self.gpus, "cluster": self.cluster, "device": self.device,
                           "capacity_bytes": self.capacity, "global_batch": self.global_batch,
                           "captures": self.captures, "notes": self.notes, "error": self.error,
                           "plans": [r.record() for r in self.rows], "dropped": [r.record() for r in self.dropped]},
                          indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text


def plan(model: torch.nn.Module | Callable[[int], torch.nn.Module], inputs: Any = None, *, gpus: int,
         cluster: str | Cluster = "DGX H100", global_batch: int, seq_len: int | None = None, layers: int | None = None,
         dtype: torch.dtype = torch.bfloat16, tp: Sequence[int] | None = None, pp: Sequence[int] | None = None,
         virtual_stages: Sequence[int] = (1, 2, 4), micro_batch: Sequence[int] = (1, 2, 4),
         recompute: Sequence[str] = ("none", "selective", "full"), fsdp: Sequence[bool] = (False, True),
         sequence_parallel: bool = True, loss: Callable[[Any], torch.Tensor] | None = None,
         memory_margin: int = 0, optimizer_state_bytes: int | None = None, optimizer: Any = None,
         optimizer_impl: str | None = None,
         device: str | Path | Any = None, cp: Sequence[int] = (1,), ep: Sequence[int] = (1,),
         attention: str = "flash", attention_dropout: float = 0.0,
         schedules: Sequence[str] = (ONE_F_ONE_B, GPIPE), dp_shard: Sequence[int] | None = None,
         tp_comm_overlap: Sequence[bool] = (False,), fuse_elementwise: bool = False,
         pipeline_engine: str = MEGATRON, persistent_norm: bool = False) -> PlanSearch:
    """Rank the parallel plans of `model` on `gpus` GPUs of `cluster` by predicted step time.

    `model`: a module, or a callable `build(layers)` returning the model at that depth (then `layers`, the real
    depth, is required and the captures run at a depth of 2). `inputs`: a callable `inputs(micro_batch)` giving
    one micro-batch, or None for token ids of shape (micro_batch, seq_len). Plans: tp (default: the divisors of
    the GPUs per node that divide the attention heads), pp (default: the divisors of gpus / tp that divide the
    layers), `virtual_stages` (interleaved 1F1B; layers must split evenly into pp x v chunks and the
    micro-batches into pp), dp = the rest, with `fsdp` and without (replicated parameters, the optimizer's state
    sharded dp ways), each `micro_batch` dividing global_batch / dp, each `recompute`. A plan fits when its
    busiest rank's predicted memory, the allowance included, is within the device's memory (`memory_margin`
    more bytes kept free): `fxflops.predict.step_memory`, as predict_step reports it. `optimizer_state_bytes`:
    the optimizer's state per parameter element (default 12: Adam with fp32 master weights and moments; with
    `optimizer`, its state tensors like the parameters: 4 for torch's AdamW on a bf16 model). `optimizer`,
    `optimizer_impl`: the optimizer step timed as the kernels torch.optim launches ("adamw", "adam", "sgd" or an
    instance; "foreach", "for_loop" or "fused"), as predict_step takes them; default one fused kernel (Megatron's,
    DeepSpeed's and Apex's optimizers).
    `device`: the cluster's GPUs replaced by this device (a preset, or a device file `calibrate` wrote).
    `cp` (context parallel degrees, for long sequences) and `ep` (expert parallel degrees, for MoE models):
    each degree above 1 (and each ep with each cp it is a multiple of: torchtitan's ep = dp_in_ep x cp) is
    captured once per tp, micro-batch and `fsdp` choice, and enumerated with every pp, virtual stages, schedule,
    FSDP or DDP (with the distributed optimizer) and recomputation where ep divides dp x cp; a degree the model
    or sequence cannot take is left out with a note.
    `attention`, `attention_dropout`: the attention kernels the run's software launches, as predict_step takes
    them ("flash", "cudnn" or "math"); under "math" each layer's activations include the (batch, heads, query, key)
    probabilities unfused attention keeps for its backward (and, with attention_dropout, the dropout's mask and
    output), which selective recomputation frees. `fuse_elementwise`: each chain of pointwise ops timed as one
    kernel, as predict_step takes it; `persistent_norm`: the layer norms as apex's persistent fast layer norm, as
    predict_step takes it. `pipeline_engine`: "megatron" (default) or "deepspeed" (DeepSpeed's
    PipelineEngine, as predict_step takes it): DeepSpeed runs a non-interleaved 1F1B and refuses ZeRO stages 2
    and 3 with a pipeline, so under it the search leaves out plans with virtual stages, GPipe, and FSDP with
    pp > 1 (a note says so). `schedules`: the pipeline schedules of plans with pp > 1 and one chunk a stage
    ("1f1b", "gpipe"; a plan with virtual stages runs interleaved 1F1B), each simulated: GPipe keeps every
    micro-batch's activations until its backward, so it needs more memory than 1F1B for the same bubble.
    `dp_shard`: HSDP's shard degrees to try beside FSDP over all of dp (each FSDP plan also as HSDP with each
    degree that divides its dp, is below it and, with ep, a multiple of ep / cp); None: every such divisor above 1;
    () for none. `tp_comm_overlap`: (False,) by default; (False, True) also tries each sequence-parallel plan with
    its tensor-parallel collectives overlapped with their GEMMs (Megatron-LM's --tp-comm-overlap, torchtitan's
    async TP)."""
    from fxflops.predict.op_time import Kernels
    from fxflops.parallel.plan import attention_heads, repeated_blocks

    kernels = Kernels(attention, attention_dropout, fuse_elementwise, persistent_norm)
    optimizer_step, optimizer_state_bytes = resolve_optimizer(
        optimizer, optimizer_impl, optimizer_state_bytes, torch.empty((), dtype=dtype).element_size(), "plan()")
    if pipeline_engine not in PIPELINE_ENGINES:
        raise ValueError(f"plan(): pipeline_engine={pipeline_engine!r}: pick one of {', '.join(PIPELINE_ENGINES)}")
    unknown = [name for name in schedules if name not in (ONE_F_ONE_B, GPIPE)]
    if unknown or not schedules:
        raise ValueError(f"plan(): schedules={tuple(schedules)!r}: pick from {ONE_F_ONE_B!r}, {GPIPE!r} (interleaved "
                         "1F1B is virtual_stages > 1)")
    the_cluster = with_device(cluster, device)
    device = the_cluster.device
    capacity = device.memory_bytes
    build = model if callable(model) and not isinstance(model, torch.nn.Module) else None
    if build is not None and layers is None:
        raise ValueError("plan(): a model factory needs layers=, the depth of the real model")
    probe = build(PROBE_LAYERS if layers is None or layers > PROBE_LAYERS else layers) if build else model
    depth = layers or len(repeated_blocks(probe))
    heads = [count for _, count in attention_heads(probe)]
    make_inputs = inputs if callable(inputs) else None
    if inputs is not None and make_inputs is None:
        raise ValueError("plan(): inputs= is a callable inputs(micro_batch) (each micro-batch size is captured), "
                         "or None for token ids (micro_batch, seq_len)")
    if make_inputs is None:
        if seq_len is None:
            raise ValueError("plan(): give seq_len= (token ids of that length are made) or inputs=")
        def make_inputs(mb: int) -> torch.Tensor:  # noqa: E306
            return torch.zeros(mb, seq_len, dtype=torch.long)
    gpn = the_cluster.gpus_per_node
    tps = list(tp) if tp is not None else [t for t in _divisors(min(gpn, gpus)) if gpus % t == 0
                                          and all(h % t == 0 for h in heads)]
    notes: list[str] = []
    # (tp, micro-batch, cp, ep, fsdp): per-layer costs; fsdp None for a capture without cp and ep, which serves
    # both (its data parallelism is the simulation's), True / False for cp and ep, whose captures run it
    costs_by: dict[tuple[int, int, int, int, bool | None], LayerCosts] = {}
    sp_of: dict[int, bool] = {}
    sp_works = True
    captures = 0
    failed: set[int] = set()
    for t in tps:
        for mb in micro_batch:
            if t in failed or not any(global_batch % (gpus // (t * p) * mb) == 0
                                      for p in _pipeline_degrees(gpus // t, depth, pp)):
                continue
            placed = {"tp": ranks_per_node(t, 1, the_cluster)}

            def capture(sp: bool) -> LayerCosts:
                nonlocal captures
                captures += 1
                return capture_costs(probe, make_inputs(mb), the_cluster, tp=t, sequence_parallel=sp, dtype=dtype,  # noqa: B023
                                     loss=loss, layers=depth, memory=True, placed=placed,  # noqa: B023
                                     kernels=kernels)

            # a model that cannot run sequence parallel at one tp will not at another: tried until it fails once
            want_sp = sequence_parallel and t > 1 and sp_of.get(t, sp_works)
            try:
                costs = capture(want_sp)
            except Exception as error:
                if t == 1:
                    raise
                try:
                    if not want_sp:
                        raise
                    costs = capture(False)  # sequence parallelism the model cannot run: the plan without it
                    notes.append(f"sequence parallelism failed on this model at tp={t} ({_first_line(error)}); "
                                 "plans run without it")
                    sp_of[t] = want_sp = sp_works = False
                except Exception as again:  # a tp the model cannot split: plans without it
                    notes.append(f"tp={t} left out: {_first_line(again)}")
                    failed.add(t)
                    continue
            sp_of.setdefault(t, want_sp)
            costs_by[(t, mb, 1, 1, None)] = costs
    for t in tps:  # context / expert parallel degrees: a capture each (and each FSDP choice), with the tp's
        for mb in micro_batch:  # sequence parallelism
            if t in failed:
                continue
            for c, e in _context_expert_degrees(gpus // t, cp, ep):
                if not any(_data_parallel(gpus, t, p, c, e, global_batch, mb)
                           for p in _pipeline_degrees(gpus // (t * c), depth, pp)):
                    continue
                for shard in dict.fromkeys(fsdp):
                    try:
                        captures += 1
                        costs_by[(t, mb, c, e, shard)] = capture_costs(
                            probe, make_inputs(mb), the_cluster, tp=t, dtype=dtype, loss=loss, layers=depth,
                            sequence_parallel=sp_of.get(t, False) and e == 1, memory=True, cp=c, ep=e,
                            kernels=kernels, fsdp=shard, placed=dim_ranks_per_node(
                                StepPlan(tp=t, dp=max(1, e // c), cp=c, ep=e), the_cluster))
                    except Exception as error:  # a degree this model or sequence cannot take: plans without it
                        degrees = ", ".join(f"{k}={d}" for k, d in (("cp", c), ("ep", e)) if d > 1)
                        notes.append(f"{degrees} at tp={t}, micro-batch {mb} left out: {_first_line(error)}")
                        break
    rows, dropped = [], []
    dtype_key = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, "bf16")
    for step_plan in _plans(gpus, depth, global_batch, costs_by, sp_of, pp, virtual_stages, recompute, fsdp, schedules,
                            dp_shard, tp_comm_overlap, pipeline_engine):
        costs = costs_by[(step_plan.tp, step_plan.micro_batch, step_plan.cp, step_plan.ep,
                          step_plan.fsdp if step_plan.cp * step_plan.ep > 1 else None)]
        if optimizer_step is not None:
            step_plan = dataclasses.replace(step_plan, optimizer_kernels=optimizer_step)
        prediction = simulate_plan(costs, step_plan, the_cluster, dtype_key, optimizer_state_bytes)
        top = prediction.peak_memory  # predict_step's own memory of this plan: one computation for both
        row = PlanRow(step_plan, prediction, top.total, top.by_kind, fits(top.total, capacity, memory_margin))
        (rows if row.fits else dropped).append(row)
    rows.sort(key=lambda r: r.step_time)
    dropped.sort(key=lambda r: r.peak_bytes)
    notes.extend(kernels_notes(kernels))  # what every plan's step assumed, as predict_step says it
    if optimizer_step is not None:  # each plan's own notes give its passes and bytes; the search names the choice
        notes.append(f"optimizer step timed as torch.optim's {optimizer_step.label} kernels (optimizer=, optimizer_impl=)")
    if pipeline_engine == DEEPSPEED:
        notes.append("pipeline_engine='deepspeed': plans with virtual stages, GPipe, and FSDP with pp > 1 left out "
                     "(DeepSpeed's PipelineEngine runs a non-interleaved 1F1B and refuses ZeRO stages 2 and 3)")
    if build is not None:
        notes.append(f"captured at a depth of {PROBE_LAYERS} layers (the same blocks), costs scaled to {depth}")
    if device.origin.startswith("your file"):
        notes.append(f"device constants from {device.origin}")
    if user_constants_note(the_cluster):
        notes.append(user_constants_note(the_cluster))
    return PlanSearch(rows, dropped, gpus, the_cluster.name, device.name, capacity, global_batch, captures, notes)


def _context_expert_degrees(rest: int, cp: Sequence[int], ep: Sequence[int]) -> list[tuple[int, int]]:
    """(cp, ep) pairs other than (1, 1) to enumerate on `rest` = gpus / tp ranks: each dividing them, ep with cp
    a multiple of cp (torchtitan's ep = dp_in_ep x cp)."""
    degrees = [(c, e) for c in dict.fromkeys([1, *cp]) for e in dict.fromkeys([1, *ep])]
    return [(c, e) for c, e in degrees if c * e > 1 and c >= 1 and e >= 1 and rest % c == 0 and rest % e == 0
            and (c == 1 or e == 1 or e % c == 0)]


def _data_parallel(gpus: int, tp: int, pp: int, cp: int, ep: int, global_batch: int, micro_batch: int) -> int:
    """The data-parallel degree of a plan, or 0 where it cannot run: ep must divide dp x cp, the global batch
    split into dp x micro-batch."""
    dp = gpus // (tp * pp * cp)
    if dp < 1 or ep > 1 and (dp * cp) % ep or global_batch % (dp * micro_batch):
        return 0
    return dp


def _plans(gpus: int, layers: int, global_batch: int,
           costs_by: dict[tuple[int, int, int, int, bool | None], LayerCosts], sp_of: dict[int, bool],
           pp: Sequence[int] | None, virtual_stages: Iterable[int], recompute: Iterable[str], fsdp: Iterable[bool],
           schedules: Sequence[str] = (ONE_F_ONE_B,), dp_shard: Sequence[int] | None = (),
           tp_comm_overlap: Sequence[bool] = (False,), pipeline_engine: str = MEGATRON) -> Iterable[StepPlan]:
    fsdp = list(dict.fromkeys(fsdp))
    deepspeed = pipeline_engine == DEEPSPEED
    overlaps = list(dict.fromkeys(tp_comm_overlap))
    for (t, mb, c, e) in sorted({key[:4] for key in costs_by}):
        for p in _pipeline_degrees(gpus // (t * c), layers, pp):
            dp = _data_parallel(gpus, t, p, c, e, global_batch, mb)
            if not dp:
                continue
            m = global_batch // (dp * mb)
            for v in virtual_stages:
                if v > 1 and (p == 1 or layers % (p * v) or m % p or deepspeed):
                    continue
                # the schedule matters with one chunk a stage on two stages or more; more chunks: interleaved
                for schedule in (schedules if p > 1 and v == 1 and not deepspeed else (ONE_F_ONE_B,)):
                    for shard in fsdp:
                        if shard and dp * c == 1 or c * e > 1 and (t, mb, c, e, shard) not in costs_by \
                                or shard and deepspeed and p > 1:
                            continue
                        sp = sp_of.get(t, False) and e == 1
                        for degree in ([None, *_shard_degrees(dp, c, e, dp_shard)] if shard else [None]):
                            for overlap in (overlaps if sp else [False]):
                                for r in recompute:
                                    yield StepPlan(tp=t, pp=p, dp=dp, cp=c, ep=e, virtual_stages=v,
                                                   sequence_parallel=sp, fsdp=shard, micro_batch=mb,
                                                   global_batch=global_batch, recompute=r,
                                                   distributed_optimizer=not shard and dp * c > 1,
                                                   schedule=schedule, dp_shard=degree, tp_comm_overlap=overlap,
                                                   pipeline_engine=pipeline_engine)


def _shard_degrees(dp: int, cp: int, ep: int, wanted: Sequence[int] | None) -> list[int]:
    """HSDP's shard degrees for a plan of data-parallel degree dp: those `wanted` (None: every divisor) that
    divide dp, lie between 1 and dp (1 and dp are DDP-like replication and FSDP) and, with ep, let ep divide
    dp_shard x cp (torchtitan's ep borrows from dp_shard x cp)."""
    candidates = _divisors(dp) if wanted is None else wanted
    return [d for d in dict.fromkeys(candidates) if 1 < d < dp and dp % d == 0 and (d * cp) % ep == 0]


def _pipeline_degrees(rest: int, layers: int, pp: Sequence[int] | None) -> list[int]:
    candidates = pp if pp is not None else _divisors(rest)
    return [p for p in candidates if rest % p == 0 and p <= layers and layers % p == 0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:160]


