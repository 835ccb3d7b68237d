"""A training step predicted per rank: compute and communication streams, pipeline, overlap, optimizer.

From one rank's per-layer costs (`layers.LayerCosts`, one capture) and a plan, `simulate_plan` builds the
step as it runs on each pipeline rank:

- each layer's forward and backward compute (times of its ops), with its tensor-parallel collectives on
  the critical path (Megatron's all-reduces / all-gathers + reduce-scatters are not overlapped);
- recomputation: "full" runs each layer's forward (and its collectives) again before its backward,
  "selective" runs the attention kernels again (Korthikanti et al. 2022); counted in HFU, not MFU;
- FSDP (fsdp=True, dp > 1): each layer's parameters all-gathered before its forward and again before its
  backward (resharded after the forward), prefetched one layer ahead on a communication stream, and its
  gradients reduce-scattered after its backward, micro-batch by micro-batch; FSDP2's copy of each gathered
  layer out of the all-gather buffer into its parameters and its copy of each layer's gradients into the
  reduce-scatter's input (cast to the reduce dtype) run on the compute stream (`_fsdp_copies`) unless the
  capture itself ran FSDP; the parameters outside the blocks (FSDP2's root unit: embedding, head) gathered
  once before the first op and reduce-scattered after the last backward op (`_fsdp_root`);
- HSDP (fsdp with dp_shard < dp): the same per layer within the shard group (dp_shard x cp ranks, tp apart:
  inside a node when they fit), each layer's gradient shard then all-reduced over the dp / dp_shard replicas
  (ranks tp x cp x dp_shard apart) once its reduce-scatter is done, on a stream of its own (FSDP2's
  all_reduce_stream), every micro-batch (FSDP2's default);
- data parallel without FSDP: the gradients reduced once per step over dp x cp ranks (the experts' over the
  dp x cp / ep ranks holding the same experts): an all-reduce per gradient bucket as the software fills them
  (`grad_buckets`: torch DDP's Reducer, 1 MiB then 25 MiB or `bucket_cap_mb`, fxflops.parallel.buckets;
  Megatron-LM's; DeepSpeed's; or one per layer), each once the last micro-batch's backward has made its
  gradients, overlapped with what is left of it (the last one exposed), or a distributed optimizer's
  reduce-scatter per layer (its parameters all-gathered after the step);
- tensor-parallel communication overlap (`tp_comm_overlap`, with sequence parallelism): each all-gather runs
  beside the GEMMs it feeds, each reduce-scatter beside the GEMM it follows (a backward one beside the
  weight-gradient GEMMs before it: Transformer Engine's bulk overlap; `layers._overlapped_gemms`), the pair taking
  the longer of the two (the GEMM times the cluster's tp_overlap_gemm_slowdown, 1 by default: no SM-sharing
  penalty adopted);
- the pipeline: layers cut into pp * v chunks (the first carries the embedding, the last the head and loss),
  simulated micro-batch by micro-batch (`schedule.simulate`), activations sent between stages; or, with
  `pipeline_engine="deepspeed"`, as DeepSpeed's 2021 PipelineEngine runs it (`schedule.simulate_deepspeed`,
  `_deepspeed_boundary`: blocking sends of tp-partitioned tensors, the data-parallel reduction after the
  last backward; in bf16 its BF16_Optimizer's ZeRO-1 step);
- gradient accumulation over a step's micro-batches, as the software does it (`_accumulation`): torch's
  AccumulateGrad adding into .grad from the second micro-batch (plain torch, torch DDP, Megatron-LM's local DDP of
  2021, DeepSpeed's engine in fp16), Megatron-LM's main_grad hooks every micro-batch (with
  gradient_accumulation_fusion only for what no weight-gradient GEMM accumulates), DeepSpeed's BF16_Optimizer every
  micro-batch, FSDP's sharded adds after each reduce-scatter (`_fsdp_accumulation`); the capture's own
  AccumulateGrad copies are not timed (`layers.accumulate_grad_copy`);
- the optimizer step: memory-bound, as the kernels its implementation launches (`optimizer_time`): by default one
  fused kernel, every local parameter's state (optimizer_state_bytes, the bytes the memory per stage counts) read and
  written once, its gradient read and the parameter written (Apex / DeepSpeed FusedAdam, Megatron-LM's optimizer);
  torch.optim's foreach or single-tensor implementations one pass per tensor operation; the distributed
  optimizer's all-gather of the updated parameters after it, or with overlap_param_gather beside the next
  forward, one layer ahead (`_param_gather_exposed`);
- context parallelism (cp): each rank runs S/cp positions (captured so), ring attention's keys and values
  all-gathered per attention call over the cp ranks, overlapped with step 0 of the ring (the rank's queries
  against its own keys, as torch's ring issues the gather and waits for it at step 1), the rest exposed;
  their gradients reduce-scattered after the attention backward, exposed; gradients reduced over dp x cp;
- expert parallelism (ep): each MoE layer's experts split over ep of the dp x cp ranks (torchtitan's
  ParallelDims: ep = dp_shard_in_ep x cp, contiguous ranks after tp), tokens dispatched and
  returned by all-to-alls on the critical path (torchtitan's default: not overlapped), routed as the
  capture assumes (balanced unless `routing=` says otherwise); the experts' parameters FSDP-sharded (or their
  gradients all-reduced) over the dp x cp / ep ranks (torchtitan's dp_shard_mod_ep), the rest over dp x cp.
Every group's collectives are timed over its own size and placement (`dim_ranks_per_node`: how many of its
ranks share a node), so a cp or ep group inside a node runs on NVLink and one across nodes on the network;
cp and ep compose with pp (the pipeline's stages are the captured layers) and with each other.

The result is a prediction, a model with a stated error, not a measurement (see ERROR_STATEMENT).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fxflops.predict.comm_time import collective_seconds, ranks_per_node
from fxflops.predict.hardware import Cluster
from fxflops.predict.layers import LayerCosts, Part
from fxflops.predict.op_time import stream_seconds
from fxflops.predict.optimizer_time import MASTER_FUSED, OptimizerKernels, element_bytes
from fxflops.predict.optimizer_time import resolve as resolve_optimizer
from fxflops.predict.schedule import INTERLEAVED, ONE_F_ONE_B, ChunkCost, Timeline, simulate, simulate_deepspeed
from fxflops.predict.step_memory import OPTIMIZER_STATE_BYTES, RankMemory, busiest, rank_memories
from fxflops.predict.step_memory import fits as fits_in

RECOMPUTE = ("none", "selective", "full")
MEGATRON, DEEPSPEED = "megatron", "deepspeed"
PIPELINE_ENGINES = (MEGATRON, DEEPSPEED)
# DeepSpeed's PartitionedTensor.to_meta(): [ndims, *shape, num_parts, rank, *partition offsets] as int64, sent
# before each partitioned tensor (deepspeed/runtime/utils.py, v0.5.x); partition_uniform gives num_parts + 1
# offsets, so a 3-D activation's meta holds 1 + 3 + 1 + 1 + (tp + 1) = 7 + tp elements
_META_INT64 = 8
GRAD_BUCKETS = ("torch", "megatron", "deepspeed", "layer")
# how the software accumulates a step's micro-batches' gradients without FSDP and outside DeepSpeed's engine
# (`_accumulation`): "autograd" (torch's AccumulateGrad into .grad: plain torch, torch DDP under no_sync,
# Megatron-LM's local DDP without contiguous buffers), "main_grad" (Megatron-LM's DDP with a contiguous gradient
# buffer: a hook adds each .grad into param.main_grad), "fused" (that, with the Linear weights' gradients
# accumulated into main_grad by their weight-gradient GEMM: Megatron-LM's gradient_accumulation_fusion)
GRAD_ACCUMULATION = ("autograd", "main_grad", "fused")
_FP32 = 4  # bytes of an fp32 element (BF16_Optimizer's gradients)
ERROR_STATEMENT = ("a prediction, a model with stated error, not a measurement: against published runs it "
                   "was not fitted to, see docs/guide/predict.md for the per-run errors")


@dataclass(frozen=True)
class StepPlan:
    """The plan a step runs: degrees, batch, recomputation and how data parallelism reduces
    (`grad_buckets`, `bucket_cap_mb`; None: the software's default buckets, as fxflops.Parallel's None)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1  # context parallel: the sequence split over cp ranks (ring attention); gradients reduced over dp x cp
    ep: int = 1  # expert parallel: the experts split over ep of the dp x cp ranks (ep divides dp x cp; cp divides ep)
    virtual_stages: int = 1
    sequence_parallel: bool = False
    fsdp: bool = False  # FSDP (ZeRO-3) over dp; False: replicated parameters, gradients reduced once per step
    micro_batch: int = 1
    global_batch: int = 1
    recompute: str = "none"
    schedule: str = ONE_F_ONE_B  # "gpipe", "1f1b" ("interleaved" when virtual_stages > 1)
    distributed_optimizer: bool = False  # without FSDP: reduce-scatter grads, all-gather params (ZeRO-1)
    overlap_grad_reduce: bool = True  # the gradient reduction overlaps the last micro-batch's backward
    grad_bytes: int | None = None  # bytes per gradient element (default: the parameters')
    # bytes of optimizer state per parameter element the optimizer step reads and writes once each; None: the
    # optimizer_state_bytes simulate_plan is given (predict_step's, 12 by default: Adam's fp32 master, m, v at 4 B
    # each), the same number the memory per stage counts, so time and memory describe one optimizer
    optimizer_bytes_per_param: int | None = None
    # with the distributed optimizer: the updated parameters' all-gather overlapped with the next step's forward,
    # bucket by bucket (Megatron-LM's --overlap-param-gather; `_param_gather_exposed`); False: after the step
    overlap_param_gather: bool = False
    # without FSDP: DDP's gradient buckets of this size in MiB (grad_buckets "torch"); None: the software's default
    bucket_cap_mb: float | None = None
    # the pipeline engine whose p2p and gradient reduction the step follows (see `_deepspeed_boundary`):
    # "megatron" (Megatron-LM's) or "deepspeed" (DeepSpeed's PipelineEngine of 2021, v0.5.x)
    pipeline_engine: str = MEGATRON
    # without FSDP and the distributed optimizer, how the data-parallel all-reduce is bucketed (GRAD_BUCKETS):
    # "torch" (DistributedDataParallel's Reducer: a 1 MiB first bucket, then 25 MiB ones, or bucket_cap_mb),
    # "megatron" (Megatron-LM's DDP: max(40M, 1M x dp) elements a bucket when overlapping, else the whole gradient
    # buffer at once), "deepspeed" (DeepSpeed's engine: 5e8 elements a bucket after the backward) or "layer" (one
    # all-reduce per layer as its backward ends: torch's replicate() per block); the sizes are cluster constants
    grad_buckets: str = "torch"
    # HSDP: FSDP's shard degree within dp (dp / dp_shard replicas, each sharded dp_shard x cp ways: parameters
    # gathered and gradients reduce-scattered in the shard group, the shards' gradients all-reduced over the
    # replicas); None: FSDP over all of dp
    dp_shard: int | None = None
    # tensor-parallel communication overlapped with the GEMM it feeds or follows (Megatron-LM's --tp-comm-overlap,
    # torchtitan's async TP; sequence parallelism only): each such pair takes max(comm, GEMM x the cluster's
    # tp_overlap_gemm_slowdown) instead of their sum
    tp_comm_overlap: bool = False
    # how the gradients of a step's micro-batches accumulate (GRAD_ACCUMULATION, `_accumulation`); DeepSpeed's
    # engine and FSDP accumulate as their code does, whatever this says
    grad_accumulation: str = "autograd"
    # the kernels the optimizer step launches (`optimizer_time.optimizer_kernels`: torch.optim's foreach, single-tensor
    # or fused Adam / AdamW / SGD); None: one fused kernel over the optimizer state (optimizer_time.MASTER_FUSED)
    optimizer_kernels: OptimizerKernels | None = None

    @property
    def grad_group(self) -> int:
        """Ranks that reduce a (non-expert) parameter's gradients: dp x cp (cp's ranks hold other positions of
        the same samples; Megatron's data-parallel-with-context group, torchtitan's dp_shard_cp)."""
        return self.dp * self.cp

    @property
    def expert_group(self) -> int:
        """Ranks holding the same experts, which reduce their gradients: dp x cp / ep (torchtitan's dp_mod_ep,
        Megatron's expert-data-parallel group)."""
        return self.dp * self.cp // self.ep

    @property
    def shard(self) -> int:
        """FSDP's shard degree within dp: dp_shard under HSDP, else dp."""
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def replicas(self) -> int:
        """HSDP's replicas (dp / dp_shard), over which the gradient shards are all-reduced; 1 without HSDP."""
        return self.dp // self.shard

    @property
    def shard_group(self) -> int:
        """Ranks FSDP shards a (non-expert) parameter over: dp_shard x cp (all of dp x cp without HSDP)."""
        return self.shard * self.cp

    @property
    def expert_shard_group(self) -> int:
        """Ranks FSDP shards an expert parameter over: dp_shard x cp / ep (ep borrows from dp_shard x cp)."""
        return self.shard_group // self.ep

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def microbatches(self) -> int:
        """Micro-batches per data-parallel rank per step."""
        return self.global_batch // (self.dp * self.micro_batch)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def check(self, layers: int) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}: pick one of {', '.join(RECOMPUTE)}")
        if self.pipeline_engine not in PIPELINE_ENGINES:
            raise ValueError(f"pipeline_engine={self.pipeline_engine!r}: pick one of {', '.join(PIPELINE_ENGINES)}")
        if self.pipeline_engine == DEEPSPEED and (self.virtual_stages > 1 or self.schedule != ONE_F_ONE_B):
            raise ValueError("pipeline_engine='deepspeed' runs DeepSpeed's TrainSchedule, a non-interleaved 1F1B: give "
                             "virtual_stages=1 and schedule='1f1b'")
        if self.pipeline_engine == DEEPSPEED and self.pp > 1 and self.fsdp:
            # DeepSpeed's PipelineEngine asserts zero_optimization_stage() < 2
            raise ValueError("pipeline_engine='deepspeed' with pp > 1 runs ZeRO stage 0 or 1 only (DeepSpeed refuses "
                             "ZeRO-2 and ZeRO-3 with a pipeline): give fsdp=False (distributed_optimizer=True for "
                             "ZeRO-1)")
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(f"global batch {self.global_batch} is not a multiple of dp x micro-batch = "
                             f"{self.dp} x {self.micro_batch}; pick sizes that divide it")
        if self.pp * self.virtual_stages > layers:
            raise ValueError(f"pp x virtual_stages = {self.pp * self.virtual_stages} chunks for {layers} layers: "
                             "at most one chunk per layer")
        if self.ep > 1 and ((self.dp * self.cp) % self.ep or self.cp > 1 and self.ep % self.cp):
            # torchtitan's ParallelDims: ep = dp_shard_in_ep x cp, so ep divides dp x cp and cp divides ep
            with_cp = f" x cp={self.cp}" if self.cp > 1 else ""
            raise ValueError(f"ep={self.ep} borrows its ranks from dp={self.dp}{with_cp}: pick an ep that divides dp"
                             + (" x cp and is a multiple of cp" if self.cp > 1 else ""))
        if self.bucket_cap_mb is not None:
            if self.fsdp or self.distributed_optimizer or self.grad_buckets != "torch":
                raise ValueError("bucket_cap_mb sizes DDP's gradient all-reduce buckets: give it with fsdp=False, "
                                 "without the distributed optimizer and with grad_buckets='torch'")
            from fxflops.parallel.buckets import check_bucket_cap

            check_bucket_cap(self.bucket_cap_mb)
        if self.grad_accumulation not in GRAD_ACCUMULATION:
            raise ValueError(f"grad_accumulation={self.grad_accumulation!r}: pick one of {', '.join(GRAD_ACCUMULATION)}")
        if self.grad_buckets not in GRAD_BUCKETS:
            raise ValueError(f"grad_buckets={self.grad_buckets!r}: pick one of {', '.join(GRAD_BUCKETS)}")
        if self.grad_buckets != "torch" and (self.fsdp or self.distributed_optimizer):
            # FSDP and the distributed optimizer reduce-scatter per layer: the buckets would be ignored
            raise ValueError(f"grad_buckets={self.grad_buckets!r} buckets the data-parallel all-reduce: give it with "
                             "fsdp=False and without the distributed optimizer (FSDP and the distributed optimizer "
                             "reduce-scatter each layer's gradients)")
        if self.dp_shard is not None:
            if not self.fsdp:
                raise ValueError("dp_shard shards parameters (HSDP); give it with fsdp=True (DDP replicates them)")
            if isinstance(self.dp_shard, bool) or not isinstance(self.dp_shard, int) or self.dp_shard < 1 \
                    or self.dp % self.dp_shard:
                raise ValueError(f"dp_shard={self.dp_shard!r} must divide dp={self.dp} (HSDP: dp / dp_shard replicas "
                                 "of dp_shard shards)")
            if self.ep > 1 and self.shard_group % self.ep:
                raise ValueError(f"ep={self.ep} borrows its ranks from dp_shard x cp = {self.shard_group}: pick an "
                                 "ep that divides it")
        if self.overlap_param_gather and (not self.distributed_optimizer or self.fsdp):
            raise ValueError("overlap_param_gather overlaps the distributed optimizer's parameter all-gather with the "
                             "next forward (Megatron-LM's --overlap-param-gather): give it with "
                             "distributed_optimizer=True and fsdp=False")
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ValueError("tp_comm_overlap overlaps sequence parallelism's all-gathers and reduce-scatters with "
                             "their GEMMs (Megatron-LM's --tp-comm-overlap and torchtitan's async TP need it): give "
                             "sequence_parallel=True with tp > 1")


