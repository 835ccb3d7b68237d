"""A parallel plan as data: degrees of each kind of parallelism, checked against the model.

`Parallel(tp=8, dp=4)` or the dict / CLI text "tp=8,dp=4" say how a job splits the model; `check`
turns each bad plan into one clear line before anything is built. torch.distributed is not imported here.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch

from fxflops.capture.module_walk import walk_modules
from fxflops.parallel.buckets import check_bucket_cap

# attributes (of a module, or of a Hugging Face config) that give the attention heads tp splits
_HEAD_ATTRIBUTES = ("num_heads", "n_heads", "num_attention_heads", "n_head")
_KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
# the pipeline schedules a plan names (any case, '-' and '_' ignored) -> fxflops.memory.pipeline's name
_SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved": "interleaved", "interleaved1f1b": "interleaved"}
_TEXT_KEYS = frozenset({"schedule"})  # plan keys whose value is text, not a number or a flag
_REAL_KEYS = frozenset({"bucket_cap_mb"})  # plan keys whose value may have a fraction


@dataclass(frozen=True)
class Parallel:
    """How a job splits the model over ranks; the world size is the product of the degrees.

    `tp`: tensor parallel degree (a Megatron-style plan derived for Llama/GPT-style blocks, or `tp_plan`,
    torch's {module path: ParallelStyle} for parallelize_module, which wins). `sequence_parallel`: norms
    and residuals sharded along the sequence (all-gather + reduce-scatter instead of all-reduce).
    `loss_parallel`: the output head's logits left sharded along the vocabulary over the tp ranks and the
    cross-entropy run as torch's loss_parallel() computes it (all-reduces of each position's max, sum of
    exponentials and target logit), torchtitan's loss parallelism; a tp_plan must shard the head so itself.
    `dp`: data parallel degree, sharded with FSDP2's fully_shard (`fsdp=True`) over each repeated block and
    the root, or replicated as DDP (`fsdp=False`: torch's replicate(), a gradient all-reduce per block and
    the root, its all-reduces DDP's gradient buckets of `bucket_cap_mb` MiB: fxflops.parallel.buckets;
    `bucket_cap_mb=None`: DDP's default buckets, 1 MiB then 25 MiB, as predict_step reads it too);
    `reshard_after_forward` as fully_shard takes it; `dp_shard` below dp makes it HSDP
    (dp / dp_shard replicas, each sharded dp_shard ways).
    `pp`: pipeline stages (times `virtual_stages` per pipeline rank, interleaved): the repeated blocks cut
    into pp * virtual_stages contiguous stages (fxflops.parallel.pipeline).
    `ep`: expert parallel degree, the experts of each MoE layer split over `ep` ranks, tokens dispatched by
    all-to-all (fxflops.parallel.experts); torchtitan borrows them from the sharded data-parallel ranks and
    cp (ep divides dp_shard * cp, cp divides ep); expert gradients are reduced over the dp * cp / ep ranks
    holding the same experts. `cp`: context parallel degree, the inputs' sequence split over `cp` ranks and
    attention run as torch's ring attention (fxflops.parallel.context); gradients are then reduced over
    dp x cp (FSDP shards over it, HSDP over dp_shard x cp, DDP all-reduces over it), as torchtitan and
    Megatron-LM do. Every combination of tp, pp, dp (FSDP, HSDP, DDP), ep and cp composes.
    `microbatch` (samples per micro-batch), `microbatches` (micro-batches per step and data-parallel rank:
    the pipeline's micro-batches, or gradient accumulation steps) and `batch` (the global batch: samples
    per optimizer step over the job) are tied by batch = microbatch * microbatches * dp; give any of them.
    `schedule`: the pipeline schedule, which sets how many micro-batches' activations a stage holds
    (fxflops.memory.pipeline): "1F1B" (the default), "GPipe", or "interleaved" (the default with
    virtual_stages > 1, which it needs).
    The inputs given to estimate() are ONE data-parallel rank's micro-batch."""

    tp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    virtual_stages: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    fsdp: bool = True
    dp_shard: int | None = None  # FSDP's shard degree within dp (HSDP: dp / dp_shard replicas); None: dp
    reshard_after_forward: bool = True
    # DDP's gradient bucket size in MiB (None: DDP's own default, a 1 MiB first bucket then 25 MiB ones)
    bucket_cap_mb: float | None = None
    microbatch: int | None = None  # samples per micro-batch (default: the inputs' leading dimension)
    microbatches: int | None = None  # micro-batches per step per data-parallel rank (default: from batch, else 1)
    batch: int | None = None  # the global batch per optimizer step (default: microbatch * microbatches * dp)
    schedule: str | None = None  # the pipeline schedule: "1F1B", "GPipe" or "interleaved" (None: by virtual_stages)
    tp_plan: dict[str, Any] | None = field(default=None, compare=False)
    world_size: int | None = None  # when given, it must equal the product of the degrees

    @property
    def size(self) -> int:
        """The number of ranks the plan needs."""
        return self.tp * self.dp * self.pp * self.cp

    @property
    def stages(self) -> int:
        """Pipeline stages: pp ranks times virtual stages each."""
        return self.pp * self.virtual_stages

    @property
    def shard(self) -> int:
        """FSDP's shard degree (dp unless dp_shard says otherwise)."""
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def pipeline_schedule(self) -> str:
        """The schedule's name as fxflops.memory.pipeline takes it: the given one, else interleaved with
        virtual stages and 1F1B without."""
        if self.schedule is None:
            return "interleaved" if self.virtual_stages > 1 else "1f1b"
        return _SCHEDULES[self.schedule.lower().replace("-", "").replace("_", "")]

    def degrees(self) -> dict[str, int]:
        """The mesh dimensions above 1, outermost first (the order ranks are numbered in), torchtitan's
        ParallelDims layout: pp, dp_replicate (HSDP's replicas), the data-parallel ranks FSDP shards over (all
        of dp, or HSDP's dp_shard), cp, tp. Expert parallelism borrows its ranks from the sharded data-parallel
        ranks and cp (torchtitan's ep = dp_shard_in_ep x cp): those split into dp_mod_ep (the ranks holding the
        same experts) and the ep ranks they do not take from cp ("ep" without cp, else "dp_in_ep")."""
        shard = (("dp_shard", self.shard),) if self.shard != self.dp else (("dp", self.dp),)
        if self.ep > 1:
            within = self.ep // self.cp if self.ep % self.cp == 0 else self.ep
            shard = (("dp_mod_ep", self.shard * self.cp // self.ep), ("ep" if self.cp == 1 else "dp_in_ep", within))
        dims = (("pp", self.pp), ("dp_replicate", self.dp // self.shard), *shard, ("cp", self.cp), ("tp", self.tp))
        return {name: degree for name, degree in dims if degree > 1}

    def expert_dims(self) -> tuple[str, ...]:
        """The mesh dimensions the expert-parallel group spans, outermost first (flattened into one group when
        two: torchtitan's dp_shard_in_ep x cp); () without ep."""
        if self.ep == 1:
            return ()
        return tuple(name for name in ("ep", "dp_in_ep", "cp") if name in self.degrees())

    def gradient_dims(self, experts: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(dims the parameters are replicated over, dims they are sharded over): the data-parallel mesh
        dimensions whose ranks reduce a parameter's gradients, which cp joins (its ranks hold other positions
        of the same samples; Megatron's data-parallel-with-context-parallel group, torchtitan's dp_shard_cp).
        FSDP shards over all of them, HSDP replicates over dp_replicate and shards over the rest, DDP replicates
        over all. `experts`: for the expert parameters, which the expert-parallel ranks hold different slices
        of: the same less the expert-parallel dimensions (torchtitan's dp_mod_ep, Megatron's
        expert-data-parallel group)."""
        names = [name for name in self.degrees() if name not in ("pp", "tp")]
        if experts:
            names = [name for name in names if name not in self.expert_dims()]
        if not self.fsdp:
            return tuple(names), ()
        return tuple(n for n in names if n == "dp_replicate"), tuple(n for n in names if n != "dp_replicate")

    def as_dict(self) -> dict[str, Any]:
        record = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tp_plan"}
        record["tp_plan"] = None if self.tp_plan is None else {key: type(style).__name__ for key, style in self.tp_plan.items()}
        return record

    @classmethod
    def of(cls, plan: Parallel | dict[str, Any] | str) -> Parallel:
        """A Parallel from itself, a dict of its fields, or text such as "tp=8,dp=4,sequence_parallel=true"."""
        if isinstance(plan, cls):
            return plan
        if isinstance(plan, str):
            plan = _parse(plan)
        if not isinstance(plan, dict):
            raise TypeError(f"parallel= takes a fxflops.Parallel, a dict or text like 'tp=8,dp=4'; got {type(plan).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(plan) - names)
        if unknown:
            raise ValueError(f"parallel plan: unknown key {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(sorted(names))}")
        made = cls(**plan)
        made._check_degrees()
        return made

    def _check_degrees(self) -> None:
        for name in ("tp", "dp", "pp", "ep", "cp", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel plan: {name} must be a whole number >= 1; got {value!r}")
        if self.world_size is not None and self.world_size != self.size:
            raise ValueError(f"parallel plan: world size {self.world_size} is not pp*dp*cp*tp = "
                             f"{self.pp}*{self.dp}*{self.cp}*{self.tp} = {self.size}")
        if self.dp_shard is not None and (self.dp_shard < 1 or self.dp % self.dp_shard):
            raise ValueError(f"parallel plan: dp_shard={self.dp_shard} must divide dp={self.dp} "
                             "(HSDP: dp / dp_shard replicas of dp_shard shards)")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel plan: sequence_parallel splits the sequence over the tp ranks; give tp > 1")
        if self.loss_parallel and self.tp == 1:
            raise ValueError("parallel plan: loss_parallel splits the logits' vocabulary over the tp ranks; give tp > 1")
        if self.virtual_stages > 1 and self.pp == 1:
            raise ValueError(f"parallel plan: virtual_stages={self.virtual_stages} are stages per pipeline rank; "
                             "give pp > 1 with them")
        if self.schedule is not None:
            self._check_schedule()
        if self.bucket_cap_mb is not None:
            if self.fsdp:
                raise ValueError("parallel plan: bucket_cap_mb sizes DDP's gradient buckets; give it with fsdp=False "
                                 "(FSDP reduces each unit's gradients at once)")
            check_bucket_cap(self.bucket_cap_mb, "parallel plan: ")
        if self.dp_shard is not None and not self.fsdp:
            raise ValueError("parallel plan: dp_shard shards parameters (FSDP/HSDP); DDP (fsdp=False) replicates them")
        for name in ("microbatch", "microbatches", "batch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"parallel plan: {name} must be a whole number >= 1; got {value!r}")
        if self.microbatch is not None or self.microbatches is not None:
            self.batches()  # (the micro-batch size may come from the inputs: estimate_plan checks again)

    def _check_schedule(self) -> None:
        key = self.schedule.lower().replace("-", "").replace("_", "") if isinstance(self.schedule, str) else None
        if key not in _SCHEDULES:
            raise ValueError(f"parallel plan: schedule is one of 1F1B, GPipe, interleaved; got {self.schedule!r}")
        if self.pp == 1:
            raise ValueError(f"parallel plan: schedule={self.schedule!r} is a pipeline schedule; give pp > 1 with it")
        interleaved = _SCHEDULES[key] == "interleaved"
        if interleaved and self.virtual_stages == 1:
            raise ValueError("parallel plan: the interleaved schedule runs several stages per pipeline rank; "
                             "give virtual_stages > 1 with it")
        if not interleaved and self.virtual_stages > 1:
            raise ValueError(f"parallel plan: virtual_stages={self.virtual_stages} need the interleaved schedule, "
                             f"not {self.schedule!r}")

    def batches(self, inputs_batch: int | None = None) -> tuple[int | None, int, int | None]:
        """(microbatch, microbatches, batch) resolved: batch = microbatch * microbatches * dp, the micro-batch
        defaulting to `inputs_batch` (the inputs' leading dimension); one clear ValueError where they disagree."""
        micro = self.microbatch if self.microbatch is not None else inputs_batch
        if self.microbatch is not None and inputs_batch is not None and inputs_batch != self.microbatch:
            raise ValueError(f"parallel plan: microbatch={self.microbatch}, but the inputs (one micro-batch) have "
                             f"{inputs_batch} samples along their first dimension; give inputs of {self.microbatch}")
        if self.batch is None:
            count = self.microbatches or 1
            return micro, count, None if micro is None else micro * count * self.dp
        if micro is None:
            if self.microbatches is None:
                raise ValueError(f"parallel plan: batch={self.batch} needs the micro-batch size: give microbatch "
                                 "or microbatches")
            if self.batch % (self.microbatches * self.dp):
                raise ValueError(f"parallel plan: batch={self.batch} does not split into microbatches * dp = "
                                 f"{self.microbatches}*{self.dp} = {self.microbatches * self.dp} equal micro-batches")
            return self.batch // (self.microbatches * self.dp), self.microbatches, self.batch
        if self.batch % (micro * self.dp):
            raise ValueError(f"parallel plan: batch={self.batch} is not a multiple of microbatch * dp = "
                             f"{micro}*{self.dp} = {micro * self.dp}: the micro-batches do not divide the batch")
        count = self.batch // (micro * self.dp)
        if self.microbatches is not None and self.microbatches != count:
            raise ValueError(f"parallel plan: batch={self.batch} is {count} micro-batches of {micro} per dp rank "
                             f"(batch / (microbatch * dp)), not microbatches={self.microbatches}")
        return micro, count, self.batch

    def check(self, model: torch.nn.Module) -> None:
        """One clear ValueError for a plan this model cannot run; NotImplementedError for parts not built."""
        self._check_degrees()
        names = [name for name, _, alias in walk_modules(model) if alias is None]
        if self.tp_plan is not None:
            for key in self.tp_plan:
                if not any(fnmatch.fnmatchcase(name, key) for name in names):
                    raise ValueError(f"parallel plan: tp_plan names module {key!r}, which {type(model).__name__} "
                                     f"does not have (its modules: {', '.join(n for n in names[1:6] if n)}, ...)")
        if self.tp > 1:
            for where, heads in attention_heads(model):
                if heads % self.tp:
                    raise ValueError(f"parallel plan: tp={self.tp} does not divide the {heads} heads of {where}; "
                                     f"pick a tp that divides {heads}")
        if self.ep > 1:
            if self.cp > 1 and self.ep % self.cp:
                # torchtitan's ParallelDims: ep = dp_shard_in_ep x cp, so cp divides ep
                raise ValueError(f"parallel plan: ep={self.ep} with cp={self.cp}: expert parallelism borrows its "
                                 f"ranks from the data-parallel and all the cp ranks (torchtitan's layout); pick an ep "
                                 f"that is a multiple of cp={self.cp}")
            from fxflops.parallel.experts import check_experts

            check_experts(model, self.ep, self.shard * self.cp,
                          "dp_shard*cp" if self.shard != self.dp else "dp*cp" if self.cp > 1 else "dp")
        if self.pp > 1:
            layers = len(repeated_blocks(model))
            if not layers:
                raise ValueError(f"parallel plan: pp={self.pp} cuts the repeated blocks into stages, and "
                                 f"{type(model).__name__} has none (a ModuleList or Sequential of layers of one class)")
            if self.pp > layers:
                raise ValueError(f"parallel plan: pp={self.pp} stages for {layers} layers; pp can be at most {layers}")
            if self.stages > layers:
                raise ValueError(f"parallel plan: pp*virtual_stages = {self.pp}*{self.virtual_stages} = {self.stages} "
                                 f"stages for {layers} layers; at most {layers} stages (one layer each)")


def _parse(text: str) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"parallel plan: {item!r} is not key=value (e.g. 'tp=8,dp=4')")
        key, value = key.strip(), value.strip()
        if key in _TEXT_KEYS:
            plan[key] = value
        elif value.lower() in ("true", "false", "yes", "no", "on", "off"):
            plan[key] = value.lower() in ("true", "yes", "on")
        else:
            try:
                plan[key] = float(value) if key in _REAL_KEYS else int(value)
            except ValueError:
                kind = "a number" if key in _REAL_KEYS else "a whole number"
                raise ValueError(f"parallel plan: {key}={value!r} is not {kind}") from None
    return plan


def attention_heads(model: torch.nn.Module) -> list[tuple[str, int]]:
    """(where, head count) for every head count the model declares: its config's and its modules'."""
    found = []
    config = getattr(model, "config", None)
    for attribute in (*_HEAD_ATTRIBUTES, *_KV_HEAD_ATTRIBUTES):
        value = getattr(config, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found.append((f"config.{attribute}", value))
    for name, module, alias in walk_modules(model):
        if alias is not None:
            continue
        for attribute in (*_HEAD_ATTRIBUTES, *_KV_HEAD_ATTRIBUTES):
            value = module.__dict__.get(attribute)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.append((f"{name or type(model).__name__}.{attribute}", value))
    return found


def repeated_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's layers: the children of its largest ModuleList/Sequential of same-class modules that
    hold parameters (transformer blocks), with their qualified names; [] when it has none."""
    best: list[tuple[str, torch.nn.Module]] = []
    for name, module, alias in walk_modules(model):
        if alias is not None or not isinstance(module, torch.nn.ModuleList | torch.nn.Sequential | torch.nn.ModuleDict):
            continue
        children = [(f"{name}.{key}" if name else key, child) for key, child in module.named_children()]
        if len(children) > len(best) and len({type(child) for _, child in children}) == 1 \
                and any(True for _ in children[0][1].parameters()):
            best = children
    return best