@dataclass
class RankTime:
    """One pipeline rank's step: its share of the step time, each seconds."""

    role: str  # "first stage", "stage 3", "last stage", "every rank"
    ranks: int  # how many ranks of the job play this role (tp x cp x dp of them per pipeline stage)
    compute: float  # its ops' time (recomputation included)
    exposed_comm: float  # communication it waited for: tp collectives, FSDP gathers not hidden, dp reduction left
    bubble: float  # idle, waiting on other pipeline stages (p2p transfers included)
    optimizer: float
    flops: int  # FLOPs it runs per step, recomputation excluded
    recompute_flops: int
    layers: int  # layers it holds

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble + self.optimizer

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.role, "ranks": self.ranks, "compute": self.compute, "exposed_comm": self.exposed_comm,
                "bubble": self.bubble, "optimizer": self.optimizer, "flops": self.flops,
                "recompute_flops": self.recompute_flops, "layers": self.layers}


@dataclass
class StepPrediction:
    """A predicted training step. `step_time` in seconds; `breakdown` of the rank that sets it."""

    plan: StepPlan
    cluster: str
    device: str
    step_time: float
    breakdown: dict[str, float]  # compute, exposed_comm, bubble, optimizer (sum: step_time)
    mfu: float
    hfu: float
    tokens_per_sec: float
    tflops_per_gpu: float  # model FLOPs per GPU per second, / 1e12
    hardware_tflops_per_gpu: float  # recomputation included
    ranks: list[RankTime]
    timeline: Timeline | None = field(default=None, repr=False)
    comm_events: list[tuple[int, str, float, float]] = field(default_factory=list, repr=False)
    notes: list[str] = field(default_factory=list)
    error: str = ERROR_STATEMENT
    device_origin: str = ""  # where the device's constants came from ("your file PATH" for a calibrated file)
    # predicted peak memory per pipeline rank, as `ranks` (step_memory.rank_memories: what the plan search filters
    # by); empty when the costs were captured without memory
    memory: list[RankMemory] = field(default_factory=list)
    capacity: int = 0  # the device's memory, bytes
    optimizer_state_bytes: int = OPTIMIZER_STATE_BYTES  # the optimizer's state per parameter element assumed

    @property
    def peak_memory(self) -> RankMemory | None:
        """The rank holding the most bytes (tensors and allowance), or None without memory."""
        return busiest(self.memory) if self.memory else None

    @property
    def fits(self) -> bool | None:
        """Whether the busiest rank's predicted memory, allowance included, is within the device's; None without
        memory."""
        top = self.peak_memory
        return None if top is None else fits_in(top.total, self.capacity)

    def memory_dict(self) -> dict[str, Any] | None:
        """The predicted memory as raw integers (bytes): per rank role, the peak, the capacity and whether it fits."""
        top = self.peak_memory
        if top is None:
            return None
        return {"peak_bytes": top.total, "peak_role": top.role, "capacity_bytes": self.capacity, "fits": self.fits,
                "optimizer_state_bytes": self.optimizer_state_bytes, "ranks": [m.as_dict() for m in self.memory]}

    def as_dict(self) -> dict[str, Any]:
        plan = {**self.plan.as_dict(), "optimizer_kernels": (self.plan.optimizer_kernels or MASTER_FUSED).label}
        return {"plan": plan, "cluster": self.cluster, "device": self.device,
                "device_origin": self.device_origin,
                "step_time": self.step_time, "breakdown": dict(self.breakdown), "mfu": self.mfu, "hfu": self.hfu,
                "tokens_per_sec": self.tokens_per_sec, "tflops_per_gpu": self.tflops_per_gpu,
                "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
                "ranks": [r.as_dict() for r in self.ranks], "memory": self.memory_dict(), "notes": list(self.notes),
                "error": self.error}

    def __str__(self) -> str:
        p = self.plan
        device = self.device + (f" from {self.device_origin}" if self.device_origin.startswith("your file") else "")
        lines = [f"predicted step on {p.gpus} x {device} ({self.cluster}): tp={p.tp} pp={p.pp} "
                 f"v={p.virtual_stages} dp={p.dp}{_data_parallel_words(p)}"
                 f"{f' cp={p.cp}' if p.cp > 1 else ''}{f' ep={p.ep}' if p.ep > 1 else ''} sp={p.sequence_parallel} "
                 f"micro-batch {p.micro_batch} x {p.microbatches} per step, recompute={p.recompute}"
                 + (", TP comm overlapped" if p.tp_comm_overlap else ""),
                 f"  step time {self.step_time * 1e3:,.1f} ms   MFU {self.mfu:.1%}   HFU {self.hfu:.1%}   "
                 f"{self.tokens_per_sec:,.0f} tokens/s   {self.tflops_per_gpu:.1f} TFLOP/s per GPU",
                 "  " + "   ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in self.breakdown.items())]
        if len(self.ranks) > 1:
            for rank in self.ranks:
                lines.append(f"  {rank.role:<12} x{rank.ranks:<6} compute {rank.compute * 1e3:,.1f} ms  exposed comm "
                             f"{rank.exposed_comm * 1e3:,.1f} ms  bubble {rank.bubble * 1e3:,.1f} ms  "
                             f"({rank.layers} layers)")
        lines += self._memory_lines()
        lines += [f"  note: {note}" for note in self.notes]
        lines.append(f"  ({self.error})")
        return "\n".join(lines)

    def _memory_lines(self) -> list[str]:
        """The predicted peak memory: the busiest rank against the device's, then each rank role by kind."""
        top = self.peak_memory
        if top is None:
            return []
        gib = 1 << 30
        verdict = "fits" if self.fits else f"does NOT fit, short by {(top.total - self.capacity) / gib:,.2f} GiB"
        where = f" ({top.role})" if len(self.memory) > 1 else ""
        lines = [f"  peak memory {top.total / gib:,.2f} GiB per GPU{where} of {self.capacity / gib:,.0f} GiB: "
                 f"{verdict}"]
        for mem in self.memory:
            kinds = ", ".join(f"{kind} {size / gib:,.2f}" for kind, size in mem.by_kind.items())
            fsdp = f"; FSDP's gathered parameters {mem.gathered / gib:,.2f} and unsharded gradients " \
                f"{mem.unsharded_gradients / gib:,.2f} among them" if mem.gathered else ""
            chunks = f"{mem.in_flight} micro-batch chunk{'s' if mem.in_flight != 1 else ''}"
            moment = f", at the {mem.moment}" if mem.moment else ""
            lines.append(f"  {mem.role:<12} memory {mem.total / gib:,.2f} GiB: {kinds}, allowance "
                         f"{mem.allowance / gib:,.2f} GiB ({chunks} of activations in flight{moment}{fsdp})")
        return lines

    def to_chrome_trace(self, path: str | Path | None = None) -> dict[str, Any]:
        """The pipeline ranks' timelines (compute and p2p per rank, the data-parallel reduction, the critical
        path) as a Chrome trace (chrome://tracing, Perfetto); written to `path` when given."""
        from fxflops.predict.trace import chrome_trace

        trace = chrome_trace(self)
        if path is not None:
            Path(path).write_text(json.dumps(trace))
        return trace

    def to_html(self, path: str | Path | None = None) -> str:
        """The step as an HTML page: one lane per pipeline rank, the critical path outlined."""
        from fxflops.predict.trace import html_timeline

        page = html_timeline(self)
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page


def dim_ranks_per_node(plan: StepPlan, cluster: Cluster) -> dict[str, int]:
    """How many ranks of one group of each mesh dimension share a node, ranks numbered tp fastest, then cp,
    then dp, then pp (torchtitan's ParallelDims order, Megatron's: tp inside a node first); ep's ranks are the
    cp ranks and the dp ranks nearest them (torchtitan's ep = dp_shard_in_ep x cp: tp apart, contiguous), the
    ranks holding the same experts the dp_mod_ep ranks outside them (tp x ep apart); "fsdp" is the gradients'
    group (dp x cp ranks, tp apart: FSDP's, or DDP's all-reduce; HSDP's shard group, dp_shard x cp ranks),
    "fsdp_experts" the experts' (dp x cp / ep, or dp_shard x cp / ep), "replicate" HSDP's replica group (dp / dp_shard
    ranks, torchtitan's dp_replicate: outside dp_shard, tp x cp x dp_shard apart, so on other nodes once the shard
    group fills one)."""
    tp, cp, dp = plan.tp, plan.cp, plan.dp
    return {"tp": ranks_per_node(tp, 1, cluster), "cp": ranks_per_node(cp, tp, cluster),
            "dp": ranks_per_node(dp, tp * cp, cluster), "ep": ranks_per_node(plan.ep, tp, cluster),
            "fsdp": ranks_per_node(plan.shard_group if plan.fsdp else plan.grad_group, tp, cluster),
            "fsdp_experts": ranks_per_node(plan.expert_shard_group if plan.fsdp else plan.expert_group,
                                           tp * plan.ep, cluster),
            "replicate": ranks_per_node(plan.replicas, tp * cp * plan.shard, cluster),
            "pp": ranks_per_node(plan.pp, tp * cp * dp, cluster)}


def simulate_plan(costs: LayerCosts, plan: StepPlan, cluster: Cluster, dtype_key: str = "bf16",
                  optimizer_state_bytes: int = OPTIMIZER_STATE_BYTES) -> StepPrediction:
    """The step of `plan` from one tp rank's per-layer costs (captured at plan.tp and plan.micro_batch), with each
    pipeline rank's predicted peak memory when the costs hold the capture's memory (`step_memory.rank_memories`,
    `optimizer_state_bytes` of optimizer state per parameter element)."""
    if costs.tp != plan.tp or costs.micro_batch != plan.micro_batch:
        raise ValueError(f"per-layer costs were captured at tp={costs.tp}, micro-batch {costs.micro_batch}; "
                         f"the plan has tp={plan.tp}, micro-batch {plan.micro_batch}")
    layers = costs.layers
    plan.check(layers)
    p, v, m = plan.pp, plan.virtual_stages, plan.microbatches
    if m < 1:
        raise ValueError(f"global batch {plan.global_batch} gives no micro-batch per data-parallel rank")
    placed = dim_ranks_per_node(plan, cluster)
    block, pre, post = costs.block, costs.pre, costs.post
    deepspeed = plan.pipeline_engine == DEEPSPEED
    # fp32 gradients, all-reduced in fp32, the optimizer sharded over dp, the bf16 parameters all-gathered after the step
    bf16_optimizer = _bf16_optimizer(plan, dtype_key)
    if bf16_optimizer and plan.grad_bytes is None:
        plan = dataclasses.replace(plan, grad_bytes=_FP32)
    grad_bytes = plan.grad_bytes or costs.param_bytes
    notes = list(costs.notes)

    layer_fwd_compute, layer_bwd_compute, layer_fwd_comm, layer_bwd_comm, recompute_flops = \
        _layer_passes(costs, plan.recompute, plan.tp_comm_overlap)
    pre_comm, post_comm = _part_comm(pre, plan.tp_comm_overlap), _part_comm(post, plan.tp_comm_overlap)

    # FSDP: per layer, parameters gathered before forward and backward, gradients reduce-scattered after backward;
    # over dp x cp ranks, the experts' over the dp / ep ranks holding the same experts
    fsdp = plan.fsdp and plan.dp * plan.cp > 1
    gather = scatter = replica = 0.0
    if fsdp:
        gather, scatter = _fsdp_layer_seconds(block.params - block.expert_params, plan.shard_group,
                                              placed["fsdp"], costs.param_bytes, grad_bytes, cluster)
        expert_gather, expert_scatter = _fsdp_layer_seconds(block.expert_params, plan.expert_shard_group,
                                                            placed["fsdp_experts"], costs.param_bytes, grad_bytes,
                                                            cluster)
        gather, scatter = gather + expert_gather, scatter + expert_scatter
        # HSDP: each layer's gradient shards all-reduced over the replicas once its reduce-scatter is done, on
        # FSDP2's all_reduce_stream, every micro-batch (FSDP2's default; set_requires_all_reduce(False) is not
        # modelled)
        replica = _replica_all_reduce(block.params - block.expert_params, plan.shard_group, plan, placed,
                                      grad_bytes, cluster) \
            + _replica_all_reduce(block.expert_params, plan.expert_shard_group, plan, placed, grad_bytes, cluster)
        if not costs.fsdp_in_capture:
            # FSDP2's own copies on the compute stream (see `_fsdp_copies`): each gathered layer copied out of the
            # all-gather's buffer before its forward and again before its backward, and its gradients copied into
            # the reduce-scatter's input (cast to the reduce dtype) after its backward
            copy_out, copy_in = _fsdp_copies(block, costs.param_bytes, grad_bytes, cluster)
            layer_fwd_compute += copy_out
            layer_bwd_compute += copy_out + copy_in

    chunks = _split(layers, p * v)
    chunk_costs, chunk_compute = [], []
    accumulated = []  # per chunk: seconds of gradient accumulation its backwards add over the step
    if p > 1 and deepspeed:
        p2p, rebuild, partition, received = _deepspeed_boundary(costs.boundary_bytes, plan.tp, cluster, placed)
    elif p > 1:
        p2p, rebuild, partition, received = (collective_seconds("send", costs.boundary_bytes, 2, cluster, placed["pp"]),
                                             0.0, 0.0, 0.0)
    else:
        p2p = rebuild = partition = received = 0.0
    for c, n in enumerate(chunks):
        first, last = c == 0, c == len(chunks) - 1
        fwd = [layer_fwd_compute + layer_fwd_comm] * n
        bwd = [layer_bwd_compute + layer_bwd_comm] * n
        root_copies = 0.0
        if fsdp:
            # the chunk's root unit (fully_shard of the model: what is outside the blocks, the embedding with the
            # first chunk, the head with the last) gathered before its first op and, FSDP2 keeping the root
            # unsharded from forward to backward, reduce-scattered after its last backward op (`_fsdp_root`)
            root_gather, root_scatter, root_replica, root_out, root_in = _fsdp_root(
                costs, first, last, plan, placed, grad_bytes, cluster)
            root_copies = root_out + root_in
            head_fwd = (pre.forward + pre_comm[0] if first else 0.0) + root_out
            tail_fwd = [post.forward + post_comm[0]] if last else []
            fwd_time = _prefetched([head_fwd, *fwd, *tail_fwd], [root_gather, *[gather] * n, *[0.0] * len(tail_fwd)],
                                   [0.0] * (n + 1 + len(tail_fwd)))
            head_bwd = [post.backward + post_comm[1]] if last else []
            tail_bwd = (pre.backward + pre_comm[1] if first else 0.0) + root_in
            k = len(head_bwd)
            bwd_time = _prefetched([*head_bwd, *bwd, tail_bwd], [*[0.0] * k, *[gather] * n, 0.0],
                                   [*[0.0] * k, *[scatter] * n, root_scatter],
                                   [*[0.0] * k, *[replica] * n, root_replica])
        else:
            fwd_time, bwd_time = sum(fwd), sum(bwd)
            if first:
                fwd_time += pre.forward + pre_comm[0]
                bwd_time += pre.backward + pre_comm[1]
            if last:
                fwd_time += post.forward + post_comm[0]
                bwd_time += post.backward + post_comm[1]
        if rebuild or partition or received:  # DeepSpeed: the received input cloned and rebuilt, the output
            # partitioned for its send
            fwd_time += (received + rebuild if not first else 0.0) + (partition if not last else 0.0)
            # the backward rebuilds its partitioned output and the received gradient, partitions its input's
            bwd_time += (2 * rebuild if not last else 0.0) + (partition if not first else 0.0)
        # each backward accumulates the chunk's gradients into what the step's earlier micro-batches left, as the
        # software does it (`_accumulation`): every micro-batch's, or every one's but the first
        parts = [block] * n + ([pre] if first else []) + ([post] if last else [])
        params, gemm_params = sum(q.params for q in parts), sum(q.gemm_weight_params for q in parts)
        if fsdp:
            # FSDP: each layer's sharded gradients added into the .grad the earlier micro-batches left, after its
            # reduce-scatter (or HSDP's all-reduce) on that stream, from the second micro-batch (`_fsdp_accumulation`):
            # the backward with them, less the backward without
            later = _fsdp_accumulation([block], plan, costs.param_bytes, cluster)
            root_later = _fsdp_accumulation([q for q, held in ((pre, first), (post, last)) if held], plan,
                                            costs.param_bytes, cluster)
            accumulate = _prefetched([*head_bwd, *bwd, tail_bwd], [*[0.0] * k, *[gather] * n, 0.0],
                                     [*[0.0] * k, *[scatter] * n, root_scatter],
                                     [*[0.0] * k, *[replica + later] * n, root_replica + root_later]) - bwd_time
            every = False
        else:
            accumulate, every = _accumulation(plan, params, gemm_params, costs.param_bytes, grad_bytes, dtype_key,
                                              bf16_optimizer, cluster)
        bwd_time += accumulate if every else 0.0
        # compute-stream work; FSDP's adds run on the reduce-scatter's stream (what they delay is waiting, not compute)
        accumulated.append(0.0 if fsdp else accumulate * (m if every else m - 1))
        # each chunk's p2p: its output activations (forward) and its input gradients (backward) crossing to the
        # neighbouring rank; the schedule sends neither past the pipeline's ends
        chunk_costs.append(ChunkCost(fwd_time, bwd_time, p2p, 0.0 if every else accumulate))
        compute = n * (layer_fwd_compute + layer_bwd_compute) + (pre.forward + pre.backward if first else 0.0) \
            + (post.forward + post.backward if last else 0.0) + root_copies
        chunk_compute.append(compute)
    schedule = INTERLEAVED if v > 1 else plan.schedule
    timeline = simulate_deepspeed(chunk_costs, m) if deepspeed else simulate(chunk_costs, m, schedule, stages=p)

    comm_events: list[tuple[int, str, float, float]] = []
    compute_ends = [max((e.end for e in timeline.rank_events(rank) if e.stream == "compute"), default=0.0)
                    for rank in range(p)]
    ends = list(compute_ends)  # when each rank is done with the step's compute and communication
    after_step = [0.0] * p
    if deepspeed and plan.overlap_grad_reduce:  # DeepSpeed's ReduceGrads instruction runs after the last backward
        plan = dataclasses.replace(plan, overlap_grad_reduce=False)
    if plan.grad_group > 1 and not fsdp:
        for rank in range(p):
            ends[rank], events = _gradient_reduction(timeline, rank, chunks, costs, plan, cluster, placed,
                                                     ends[rank])
            comm_events += events
            if plan.distributed_optimizer or bf16_optimizer:  # the updated parameter shards gathered back after the step
                after_step[rank] = _param_gather_exposed(rank, chunks, costs, plan, cluster, placed,
                                                         layer_fwd_compute + layer_fwd_comm, pre_comm[0], post_comm[0])
    # the optimizer step, memory-bound, as its implementation's kernels (`optimizer_time`): by default one fused
    # kernel, each local parameter's optimizer state read and written, its gradient read, the parameter written;
    # torch.optim's foreach / loop one pass per tensor operation (sharded dp ways under FSDP or a distributed optimizer)
    state = optimizer_state_bytes if plan.optimizer_bytes_per_param is None else plan.optimizer_bytes_per_param
    kernels = plan.optimizer_kernels or MASTER_FUSED
    if kernels.optimizer is None:  # the fused mixed-precision step: `state` bytes of state, the model's parameters
        stepped, element, read = costs.param_bytes, state, grad_bytes
    else:  # torch.optim keeps its state like the parameters it steps, and their gradients are of their dtype
        # (AccumulateGrad's; FSDP2 casts the reduced gradient to its sharded parameter's), whatever the reduction's
        stepped = element = read = element_bytes(kernels, state, costs.param_bytes)
    notes.append(kernels.describe(stepped, read, element))
    shard = plan.shard_group if fsdp else plan.grad_group if plan.distributed_optimizer or bf16_optimizer else 1
    expert_shard = plan.expert_shard_group if fsdp else plan.expert_group
    roles = []
    step_end = 0.0
    device = cluster.device
    for rank in range(p):
        rank_chunks = list(range(rank, len(chunks), p))
        rank_layers = sum(chunks[c] for c in rank_chunks)
        rank_params = _rank_params(rank, chunks, p, costs)
        # the experts' parameters are split ep ways already (held by dp / ep FSDP ranks), the rest dp x cp ways
        local = (rank_params - _rank_expert_params(rank, chunks, p, costs)) / shard \
            + _rank_expert_params(rank, chunks, p, costs) / (expert_shard if shard > 1 else 1)
        # the rank's parameter tensors (each sharded, not fewer, under FSDP): its chunks' layers', the embedding's
        # with the first chunk, the head's with the last
        tensors = _rank_params(rank, chunks, p, costs, tensors=True)
        optimizer = kernels.seconds(local, tensors, stepped, read, element, device) if rank_params else 0.0
        optimizer += after_step[rank]
        if bf16_optimizer and rank_params:
            # BF16_Optimizer.step: the global norm reads every fp32 gradient of the rank (get_grads_for_norm: all of
            # them, not the rank's 1/dp), clear_hp_grads zeroes them after the step
            optimizer += stream_seconds(2 * _FP32 * rank_params, device, kernels=2)
        step_end = max(step_end, ends[rank] + optimizer)
        flops = m * (rank_layers * (block.forward_flops + block.backward_flops)
                     + (pre.forward_flops + pre.backward_flops if 0 in rank_chunks else 0)
                     + (post.forward_flops + post.backward_flops if len(chunks) - 1 in rank_chunks else 0))
        compute = m * sum(chunk_compute[c] for c in rank_chunks) + sum(accumulated[c] for c in rank_chunks)
        roles.append((rank, rank_layers, compute, optimizer, flops, m * rank_layers * recompute_flops))
    ranks = []
    for rank, rank_layers, compute, optimizer, flops, re_flops in roles:
        busy = sum(e.end - e.start for e in timeline.rank_events(rank) if e.stream == "compute")
        exposed = busy - compute + (ends[rank] - compute_ends[rank])  # waits inside the passes, and after them
        bubble = step_end - optimizer - compute - exposed
        bubble = 0.0 if abs(bubble) <= 1e-12 * step_end else bubble  # rounding, not waiting
        role = "every rank" if p == 1 else "first stage" if rank == 0 else "last stage" if rank == p - 1 \
            else f"stage {rank}"
        ranks.append(RankTime(role, plan.tp * plan.cp * plan.dp, compute, exposed, bubble, optimizer, flops, re_flops,
                              rank_layers))
    critical = max(ranks, key=lambda r: (r.compute + r.exposed_comm, -ranks.index(r)))
    breakdown = {"compute": critical.compute, "exposed_comm": critical.exposed_comm, "bubble": critical.bubble,
                 "optimizer": critical.optimizer}
    gpus = plan.gpus
    job_flops = sum(r.flops for r in ranks) * plan.tp * plan.cp * plan.dp
    job_hw_flops = job_flops + sum(r.recompute_flops for r in ranks) * plan.tp * plan.cp * plan.dp
    peak = device.peak(dtype_key)
    tflops = job_flops / gpus / step_end / 1e12
    hw_tflops = job_hw_flops / gpus / step_end / 1e12
    if len(set(chunks)) > 1:
        notes.append(f"{layers} layers do not split evenly into {p * v} chunks: {chunks}")
    notes += _assumption_notes(plan, cluster, fsdp, grad_bytes)
    memory = rank_memories(costs, plan, [r.layers for r in ranks], timeline, optimizer_state_bytes,
                           [r.role for r in ranks], bf16_optimizer=bf16_optimizer) if costs.memory_captured else []
    return StepPrediction(plan, cluster.name, device.name, step_end, breakdown, tflops * 1e12 / peak,
                          hw_tflops * 1e12 / peak, plan.global_batch * costs.tokens / plan.micro_batch / step_end,
                          tflops, hw_tflops, ranks, timeline, comm_events, notes, device_origin=device.origin,
                          memory=memory, capacity=device.memory_bytes, optimizer_state_bytes=optimizer_state_bytes)


def _bf16_optimizer(plan: StepPlan, dtype_key: str | None) -> bool:
    """Whether the plan's step runs DeepSpeed's BF16_Optimizer: DeepSpeed's engine in bf16 with neither ZeRO-1 (the
    distributed optimizer; bf16 + ZeRO-1 raised NotImplementedError in its pipeline engine then) nor ZeRO-3 (FSDP)
    (see `_accumulation`)."""
    fsdp = plan.fsdp and plan.dp * plan.cp > 1  # as simulate_plan takes it: FSDP over one rank is none
    return plan.pipeline_engine == DEEPSPEED and dtype_key == "bf16" and not fsdp and not plan.distributed_optimizer


def _accumulation(plan: StepPlan, params: int, gemm_params: int, param_bytes: int, grad_bytes: int, dtype_key: str,
                  bf16_optimizer: bool, cluster: Cluster) -> tuple[float, bool]:
    """Seconds a chunk's backward spends accumulating its `params` gradients (`gemm_params` of them Linear
    weights) into what the step's earlier micro-batches left, and whether every micro-batch's backward does
    (True) or every one's but the first (False). Not under FSDP (`_fsdp_accumulation`). The capture's own
    AccumulateGrad copies are not timed (`layers.accumulate_grad_copy`): this is the only accumulation term.

    - DeepSpeed's engine (`pipeline_engine="deepspeed"`), in bf16 (BF16_Optimizer, deepspeed/runtime/bf16_optimizer.py
      as BigScience ran it, merged as "bf16+pipeline parallelism", DeepSpeed #1801, 56c5223): after every backward
      (`_exec_backward_pass`; on the last stage through `optimizer.backward`) `update_hp_grads` runs
      `hp_grad.add_(lp.grad.to(fp32))` for each parameter: the bf16 gradient read and cast into a new fp32 tensor,
      then the fp32 accumulator and that tensor read and the sum written: param_bytes + 4 x 4 bytes an element, two
      kernels; every micro-batch, the accumulator being a zeroed fp32 buffer (clear_hp_grads after each step);
      in fp16 (FP16_Optimizer / ZeRO-1, DeepSpeed v0.5.x) as "autograd" below;
    - "autograd": the gradients accumulate in the parameters' .grad, torch's AccumulateGrad
      (torch/csrc/autograd/functions/accumulate_grad.h) keeping the first micro-batch's gradient as it is (zero_grad
      sets .grad to None after the step) and adding each later one in place (`variable_grad += new_grad`: read
      both, write one, 3 x param_bytes), from the second micro-batch on; torch DDP's no_sync (the micro-batches
      before the last: Megatron-LM's forward_backward_no_pipelining) leaves that as it is, its Reducer only
      skipping the all-reduce; Megatron-LM's local DDP without contiguous buffers (megatron/model/distributed.py
      at de7dc40: `_grad_buffers` None, no hooks) too;
    - "main_grad": Megatron-LM's DDP with a contiguous gradient buffer (distributed.py at de7dc40,
      use_contiguous_buffers_in_ddp, forced by accumulate_allreduce_grads_in_fp32 under bf16): a hook on each
      parameter's AccumulateGrad runs `param.main_grad.add_(param.grad.data); param.grad = None` every micro-batch,
      the buffer zeroed at the step's start (zero_grad_buffer): param_bytes read, the buffer's element read and
      written (fp32, 4 bytes, under bf16, which forces accumulate_allreduce_grads_in_fp32 (arguments.py at de7dc40),
      or with grad_bytes 4; else the parameters' dtype);
    - "fused": that, with Megatron-LM's gradient_accumulation_fusion (commit 83b1e42, on unless
      --no-gradient-accumulation-fusion, and only with an fp32 buffer: arguments.py turns it off otherwise;
      Megatron-Core's, through Transformer Engine's fuse_wgrad_accumulation):
      each Linear weight's weight-gradient GEMM accumulates into main_grad itself (wgrad_gemm_accum_fp32: the
      buffer read and written in the GEMM's epilogue, timed within the GEMM as its bf16 output was; no .grad, no
      hook), the other parameters (norms, biases, embeddings) through the hook as "main_grad".
    Memory-bound, on the compute stream, at the sustained bandwidth; one kernel (pair) counted per chunk, not per
    parameter tensor."""
    if plan.pipeline_engine == DEEPSPEED and bf16_optimizer:
        if not params:
            return 0.0, True
        return stream_seconds(params * (param_bytes + 4 * _FP32), cluster.device, kernels=2), True
    if plan.pipeline_engine == DEEPSPEED or plan.grad_accumulation == "autograd":
        return (stream_seconds(params * 3 * param_bytes, cluster.device) if params else 0.0), False
    buffer = _FP32 if dtype_key == "bf16" or grad_bytes == _FP32 else param_bytes
    hooked = params - (gemm_params if plan.grad_accumulation == "fused" and buffer == _FP32 else 0)
    return (stream_seconds(hooked * (param_bytes + 2 * buffer), cluster.device) if hooked else 0.0), True


def _fsdp_accumulation(parts: list[Part], plan: StepPlan, param_bytes: int, cluster: Cluster) -> float:
    """Seconds FSDP spends adding one FSDP unit's reduce-scattered gradient shards into those of the step's earlier
    micro-batches (every micro-batch's but the first): FSDP2's foreach_reduce (torch/distributed/fsdp/
    _fully_shard/_fsdp_collectives.py) views each parameter's shard out of the reduce-scatter's output, cast to
    the parameter's dtype, and runs `sharded_param.grad._local_tensor += new_sharded_grad` once a .grad exists
    (the first micro-batch's kept as it is), on the reduce-scatter's stream after it (HSDP: the all-reduce's):
    3 x param_bytes an element of the rank's shard (1/shard_group of the dense parameters, 1/expert_shard_group
    of the experts'), one kernel per unit. FSDP1 (FullyShardedDataParallel's _accumulate_sharded_grad) adds the
    same; no_sync / set_requires_gradient_sync(False) (gradients kept unsharded, reduced once) not modelled."""
    dense = sum(q.params - q.expert_params for q in parts)
    experts = sum(q.expert_params for q in parts)
    elements = dense / plan.shard_group + experts / plan.expert_shard_group
    return stream_seconds(elements * 3 * param_bytes, cluster.device) if elements else 0.0


def _deepspeed_boundary(boundary_bytes: int, tp: int, cluster: Cluster, placed: dict[str, int]
                        ) -> tuple[float, float, float, float]:
    """What one stage boundary costs a micro-batch under DeepSpeed's PipelineEngine (v0.5.x,
    deepspeed/runtime/pipe/engine.py, p2p.py, utils.py), as (p2p, rebuild, partition, received) seconds:

    - p2p: each direction's transfer, a blocking `dist.send` per tensor (p2p.py asserts async_op=False):
      with tensor parallelism (`is_pipe_partitioned = is_grad_partitioned = is_model_parallel`) the
      activation or gradient goes as a PartitionedTensor, its int64 meta tensor and then the rank's 1/tp
      part (two sends); without it the whole tensor;
    - rebuild: `PartitionedTensor.full()` on the receiving side, a zero-filled buffer, the tp ranks' parts
      all-gathered into it and the result cloned (memory-bound passes at the sustained bandwidth);
    - partition: `_partition_tensor`, the rank's part cloned out of the tensor before its send;
    - received: `_exec_forward_pass` cloning its received buffers before it rebuilds them (`t.clone()` of each:
      the meta tensor and the part, or without tp the whole activation), read and written.
    """
    send = collective_seconds("send", boundary_bytes, 2, cluster, placed["pp"])
    if tp <= 1:
        return send, 0.0, 0.0, stream_seconds(2 * boundary_bytes, cluster.device)
    part = -(-boundary_bytes // tp)
    meta_bytes = _META_INT64 * (7 + tp)
    meta = collective_seconds("send", meta_bytes, 2, cluster, placed["pp"])
    p2p = meta + collective_seconds("send", part, 2, cluster, placed["pp"])
    rebuild = collective_seconds("all_gather", boundary_bytes, tp, cluster, placed["tp"]) \
        + stream_seconds(3 * boundary_bytes + 2 * part, cluster.device, kernels=3)
    return p2p, rebuild, stream_seconds(2 * part, cluster.device), \
        stream_seconds(2 * (meta_bytes + part), cluster.device, kernels=2)


def _part_comm(part: Any, overlap: bool) -> tuple[float, float]:
    """A part's exposed communication per micro-batch, (forward, backward): less what overlapping its
    tensor-parallel collectives with their GEMMs saves when `overlap` (tp_comm_overlap)."""
    if not overlap:
        return part.comm_forward, part.comm_backward
    return part.comm_forward - part.tp_overlap_forward, part.comm_backward - part.tp_overlap_backward


def _data_parallel_words(plan: StepPlan) -> str:
    """How the plan's data parallelism holds the parameters, for the prediction's first line."""
    if plan.fsdp and plan.dp_shard is not None:
        return f" (HSDP: {plan.replicas} replicas x {plan.shard} shards)"
    return " (FSDP)" if plan.fsdp else ""


def _assumption_notes(plan: StepPlan, cluster: Cluster, fsdp: bool, grad_bytes: int) -> list[str]:
    """What the prediction assumed about the plan's data-parallel buckets and overlaps, and which cluster
    constants came from a user's file (by name: `explain` prints them with their sources)."""
    notes = []
    if plan.grad_group > 1 and not fsdp and not plan.distributed_optimizer:
        if plan.grad_buckets == "layer":
            notes.append("gradients all-reduced one layer at a time (grad_buckets='layer')")
        else:
            limits = ddp_bucket_limits(plan, cluster, grad_bytes)
            sizes = ("one bucket: the whole gradient buffer" if limits == [_WHOLE_BUFFER]
                     else " then ".join(f"{size / (1 << 20):,.4g} MiB" for size in limits))
            notes.append(f"gradients all-reduced in {plan.grad_buckets}'s buckets ({sizes}"
                         + (", the first pipeline stage's first chunk's; one bucket a chunk on the others" if plan.grad_buckets == "megatron"
                            and plan.pp > 1 and plan.overlap_grad_reduce else "") + ")")
    if fsdp and plan.replicas > 1:
        notes.append(f"HSDP: parameters gathered and gradients reduce-scattered over {plan.shard_group} ranks, the "
                     f"gradient shards all-reduced over {plan.replicas} replicas each micro-batch (FSDP2's default)")
    if plan.tp_comm_overlap:
        notes.append("tensor-parallel all-gathers / reduce-scatters overlapped with the GEMMs they feed / follow, "
                     f"the GEMMs x {cluster.tp_overlap_gemm_slowdown:g} while they overlap (tp_overlap_gemm_slowdown)")
    mine = user_constants_note(cluster)
    return notes + ([mine] if mine else [])


def user_constants_note(cluster: Cluster) -> str | None:
    """"cluster constants from your file PATH: NAMES" where a user's cluster file set some, else None."""
    mine = [c for c in cluster.constants.values() if c.origin.startswith("your file")]
    if not mine:
        return None
    return f"cluster constants from {mine[0].origin}: {', '.join(c.name for c in mine)}"


def _layer_passes(costs: LayerCosts, recompute: str, overlap: bool = False) -> tuple[float, float, float, float, int]:
    """One layer, one micro-batch, as the compute stream sees it: forward compute, backward compute (with
    what is recomputed), forward and backward tensor-parallel communication (less what `overlap`, tp_comm_overlap,
    hides behind GEMMs), and the recomputed FLOPs."""
    block = costs.block
    comm_forward, comm_backward = _part_comm(block, overlap)
    if recompute == "full":  # the forward and its collectives again, before the backward
        return (block.forward, block.backward + block.forward, comm_forward,
                comm_backward + comm_forward, block.forward_flops)
    if recompute == "selective":  # the attention kernels again
        return (block.forward, block.backward + block.attention_forward, comm_forward, comm_backward,
                block.attention_flops)
    return block.forward, block.backward, comm_forward, comm_backward, 0


def _fsdp_layer_seconds(params: int, group: int, per_node: int, param_bytes: int, grad_bytes: int,
                        cluster: Cluster) -> tuple[float, float]:
    """FSDP's all-gather of one layer's parameters and reduce-scatter of its gradients over `group` ranks."""
    if not params or group <= 1:
        return 0.0, 0.0
    return (collective_seconds("all_gather", params * param_bytes, group, cluster, per_node),
            collective_seconds("reduce_scatter", params * grad_bytes, group, cluster, per_node))


def _fsdp_copies(part: Any, param_bytes: int, grad_bytes: int, cluster: Cluster) -> tuple[float, float]:
    """FSDP2's copies of one unit (a block, or the root's parts) on the compute stream, as (copy-out, copy-in)
    seconds, each a memory-bound kernel per FSDP group (the experts' group is a second one):

    - copy-out, per gather: `foreach_all_gather_copy_out` (torch.ops.fsdp.split_with_sizes_copy) copies the
      gathered parameters out of the all-gather's buffer into the unsharded parameters, the buffer read and the
      parameters written, `param_bytes` each (the all-gather's dtype: MixedPrecisionPolicy's param_dtype);
    - copy-in, per reduce-scatter: `foreach_reduce` copies the unsharded gradients (`param_bytes` each: autograd
      makes them in the unsharded parameters' dtype) into the reduce-scatter's input with
      `foreach_reduce_scatter_copy_in` (torch.ops.fsdp.chunk_cat), which casts them to the reduce dtype
      (`grad_bytes`: MixedPrecisionPolicy's reduce_dtype, 4 for an fp32 reduction), on the current (compute)
      stream before the reduce-scatter stream waits for it (torch/distributed/fsdp/_fully_shard/
      _fsdp_collectives.py as installed). The padding of each parameter's dim 0 to a multiple of the shard group
      (`_get_dim0_padded_size`: fewer than shard-group rows a parameter) is not counted."""
    if not part.params:
        return 0.0, 0.0
    kernels = 2 if part.expert_params and part.params > part.expert_params else 1
    return (stream_seconds(2 * part.params * param_bytes, cluster.device, kernels=kernels),
            stream_seconds(part.params * (param_bytes + grad_bytes), cluster.device, kernels=kernels))


def _fsdp_root(costs: LayerCosts, first: bool, last: bool, plan: StepPlan, placed: dict[str, int], grad_bytes: int,
               cluster: Cluster) -> tuple[float, float, float, float, float]:
    """One model chunk's root FSDP unit per micro-batch, as (all-gather, reduce-scatter, HSDP all-reduce, copy-out,
    copy-in) seconds: fully_shard of the model (torchtitan's and fxflops.parallel's wrapping: each block a unit, the
    model the root) holds what is outside the blocks, the embedding (`costs.pre`) with the first chunk and the
    final norm, head and loss (`costs.post`) with the last. FSDP2 does not reshard the root after the forward
    (FSDPState._lazy_init: "for the root, do not reshard after forward"): it is gathered once, before the chunk's
    first op, on the all-gather stream ahead of the first block's gather, and its gradients reduce-scattered once
    after the chunk's last backward op, when the embedding's are made (its post-backward), on the reduce-scatter
    stream after the blocks'. Zeros for a chunk without such parameters."""
    parts = [part for part, held in ((costs.pre, first), (costs.post, last)) if held and part.params]
    if not parts:
        return 0.0, 0.0, 0.0, 0.0, 0.0
    root = Part(params=sum(p.params for p in parts), expert_params=sum(p.expert_params for p in parts))
    dense = root.params - root.expert_params
    gather, scatter = _fsdp_layer_seconds(dense, plan.shard_group, placed["fsdp"], costs.param_bytes, grad_bytes,
                                          cluster)
    expert_gather, expert_scatter = _fsdp_layer_seconds(root.expert_params, plan.expert_shard_group,
                                                        placed["fsdp_experts"], costs.param_bytes, grad_bytes, cluster)
    replica = _replica_all_reduce(dense, plan.shard_group, plan, placed, grad_bytes, cluster) \
        + _replica_all_reduce(root.expert_params, plan.expert_shard_group, plan, placed, grad_bytes, cluster)
    copy_out, copy_in = (0.0, 0.0) if costs.fsdp_in_capture else _fsdp_copies(root, costs.param_bytes, grad_bytes,
                                                                             cluster)
    return gather + expert_gather, scatter + expert_scatter, replica, copy_out, copy_in


def _replica_all_reduce(params: int, shard_group: int, plan: StepPlan, placed: dict[str, int], grad_bytes: int,
                        cluster: Cluster) -> float:
    """HSDP's all-reduce of one layer's gradient shard (its `params` elements split `shard_group` ways) over the
    plan's replicas; 0 without HSDP."""
    if not params or plan.replicas <= 1:
        return 0.0
    return collective_seconds("all_reduce", params * grad_bytes // shard_group, plan.replicas, cluster,
                              placed["replicate"])


def _param_gather_exposed(rank: int, chunks: list[int], costs: LayerCosts, plan: StepPlan, cluster: Cluster,
                          placed: dict[str, int], layer_fwd: float, pre_comm: float, post_comm: float) -> float:
    """Seconds the distributed optimizer's all-gather of the updated parameters adds to a pipeline rank's step.

    Without overlap_param_gather: the whole gather after the optimizer step. With it, as Megatron-Core r0.8.0's
    DistributedOptimizer runs it (distrib_optimizer.py: zero_grad dispatches the first bucket's all-gather, and
    each bucket's forward pre-hook waits for its own and dispatches the next: one bucket in flight, in forward
    order): each unit (the embedding with the first chunk, each layer, the head with the last; the gather
    bucketed per layer, as the reduce-scatter is) gathered one ahead of the rank's first micro-batch forward,
    what that forward does not hide exposed. The rank's later chunks (interleaved pipeline) are taken as run
    right after its first, which hides less than the schedule does."""

    def gather(params: int, experts: int) -> float:
        return collective_seconds("all_gather", (params - experts) * costs.param_bytes, plan.grad_group, cluster,
                                  placed["fsdp"]) + (collective_seconds(
            "all_gather", experts * costs.param_bytes, plan.expert_group, cluster, placed["fsdp_experts"])
            if experts else 0.0)

    block, pre, post = costs.block, costs.pre, costs.post
    if not plan.overlap_param_gather:
        return gather(_rank_params(rank, chunks, plan.pp, costs), _rank_expert_params(rank, chunks, plan.pp, costs))
    compute, gathers = [], []
    for c in range(rank, len(chunks), plan.pp):
        if c == 0:
            compute.append(pre.forward + pre_comm)
            gathers.append(gather(pre.params, 0))
        compute += [layer_fwd] * chunks[c]
        gathers += [gather(block.params, block.expert_params)] * chunks[c]
        if c == len(chunks) - 1:
            compute.append(post.forward + post_comm)
            gathers.append(gather(post.params, 0))
    return _prefetched(compute, gathers, [0.0] * len(compute)) - sum(compute)


def _rank_expert_params(rank: int, chunks: list[int], stages: int, costs: LayerCosts) -> int:
    """Expert parameter elements a pipeline rank holds (after the ep split)."""
    return sum(chunks[c] for c in range(rank, len(chunks), stages)) * costs.block.expert_params


def _rank_params(rank: int, chunks: list[int], stages: int, costs: LayerCosts, tensors: bool = False) -> int:
    """Parameter elements a pipeline rank holds: its chunks' layers, the embedding with the first chunk,
    the head with the last (`tensors`: the trainable parameter tensors instead, Part.tensors)."""
    layers = sum(chunks[c] for c in range(rank, len(chunks), stages))
    count = (lambda part: part.tensors) if tensors else (lambda part: part.params)  # noqa: E731
    return layers * count(costs.block) + (count(costs.pre) if rank == 0 else 0) \
        + (count(costs.post) if rank == (len(chunks) - 1) % stages else 0)


def _gradient_reduction(timeline: Timeline, rank: int, chunks: list[int], costs: LayerCosts, plan: StepPlan,
                        cluster: Cluster, placed: dict[str, int], compute_end: float
                        ) -> tuple[float, list[tuple[int, str, float, float]]]:
    """Data parallelism without FSDP: the gradients reduced once per step over their group (dp x cp ranks; the
    experts' over the dp x cp / ep ranks holding the same experts), queued on the rank's communication stream
    as the last micro-batch's backward of their chunk produces them (the head's once its backward has run, the
    layers of a chunk evenly through that backward, last layer first, the embedding's at its end), or all
    after the backward without overlap. The all-reduce runs per bucket as the plan's software fills them
    (`ddp_bucket_limits`; `fxflops.parallel.buckets`: the gradients in the order they become ready, a bucket
    closed once it reaches its limit, one open bucket per group), each bucket once its last gradient is ready,
    so the last one is exposed; with grad_buckets "layer" (and the distributed optimizer's reduce-scatter) each
    layer's gradients are reduced at once (replicate() per block).
    Returns when the rank's last reduction ends, and the reductions as (rank, name, start, end)."""
    from fxflops.parallel.buckets import Gradient, assign_buckets

    reduce = "reduce_scatter" if plan.distributed_optimizer else "all_reduce"
    grad_bytes = plan.grad_bytes or costs.param_bytes
    groups = {"": (plan.grad_group, placed["fsdp"]), "experts": (plan.expert_group, placed["fsdp_experts"])}
    # (ready, bytes, group, unit) in the order the gradients become ready; a unit is reduced at once per layer
    ready: list[tuple[float, int, str, int]] = []
    chunk_of: list[int] = []  # each gradient's model chunk: every chunk is a DDP of its own, with its own buckets
    last = plan.microbatches - 1
    events = sorted((e for e in timeline.rank_events(rank)
                     if e.stream == "compute" and e.kind == "backward" and e.microbatch == last), key=lambda e: e.start)
    for e in events:
        def at(seconds: float) -> float:
            return seconds if plan.overlap_grad_reduce else compute_end

        unit = len(ready)
        if e.chunk == len(chunks) - 1 and costs.post.params:  # the head: its backward runs first
            head = min(e.end, e.start + costs.post.backward + costs.post.comm_backward)
            ready.append((at(head), costs.post.params * grad_bytes, "", unit))
        n = chunks[e.chunk]
        for j in range(n):
            unit = len(ready)
            for elements, expert in _block_gradients(costs):
                ready.append((at(e.start + (j + 1) / n * (e.end - e.start)), elements * grad_bytes,
                              "experts" if expert else "", unit))
        if e.chunk == 0 and costs.pre.params:  # the embedding's, at the end of the first chunk's backward
            ready.append((at(e.end), costs.pre.params * grad_bytes, "", len(ready)))
        chunk_of += [e.chunk] * (len(ready) - len(chunk_of))
    reductions: list[tuple[float, int, str]] = []  # (ready, bytes, group)
    if plan.distributed_optimizer or plan.grad_buckets == "layer":  # per layer (and per group)
        units: dict[tuple[int, str], list[Any]] = {}
        for when, size, group, unit in ready:
            units.setdefault((unit, group), []).append((when, size))
        reductions = [(max(w for w, _ in items), sum(b for _, b in items), group)
                      for (_, group), items in units.items()]
    else:  # DDP's buckets, per model chunk (Megatron-LM and torchtitan wrap each chunk in a DDP of its own) and
        # per process group (each group's gradients are bucketed apart), in ready order
        for chunk, group in dict.fromkeys((chunk_of[i], item[2]) for i, item in enumerate(ready)):
            mine = [i for i, item in enumerate(ready) if item[2] == group and chunk_of[i] == chunk]
            gradients = [Gradient(name=str(i), unit=str(ready[i][3]), bytes=ready[i][1], dtype="grad", group=group)
                         for i in mine]
            for indices in assign_buckets(gradients, ddp_bucket_limits(plan, cluster, grad_bytes, chunk)):
                picked = [mine[k] for k in indices]
                reductions.append((max(ready[i][0] for i in picked), sum(ready[i][1] for i in picked), group))
    free, comm = 0.0, []
    for when, size, group in sorted(reductions, key=lambda r: r[0]):
        start = max(free, when)
        free = start + collective_seconds(reduce, size, groups[group][0], cluster, groups[group][1])
        comm.append((rank, f"dp {reduce}" + (" (experts)" if group else ""), start, free))
    return max(compute_end, free), comm


def ddp_bucket_limits(plan: StepPlan, cluster: Cluster, grad_bytes: int, chunk: int = 0) -> list[int]:
    """The byte limits of the data-parallel all-reduce's buckets of model chunk `chunk` (a DDP of its own; chunk c
    on pipeline rank c mod pp), as the plan's software fills them (the last limit repeats;
    `fxflops.parallel.buckets.assign_buckets` walks them), from the cluster's software constants: torch DDP's
    1 MiB first bucket then 25 MiB ones (`bucket_cap_mb` MiB each when given); Megatron-LM's max(40M, 1M x dp)
    elements when the reduction overlaps the backward, on the first pipeline stage's first chunk only (Megatron
    turns bucketing off on the other stages, for the later chunks of interleaving, disable_bucketing, and
    without overlap: the chunk's whole buffer at once); DeepSpeed's 5e8 elements."""
    if plan.grad_buckets == "torch":
        if plan.bucket_cap_mb is not None:
            from fxflops.parallel.buckets import bucket_limits

            return bucket_limits(plan.bucket_cap_mb)
        return [cluster.ddp_first_bucket, cluster.ddp_bucket_cap]
    if plan.grad_buckets == "megatron":
        if not plan.overlap_grad_reduce or chunk > 0:
            return [_WHOLE_BUFFER]
        return [max(cluster.megatron_bucket_elements, cluster.megatron_bucket_elements_per_dp * plan.dp) * grad_bytes]
    if plan.grad_buckets == "deepspeed":
        return [cluster.deepspeed_bucket_elements * grad_bytes]
    raise ValueError(f"grad_buckets={plan.grad_buckets!r} has no bucket sizes; pick one of {', '.join(GRAD_BUCKETS)}")


_WHOLE_BUFFER = 1 << 62  # a bucket limit no gradient buffer reaches: one bucket


def _block_gradients(costs: LayerCosts) -> tuple[tuple[int, bool], ...]:
    """One layer's gradients in the order its backward makes them: (elements, in the experts), per module as
    the capture saw them, else the layer's dense and expert parameters."""
    if costs.block_gradients:
        return costs.block_gradients
    dense = costs.block.params - costs.block.expert_params
    return tuple((n, expert) for n, expert in ((dense, False), (costs.block.expert_params, True)) if n)


def _split(layers: int, chunks: int) -> list[int]:
    """Layers per chunk, as even as they go (the first chunks take the remainder)."""
    base, extra = divmod(layers, chunks)
    return [base + (1 if c < extra else 0) for c in range(chunks)]


def _prefetched(compute: list[float], before: list[float], after: list[float],
                chained: list[float] | None = None) -> float:
    """Layers run one after another on the compute stream, each waiting for its `before` collective (FSDP's
    all-gather, issued on the communication stream when the previous layer starts: one layer of prefetch);
    each layer's `after` collective (reduce-scatter) queues on that stream when the layer ends (one queue for
    both, in issue order: FSDP2's all-gather and reduce-scatter streams reach one NCCL communicator, whose
    kernels NCCL runs one after another, src/enqueue.cc ncclLaunchPrepare), and its `chained` one (HSDP's
    all-reduce over the replicas, another communicator) on a third stream once that reduce-scatter is done
    (FSDP2's all_reduce_stream). Returns when every stream is done."""
    if not compute:
        return 0.0
    comm = ready = before[0]
    end = reduced = 0.0
    for i, seconds in enumerate(compute):
        start = max(end, ready)
        if i + 1 < len(compute):
            comm = ready = max(comm, start) + before[i + 1]
        end = start + seconds
        if after[i]:
            comm = max(comm, end) + after[i]
        if chained and chained[i]:
            reduced = max(reduced, comm) + chained[i]
    return max(end, comm, reduced)


def tokens_of(inputs: Any) -> tuple[int, int]:
    """(batch, tokens) of a micro-batch: the first tensor's first dimension, and batch x its second (token ids)
    or its first two dimensions' product."""
    import torch

    def first(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list | tuple):
            for item in value:
                found = first(item)
                if found is not None:
                    return found
        return None

    tensor = first(inputs)
    if tensor is None or tensor.dim() < 1:
        raise ValueError("predict_step: the inputs hold no tensor to read the micro-batch from; give tokens=")
    batch = int(tensor.shape[0])
    return batch, batch * (int(tensor.shape[1]) if tensor.dim() > 1 else 1)

def capture_costs(model: Any, inputs: Any, cluster: Cluster, *, tp: int = 1, sequence_parallel: bool = False,
                  dtype: Any = None, loss: Any = None, layers: int | None = None, memory: bool = False,
                  placed: dict[str, int] | None = None, tokens: int | None = None,
                  tp_plan: dict[str, Any] | None = None, cp: int = 1, ep: int = 1,
                  routing: Any = None, kernels: Any = None, fsdp: bool = True,
                  loss_parallel: bool = False) -> LayerCosts:
    """One capture of `model` on `inputs` (one micro-batch of one data-parallel rank) under tp (and sequence
    parallelism; `tp_plan`: the user's {module path: ParallelStyle}, else the derived Megatron-style plan;
    `loss_parallel`: the logits left vocabulary-sharded and the loss's all-reduces recorded as tp collectives),
    cp (ring attention on S/cp positions) and ep (the experts split over ep ranks, captured with dp = ep / cp,
    the data-parallel ranks ep borrows besides cp's: torchtitan's dp_shard_in_ep; `routing` as estimate() takes
    it), the data-parallel ranks cp and ep bring sharded by FSDP (`fsdp`) or replicated (DDP), read as
    per-layer costs on `cluster`'s device; `kernels`: an `op_time.Kernels` (what the run's software launches:
    fused or unfused attention). The pipeline is not captured: its stages are the same layers."""
    import torch

    import fxflops
    from fxflops.predict.layers import layer_costs
    from fxflops.predict.op_time import FLASH

    dtype = dtype or torch.bfloat16
    batch, counted_tokens = tokens_of(inputs)
    # expert parallelism borrows its ranks from dp and all of cp (ep = dp_in_ep x cp): the capture's data
    # parallelism spans those, FSDP (or DDP) over dp x cp
    dp = max(1, ep // cp)
    parallel = None
    if tp * cp * ep > 1:
        parallel = {"tp": tp, "cp": cp, "ep": ep, "dp": dp}
        if dp * cp > 1 and not fsdp:
            parallel["fsdp"] = False
        if tp > 1:
            parallel |= {"sequence_parallel": sequence_parallel, "tp_plan": tp_plan, "loss_parallel": loss_parallel}
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    if memory:
        from fxflops.memory import MemoryOptions

        # a loop whose backward starts from a loss keeps the loss, not the model's output (torchtitan's train step
        # deletes `pred` before loss.backward(); Megatron-LM's GPTModel computes the loss in its forward): the
        # output lives as autograd keeps it. Without `loss`, the backward is seeded at the output, which the
        # caller holds
        memory = MemoryOptions(output_held=loss is None)
    est = fxflops.estimate(model, args, backward=True, loss=loss, parallel=parallel, memory=memory,
                           **({"routing": routing} if routing is not None else {}))
    placed = {"tp": ranks_per_node(tp, 1, cluster), "cp": ranks_per_node(cp, tp, cluster),
              "ep": ranks_per_node(ep, tp, cluster), **(placed or {})}

    def per_node(kind: str, group_desc: str) -> int:
        # a collective's placement by what issued it (its group may be the default one of a 1-D capture)
        return placed.get(kind, placed["tp"])

    costs = layer_costs(est, model, cluster, dtype, per_node, tp=tp, sequence_parallel=sequence_parallel,
                        micro_batch=batch, tokens=tokens or counted_tokens, layers=layers,
                        fsdp_shard=dp * cp if fsdp else 1, expert_shard=dp * cp // ep if fsdp else 1, cp=cp, ep=ep,
                        kernels=kernels or FLASH)
    notes = list(costs.notes)
    if (kernels or FLASH).fused_composites:
        fused = sorted({node.fused_call.kind for node in est.nodes if node.fused_call is not None})
        if fused:
            notes.append(f"{', '.join(fused)} timed as one fused kernel per call, forward and backward, as torch "
                         "runs it on CUDA (rms_norm: _fused_rms_norm; counted as its decomposition)")
    if ep > 1:
        routed = routing if routing is not None else "balanced"
        notes.append(f"MoE routing assumed {routed!r} (estimate(routing=...); balanced: tokens x top_k / experts "
                     "tokens per expert, the same on every rank); the expert all-to-alls are exposed (torchtitan's "
                     "default, not overlapped with compute)")
    if cp > 1:
        notes.append("ring attention (cp): the k/v all-gather overlaps step 0 of the ring (attention on the rank's "
                     "own keys), the rest of it and the dk/dv reduce-scatter are exposed")
    return dataclasses.replace(costs, notes=tuple(notes))


def kernels_notes(kernels: Any) -> list[str]:
    """What a prediction (or a plan search) says about the kernels it assumed where they are not the default."""
    notes = []
    if kernels.attention == "cudnn":
        notes.append("attention timed as cuDNN's fused kernels ('cudnn': the device's cudnn_attention curves)")
    elif kernels.attention != "flash":
        dropout = f" and attention dropout {kernels.attention_dropout:g}" if kernels.attention_dropout else ""
        notes.append(f"attention timed as unfused ({kernels.attention!r}) kernels{dropout}: batched GEMMs over every "
                     "pair, the scores through memory")
    if kernels.fuse_elementwise:
        notes.append("each chain of pointwise ops timed as one fused kernel (fuse_elementwise=True)")
    if kernels.persistent_norm:
        notes.append("layer norms timed as apex's persistent fast layer norm (persistent_norm=True)")
    return notes


def predict_step(model: Any, inputs: Any, parallel: dict[str, Any] | None = None, cluster: str | Cluster = "DGX A100",
                 global_batch: int | None = None, micro_batch: int | None = None, dtype: Any = None,
                 recompute: str = "none", sequence_parallel: bool = True, *, schedule: str = ONE_F_ONE_B,
                 distributed_optimizer: bool = False, overlap_grad_reduce: bool = True, loss: Any = None,
                 layers: int | None = None, grad_bytes: int | None = None,
                 trace: str | Path | None = None, device: str | Path | Any = None,
                 routing: Any = None, attention: str = "flash", attention_dropout: float = 0.0,
                 fuse_elementwise: bool = False, persistent_norm: bool = False, pipeline_engine: str = MEGATRON,
                 grad_buckets: str = "torch", tp_comm_overlap: bool = False,
                 optimizer_state_bytes: int | None = None,
                 overlap_param_gather: bool = False, grad_accumulation: str = "autograd",
                 optimizer: Any = None, optimizer_impl: str | None = None) -> StepPrediction:
    """Predict one training step of `model` on `cluster` under a parallel plan, per rank role.

    `inputs` are one micro-batch of one data-parallel rank (token ids (micro_batch, seq) for a language model);
    `parallel` has `tp`, `pp`, `dp`, `virtual_stages` (interleaved 1F1B), `fsdp` (default True when dp x cp > 1:
    FSDP; False: replicated parameters with the gradients all-reduced in buckets as `grad_buckets` says the
    software fills them: "torch" (default: DDP's Reducer, a 1 MiB first bucket then 25 MiB ones, or
    `bucket_cap_mb` MiB each, as fxflops.Parallel takes it), "megatron", "deepspeed" or "layer" (one all-reduce per
    layer), the sizes cluster constants (`explain` prints them with their sources); or reduce-scattered with
    `distributed_optimizer`), `dp_shard` (HSDP: FSDP's shard degree, dividing dp; the gradient shards all-reduced
    over the dp / dp_shard replicas), `ep` (experts split over ep of the dp x cp ranks,
    torchtitan's layout: ep divides dp x cp, cp divides ep; `routing` as estimate() takes it, balanced by
    default) and `cp` (the sequence split over cp ranks, ring attention; gradients reduced over dp x cp), in any
    combination with each other, pp and FSDP or DDP, `loss_parallel` (tp > 1: the logits left
    vocabulary-sharded, the loss's all-reduces timed as the capture records them), `tp_plan` ({module path:
    ParallelStyle}, as fxflops.Parallel takes it; default: the derived Megatron-style plan). `global_batch`
    (default: one micro-batch per data-parallel rank) sets the micro-batches per step. `recompute`: "none",
    "selective" (attention kernels recomputed) or "full" (each layer's forward recomputed in its backward).
    `sequence_parallel` applies when tp > 1. The model is captured once (fxflops.estimate with backward=True
    and the tp plan) and its repeated blocks give the per-layer costs; `layers` says the depth the model stands
    for when it is built shallower. `trace` writes the per-rank timeline with its critical path: an HTML page
    for a path ending .html, a Chrome trace otherwise. Returns a StepPrediction: step_time, breakdown, mfu, hfu,
    tokens_per_sec, per rank role. `device`: the cluster's GPUs replaced by this device (a preset, or a device
    file such as `fxflops.predict.calibrate` writes from a measured run; the prediction names the file).
    `attention`: the attention kernels the run's software launches, "flash" (a fused FlashAttention-class
    kernel, default), "cudnn" (cuDNN's fused kernel, as Transformer Engine runs it on Hopper) or "math"
    (unfused: batched GEMMs over every pair, softmax and its backward through memory, as torch's math SDPA
    backend and Megatron-LM before FlashAttention run it), with
    `attention_dropout` (the attention probabilities' dropout, a kernel of its own when unfused); see
    `fxflops.predict.op_time.Kernels`; `fuse_elementwise`: the run's software fuses each chain of pointwise ops
    into one kernel (Megatron-LM's bias + GeLU and bias + dropout + add, a GPU's native dropout; `Kernels`);
    `persistent_norm`: its layer norms are apex's persistent fast layer norm (Megatron-LM's persist_layer_norm,
    Transformer Engine's LayerNorm), timed at the device's persistent_normalization curves (`Kernels`).
    `pipeline_engine`: "megatron" (default) or "deepspeed", DeepSpeed's 2021 PipelineEngine: blocking sends,
    activations and gradients partitioned over tp and all-gathered by the receiver, the data-parallel
    reduction after the last backward (`_deepspeed_boundary`), the gradients accumulated by the engine in each
    backward and, in bf16, its BF16_Optimizer's sharded step and parameter all-gather (`_accumulation`;
    pass dtype=torch.float16 for DeepSpeed of 2021, whose engine had no bf16). `tp_comm_overlap` (sequence parallelism only):
    the tensor-parallel all-gathers and reduce-scatters overlapped with the GEMMs they feed or follow
    (Megatron-LM's --tp-comm-overlap, torchtitan's async TP), each pair taking the longer of the two.
    `overlap_param_gather` (with `distributed_optimizer`): the updated parameters' all-gather overlapped with the
    next step's forward, one bucket (layer) ahead (Megatron-LM's --overlap-param-gather); without it the gather
    runs after the optimizer step. `grad_accumulation`: how the software adds each micro-batch's gradients into the
    step's (without FSDP and outside DeepSpeed's engine, which accumulate as their code does): "autograd" (default:
    torch's AccumulateGrad into .grad from the second micro-batch; plain torch, DDP), "main_grad" (Megatron-LM's
    DDP hooks adding .grad into a main_grad buffer of `grad_bytes` every micro-batch) or "fused" (that, the Linear
    weights' accumulated by their weight-gradient GEMM: Megatron-LM's gradient_accumulation_fusion); `_accumulation`.
    The prediction also holds each pipeline rank's predicted peak memory by kind (`memory`, `peak_memory`,
    `fits` against the device's memory; the computation the plan search filters by, `step_memory`), with
    `optimizer_state_bytes` of optimizer state per parameter element (default 12: Adam with fp32 master weights
    and moments; 4 for torch's AdamW on a bf16 model, 8 on an fp32 one; with `optimizer`, its state tensors like
    the model's parameters unless given). The optimizer step is timed as the kernels its implementation launches
    (`fxflops.predict.optimizer_time`): without `optimizer`, one fused kernel reading and writing that state once
    (Apex / DeepSpeed FusedAdam, Megatron-LM's optimizer); `optimizer` ("adam", "adamw" or "sgd" with torch's
    defaults, or a torch.optim.Adam / AdamW / SGD instance) times torch.optim's own step under `optimizer_impl`:
    "foreach" (torch's default on CUDA: one multi-tensor kernel per tensor operation, 40 B a parameter element for
    AdamW in bf16), "for_loop" (the same operations one parameter tensor at a time) or "fused" (`fused=True`: one
    kernel); None: the instance's `foreach` / `fused`, else foreach. A prediction is a model with a stated
    error, not a measurement."""
    import torch

    from fxflops.device.peaks import dtype_key
    from fxflops.predict.hardware import with_device
    from fxflops.predict.op_time import Kernels

    parallel = dict(parallel or {})
    known = ("tp", "pp", "dp", "ep", "cp", "virtual_stages", "fsdp", "sequence_parallel", "tp_plan", "loss_parallel",
             "bucket_cap_mb", "dp_shard")
    unknown = set(parallel) - set(known)
    if unknown:
        raise ValueError(f"predict_step: unknown parallel key {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    the_cluster = with_device(cluster, device)
    dtype = dtype or torch.bfloat16
    kernels_of_step, optimizer_state_bytes = resolve_optimizer(
        optimizer, optimizer_impl, optimizer_state_bytes, torch.empty((), dtype=dtype).element_size(), "predict_step")
    tp, pp, dp = parallel.get("tp", 1), parallel.get("pp", 1), parallel.get("dp", 1)
    cp, ep = parallel.get("cp", 1), parallel.get("ep", 1)
    sp = bool(parallel.get("sequence_parallel", sequence_parallel)) and tp > 1
    batch, _ = tokens_of(inputs)
    if micro_batch is not None and micro_batch != batch:
        raise ValueError(f"predict_step: micro_batch={micro_batch} but the inputs hold a batch of {batch}: "
                         "give the inputs of one micro-batch")
    plan = StepPlan(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, virtual_stages=parallel.get("virtual_stages", 1), sequence_parallel=sp,
                    fsdp=bool(parallel.get("fsdp", dp * cp > 1)), micro_batch=batch,
                    global_batch=global_batch or batch * dp, recompute=recompute, schedule=schedule,
                    distributed_optimizer=distributed_optimizer, overlap_grad_reduce=overlap_grad_reduce,
                    grad_bytes=grad_bytes, bucket_cap_mb=parallel.get("bucket_cap_mb"), grad_buckets=grad_buckets,
                    dp_shard=parallel.get("dp_shard"), tp_comm_overlap=tp_comm_overlap, pipeline_engine=pipeline_engine,
                    overlap_param_gather=overlap_param_gather, grad_accumulation=grad_accumulation,
                    optimizer_kernels=kernels_of_step)
    if cp > 1 or ep > 1 or plan.bucket_cap_mb is not None or plan.dp_shard is not None or tp_comm_overlap \
            or overlap_param_gather or grad_accumulation != "autograd" \
            or grad_buckets != "torch" or pipeline_engine != MEGATRON:
        plan.check(layers or 1 << 30)  # a plan that cannot run, refused before the capture
    loss_parallel = bool(parallel.get("loss_parallel", False))
    if loss_parallel and tp == 1:
        raise ValueError("predict_step: loss_parallel splits the logits' vocabulary over the tp ranks; give tp > 1")
    placed = dim_ranks_per_node(plan, the_cluster)
    # a bad choice fails here, before the capture
    kernels = Kernels(attention, attention_dropout, fuse_elementwise, persistent_norm)
    options = dict(dtype=dtype, loss=loss, layers=layers, placed=placed, tp_plan=parallel.get("tp_plan"), cp=cp, ep=ep,
                   routing=routing, kernels=kernels, fsdp=plan.fsdp, loss_parallel=loss_parallel, memory=True)
    note = None
    try:
        costs = capture_costs(model, inputs, the_cluster, tp=tp, sequence_parallel=sp, **options)
    except Exception as error:
        if not sp:
            raise
        # a model the derived plan cannot run sequence-sharded (sequence parallelism with mixture-of-experts
        # layers is not built): predicted without sequence parallelism, and the prediction says so
        costs = capture_costs(model, inputs, the_cluster, tp=tp, sequence_parallel=False, **options)
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        note = f"sequence parallelism failed on this model ({first[:160]}); predicted without it" \
            + (" and without tp_comm_overlap (it needs sequence parallelism)" if plan.tp_comm_overlap else "")
        plan = dataclasses.replace(plan, sequence_parallel=False, tp_comm_overlap=False)
    prediction = simulate_plan(costs, plan, the_cluster, dtype_key(dtype), optimizer_state_bytes)
    if note:
        prediction.notes.append(note)
    prediction.notes.extend(kernels_notes(kernels))
    if plan.pipeline_engine == DEEPSPEED and (pp > 1 or not (plan.fsdp and dp * cp > 1)):
        # the engine's own gradient accumulation applies with or without a pipeline (not under FSDP)
        accumulation = "the gradients accumulated by the engine in each backward (" \
            + ("BF16_Optimizer: cast to fp32 and added every micro-batch; fp32 all-reduce, optimizer sharded over dp, "
               "bf16 parameters all-gathered after the step" if _bf16_optimizer(plan, dtype_key(dtype))
               else "torch's AccumulateGrad from the second micro-batch") + ")"
        prediction.notes.append(
            "DeepSpeed's pipeline engine: blocking sends (meta and 1/tp part), the receiver all-gathering over tp, "
            f"{accumulation}, the data-parallel reduction after the last backward; its tied-embedding gradient "
            "all-reduce (ReduceTiedGrads) is not modelled" if pp > 1
            else f"DeepSpeed's engine: {accumulation}, the data-parallel reduction after the last backward")
    if trace is not None and str(trace).endswith((".html", ".htm")):
        prediction.to_html(trace)
    elif trace is not None:
        prediction.to_chrome_trace(trace)
    return prediction
