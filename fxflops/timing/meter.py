"""A training loop's exact FLOPs, throughput and MFU per step, from one sweep capture per shape family.

`FlopsMeter(model, example_batch)` captures nothing until the first batch is counted. Batches of one
structure (the same inputs, ranks and dtypes) are a family: its first batch is captured once as a
sweep with the batch and sequence (or image) axes symbolic (`fxflops.sweeps`), the forward and the
backward autograd runs for it, and every later batch of the family is a point of that sweep: the
count `estimate(backward=True)` gives at that shape, evaluated from a compiled formula in
microseconds. Each step records FLOPs, samples, tokens, step time, achieved FLOP/s and MFU; window
averages, a summary, and the 6N approximation beside the count. Errors are warned once and never
stop training: a step that cannot be counted is recorded without FLOPs.

The count follows the model, not only the batch: a family is keyed by the model's state too
(`fxflops.timing.model_state`: trainable and training flags, settings such as gradient checkpointing,
the modules in the tree, parameter dtypes), read once per step, so freezing a layer, replacing a head or
switching a submodule to eval costs one new capture and never leaves a stale count.

The core knows nothing of transformers or Lightning; `fxflops.integrations` feeds it from theirs.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from fxflops.api import _callers_level
from fxflops.capture.module_walk import walk_modules
from fxflops.capture.tensor_walk import tensors_in
from fxflops.capture.twins import meta_twin, with_twins
from fxflops.count.attention import check_attention
from fxflops.parallel.pipelining import is_pipeline_stage
from fxflops.parallel.stage import stage_inputs
from fxflops.rules import preset
from fxflops.rules.formula import clip
from fxflops.spelling import spelled_keywords
from fxflops.timing.families import Family, call_inputs, first_line, infer_dims, output_loss, structure
from fxflops.timing.model_state import ModelState, model_state, state_change
from fxflops.timing.reduction import all_reduced
from fxflops.timing.routed import NotObserved, RowObserver
from fxflops.timing.steps import (
    JOB_SCALED, JOB_SUMMED, BatchCount, StepStats, Totals, WindowStats, attention_flops, attention_shape, combined, non_embedding_params,
    ratio, scaled, summed, unread,
)

JOB_TOTALS = ("all_reduce", "local_x_world")  # how reduce() forms a job's total from the ranks' local counts

# the meter's records and helpers kept importable from here, where they were first
__all__ = ["JOB_SCALED", "JOB_SUMMED", "BatchCount", "FlopsMeter", "FlopsMeterWarning", "StepStats", "WindowStats", "attention_flops",
           "attention_shape", "combined", "infer_dims", "non_embedding_params", "summed", "unread"]


class FlopsMeterWarning(UserWarning):
    """The meter could not count or time something; training goes on, the step is logged without it."""


class FlopsMeter:
    """Exact FLOPs, throughput and MFU of every training step; see the module's docstring.

    `example_batch` is what the loop feeds the model: a dict of tensors (model(**batch)), a tuple or
    list (model(*batch)) or one tensor. `dims` names its axes ({"batch": 0, "seq": 1}); by default
    token inputs (input_ids, attention_mask, labels; an integer 2-d tensor) are (batch, seq), images
    (pixel_values; a 4-d float tensor) (batch, C, height, width), anything else batch on axis 0.
    `loss(output)` is what the backward differentiates: by default the output's `loss` when the batch
    has `labels` (transformers models), else the sum of its floating outputs, as in estimate().
    `peak_flops` (FLOP/s per device) overrides the peaks table, which knows GPUs by name and the
    compute `dtype` (default: autocast's when a micro-batch is counted under it, else the parameters').
    `optimizer` counts its step apart. `window` is how many steps `window()` averages.
    `model` may be a DDP wrapper (its module is counted) or a torch.distributed.pipelining
    `PipelineStage` (its `submod`, fed the micro-batches the stage receives). `attention="effective"` counts attention at the pairs its masks keep, a mask passed in as data
    (padding, packed documents) from each batch's own (`fxflops.timing.data_masks`), the dense count
    beside it (`dense_flops`); the default "dense" counts every pair, as FlopCounterMode does.

    Inside a process group (torchrun, or torch's fake group) the count is the calling rank's LOCAL work:
    a model sharded with DTensor (parallelize_module), FSDP2's fully_shard or a pipeline stage's module
    is counted as that rank executes it (`fxflops.estimate` in a process group counts the same), and MFU
    is per device from that count. `job_total` says how reduce() forms the job's total: "all_reduce"
    (default) sums every rank's local figures with one all-reduce per call (ranks may differ: pipeline
    stages, uneven batches), "local_x_world" multiplies this rank's by the world size without a
    collective (right where every rank runs the same ops on equal batches: tensor parallel, FSDP). A
    fake process group's collectives sum nothing (there is one process): there the formula is used.

    Use: `meter.start()` before a step (or pass `time=` to step()), `meter.micro_batch(batch)` per
    forward/backward, `meter.step()` after optimizer.step(); or `meter.step(batch)` for both. A mixture of
    experts is counted at the rows each expert received: run the forward inside `with meter.observe():`
    and count the micro-batch after it (`fxflops.timing.routed`; `StepStats.routed_rows`).
    """

    @spelled_keywords
    def __init__(
        self,
        model: torch.nn.Module,
        example_batch: Any = None,
        *,
        dims: Mapping[str, int | tuple[int, ...]] | None = None,
        loss: Callable[[Any], torch.Tensor] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        peak_flops: float | None = None,
        optimizer: str | torch.optim.Optimizer | None = None,
        window: int = 100,
        conventions: str = "deepspeed",
        rules: Any = None,
        attention: str | None = None,
        job_total: str = "all_reduce",
    ) -> None:
        if job_total not in JOB_TOTALS:
            raise ValueError(f"job_total is one of {', '.join(map(repr, JOB_TOTALS))}, got {job_total!r}")
        if window < 1:
            raise ValueError(f"window must be 1 or more steps, got {window}")
        preset(conventions)  # a misspelt preset is refused now, not warned at every count with no FLOPs logged
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module  # the same arithmetic; the wrapper's forward would synchronize buffers
        self.stage = None  # a torch.distributed.pipelining stage: its module counted, as the rank runs it
        if is_pipeline_stage(model):
            self.stage, model = model, model.submod
        self.model = model
        self.dims = dict(dims) if dims is not None else None
        self.loss = loss
        self.device = torch.device(device) if device is not None else _model_device(model)
        self.dtype = dtype
        self.peak_flops = peak_flops
        self.optimizer = optimizer
        self.job_total = job_total
        self.steps: deque[StepStats] = deque(maxlen=window)
        self.captures = 0  # sweep captures made (one per shape family, more where a model's path changes)
        self._options = {"conventions": conventions, "rules": rules}
        if attention is not None:  # "dense" (every (query, key) pair) or "effective" (the pairs masks keep)
            check_attention(attention)
            self._options["attention"] = attention
        self._effective = attention == "effective"
        self._families: dict[Any, Family | _NotCaptured] = {}  # _NotCaptured: its capture failed (and was warned)
        self._state: ModelState | None = None  # the model's state (model_state) as last read
        self._state_read = False  # read for the current step already: once per step, not per micro-batch
        self._states: set[int] = set()  # hashes of the states seen, to say when the state changes every step
        self._uncounted: dict[str, int] = {}  # why micro-batches were not counted since last asked: how many
        self._warned: set[Any] = set()
        self._pending: list[BatchCount | None] = []
        self._autocast_dtype: torch.dtype | None = None
        self._started: Any = None
        self._last_mark: Any = None
        self._count = 0
        self._capturing = 0.0  # seconds the current step spent capturing: not the step's own time
        self._totals = Totals()
        self._peaks: dict[torch.dtype, float | None] = {}
        self._optimizer_flops: int | None | bool = False  # False: not counted yet
        self._parameters: int | None = None
        self._observer = RowObserver()  # rows routed to experts, read inside observe()
        self._priming = False
        if example_batch is not None:
            self._priming = True  # its routed rows, if any, are no forward's: only the capture is wanted
            try:
                self.count(example_batch)  # the first family captured now, not inside the first step
            finally:
                self._priming = False
            self._capturing = 0.0
            self._state_read = False

    # ------------------------------------------------------------------------------ the loop's calls

    def start(self) -> None:
        """Mark the start of a step; the next step() measures from here (CUDA events on a GPU)."""
        self._started = self._mark()
        self._capturing = 0.0
        self._state_read = False

    def micro_batch(self, batch: Any, *, backward: bool = True) -> BatchCount | None:
        """Count one forward + backward of `batch` into the current step (call once per micro-batch);
        `backward=False`: a forward alone (one run under torch.no_grad(), a teacher's or reference pass)."""
        self._autocast_dtype = _autocast_dtype(self.device) or self._autocast_dtype
        counted = self.count(batch, backward=backward)
        self._pending.append(counted)
        return counted

    @contextlib.contextmanager
    def observe(self) -> Iterator[FlopsMeter]:
        """While entered, read what the model's forwards route: a mixture of experts is counted at the rows
        each expert module received (forward pre-hooks on those modules, removed on leaving, also on an
        exception), so micro_batch() called after a forward in here counts that forward's routing, not an
        average; under expert parallelism the rows this rank's experts received. A model without routed
        sizes gets no hooks. The modules are those of the shape families captured so far; before the first
        capture (a meter built without `example_batch`, as the callbacks build theirs) which modules receive
        routed rows is not known yet: every module is watched for that step (its input rows and 1-D integer
        inputs read; only the first step), so the first step is counted too."""
        if self._families:
            paths = set().union(*(f.watched for f in self._families.values() if isinstance(f, Family)))
        else:
            paths = {name for name, _, alias in walk_modules(self.model) if name and alias is None}
        handles = self._observer.watch(self.model, paths)
        try:
            yield self
        finally:
            self._observer.unwatch(handles)

    def step(self, batch: Any = None, *, time: float | None = None) -> StepStats:
        """Close one optimizer step (its micro-batches, plus `batch` if given) and record it.

        `time` is the step's seconds (a finite number >= 0: anything else is a ValueError); without it,
        from start() if called, else since the last step(), less the time this step spent capturing."""
        if time is not None:
            time = checked_seconds(time)
        if batch is not None:
            self.micro_batch(batch)
        end = self._mark()
        if time is None:
            begin = self._started if self._started is not None else self._last_mark
            time = self._elapsed(begin, end, self._capturing)
        self._started = None
        self._capturing = 0.0
        self._state_read = False
        self._last_mark = end
        stats = self._close(self._pending, time)
        self._pending = []
        self.steps.append(stats)
        self._totals.add(stats)
        return stats

    # ---------------------------------------------------------------------------------- counting

    def count(self, batch: Any, *, backward: bool = True) -> BatchCount | None:
        """The forward + backward FLOPs of `batch` (`backward=False`: the forward's alone) for the model as
        it is now (None, warned once, if it cannot be counted)."""
        try:
            args, kwargs = call_inputs(batch)
            if self.stage is not None:  # a later stage's received activation needs its gradient (sent back)
                args = stage_inputs(self.stage, args, backward)
            tensors = tensors_in((args, kwargs))
            family = self._family(args, kwargs, tensors)
            point = family.point(tensors)
            captures, capturing = family.captures, family.capturing
            try:
                fwd, bwd, dense_fwd, dense_bwd, routed = family.flops(point, tensors, self._observer)
            finally:
                self.captures += family.captures - captures
                self._capturing += family.capturing - capturing
        except _NotCaptured as failed:  # warned about when its capture failed
            self._note_uncounted(str(failed))
            return None
        except NotObserved as missed:  # a mixture of experts counted without its forward's routed rows
            if not self._priming:
                self._note_uncounted(str(missed))
                self.warn_once(f"fxflops.FlopsMeter: a micro-batch was not counted: {missed}", key=NotObserved)
            return None
        except Exception as error:  # noqa: BLE001 - the meter never stops training
            self._note_uncounted(first_line(error))
            self.warn_once(f"fxflops.FlopsMeter: could not count a batch of {_describe(batch)}: "
                           f"{first_line(error)}; the step is logged without FLOPs", key=type(error))
            return None
        samples = point.get("batch", tensors[0].shape[0] if tensors and tensors[0].dim() else 1)
        tokens = samples * point["seq"] if "seq" in point else None
        mask = kwargs.get("attention_mask") if isinstance(kwargs, dict) else None
        real = mask.sum() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None  # read at log time
        if not backward:  # a forward alone (a teacher's, a reference pass): its FLOPs, but no samples trained
            bwd = dense_bwd = 0
            samples, tokens, real = 0, 0 if tokens is not None else None, 0 if real is not None else None
        return BatchCount(fwd, bwd, samples, tokens, real, dense_fwd + dense_bwd if self._effective else None, routed)

    def _model_state(self) -> ModelState:
        """The model's state (model_state), read once per step; a change drops what was derived from it."""
        if not self._state_read:
            state = model_state(self.model, self._observer.hook_ids)
            if state != self._state:
                if self._state is not None:
                    self._parameters = None  # 6N's N and the optimizer's trainable elements are read again
                    self._optimizer_flops = False
                    self._states.add(hash(self._state))
                    if len(self._states) > _STATES_WARNED:
                        self.warn_once(f"fxflops.FlopsMeter: the model has been in {len(self._states) + 1} states "
                                       f"(last change: {state_change(self._state, state)}); each new state costs "
                                       "a capture: a setting that changes every step (a counter kept as a module "
                                       "attribute) is better kept elsewhere", key="states")
                self._state = state
            self._state_read = True
        return self._state

    def _family(self, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Family:
        key = (structure(args, kwargs, tensors), self._model_state())
        family = self._families.get(key)
        if isinstance(family, Family) and not family.fits(tensors):
            # an axis the dims do not name changed size: that shape is a family of its own
            self.warn_once(f"fxflops.FlopsMeter: {family.misfit(tensors)}, an axis dims= does not name: each new "
                           "size there costs a capture; name it in dims= (e.g. dims={'batch': 0, 'seq': 1})",
                           key=("misfit", key))
            key = (key, tuple(tuple(t.shape) for t in tensors))
            family = self._families.get(key)
        if isinstance(family, _NotCaptured):
            raise family  # a failure is not tried again every step
        if family is not None:
            return family
        dims = self.dims if self.dims is not None else infer_dims(args, kwargs)
        begin = time.perf_counter()
        try:
            family = Family(self.model, with_twins((args, kwargs), _meta_input), dims, self._sweep_options(kwargs),
                            self.warn_once)
        except Exception as error:
            self._families[key] = _NotCaptured(first_line(error))
            raise
        finally:
            self._capturing += time.perf_counter() - begin
        self.captures += family.captures
        self._families[key] = family
        return family

    def _sweep_options(self, kwargs: dict) -> dict[str, Any]:
        loss = self.loss
        if loss is None and "labels" in kwargs:
            loss = output_loss  # the model computes its loss: the backward starts there, as training's does
        # value_sizes: a router's routed rows stay free, bound per micro-batch to what observe() read
        return {**self._options, "backward": True, "loss": loss, "value_sizes": True}

    # ----------------------------------------------------------------------------------- reading

    def window(self) -> WindowStats:
        """The last `window` steps together (FLOPs over seconds, not a mean of rates)."""
        return summed(list(self.steps))

    def total(self) -> WindowStats:
        """Every step so far together."""
        return self._totals.stats()

    def metrics(self, stats: StepStats | WindowStats | None = None, prefix: str = "") -> dict[str, float]:
        """A step's (default: the last one's) numbers as a flat dict for a logger; those not known are left out.
        Of several steps (WindowStats), `flops` and `6n_flops` are per step, the rates over their whole time."""
        stats = stats if stats is not None else (self.steps[-1] if self.steps else None)
        if stats is None:
            return {}
        per_step = stats.flops if isinstance(stats, StepStats) else stats.flops_per_step
        values = {
            "flops": per_step, "flops_per_sec": stats.flops_per_sec, "tflops": stats.tflops, "mfu": stats.mfu,
            "step_time": stats.time if isinstance(stats, StepStats) else ratio(stats.time, stats.steps),
            "samples_per_sec": stats.samples_per_sec, "tokens_per_sec": stats.tokens_per_sec,
            "6n_flops": stats.six_n_flops if isinstance(stats, StepStats) else ratio(stats.six_n_flops, stats.steps),
            "6n_over_counted": stats.six_n_ratio,
            "dense_flops": stats.dense_flops if isinstance(stats, StepStats) else ratio(stats.dense_flops, stats.steps),
            "dense_mfu": stats.dense_mfu,
        }
        if isinstance(stats, WindowStats):
            values["world_size"] = stats.world_size
        return {f"{prefix}{key}": value for key, value in values.items() if value is not None}

    def local_metrics(self, stats: StepStats | WindowStats | None = None, prefix: str = "") -> dict[str, float]:
        """This rank's own figures under a process group, for a log beside the job's: `rank`, `local_flops`
        (per step), `local_flops_per_sec` and `local_mfu` (this device's, from its local count); {} outside one."""
        if not _distributed():
            return {}
        values = self.metrics(stats)
        shown = {"rank": float(torch.distributed.get_rank())}
        for key in ("flops", "flops_per_sec", "mfu"):
            if key in values:
                shown[f"local_{key}"] = values[key]
        return {f"{prefix}{key}": value for key, value in shown.items()}

    def reduce(self, stats: StepStats | WindowStats | None = None, group: Any = None) -> WindowStats:
        """Every rank's `stats` (default: its last step) over the job's process group: the job's FLOPs,
        samples and tokens, the slowest rank's time, world size, and MFU per device; its `job_total` says
        how (JOB_SUMMED: all-reduced; JOB_SCALED: this rank's x world size, see `job_total=`).

        With job_total="all_reduce" a collective: every rank must call it at the same step (a callback's
        logging step does). Outside torch.distributed it is the local figure and communicates nothing."""
        stats = stats if stats is not None else (self.steps[-1] if self.steps else None)
        local = summed([stats]) if isinstance(stats, StepStats) else stats
        if local is None:
            local = summed([])
        if not _distributed():
            return local
        if self.job_total == "local_x_world" or torch.distributed.get_backend(group) == "fake":
            # a fake group's all-reduce returns this rank's own figure: the formula is the job's total there
            return scaled(local, torch.distributed.get_world_size(group))
        return all_reduced(local, group)

    def uncounted(self) -> str | None:
        """Why micro-batches were not counted since the last call (None if every one was): for a callback's
        log, so a run whose capture failed keeps saying so, not only in a warning at its start."""
        counts, self._uncounted = self._uncounted, {}
        if not counts:
            return None
        return "; ".join(f"{n} micro-batch{'es' if n != 1 else ''}: {reason}" for reason, n in counts.items())

    def _note_uncounted(self, reason: str) -> None:
        if reason in self._uncounted or len(self._uncounted) < 8:  # bounded: a few reasons, each counted
            self._uncounted[reason] = self._uncounted.get(reason, 0) + 1

    def summary(self, job: bool = False) -> str:
        """The run so far in a few lines: FLOPs per step, rates, MFU, and 6N beside the count.

        Under torch.distributed the figures are this rank's and say so; `job=True` sums every rank's
        (meter.reduce of the totals: a collective, call it on every rank)."""
        total = self.total()
        world = _world_size()
        if job:
            total = self.reduce(total)
        scope = ("" if world == 1 else f" (all {world} ranks, {total.job_total})" if job else
                 f" (rank {torch.distributed.get_rank()} of {world}: summary(job=True) for the job)")
        lines = [f"fxflops: {total.steps} steps, {self.captures} capture{'s' if self.captures != 1 else ''}{scope}"]
        if total.flops is not None and total.steps:
            lines.append(f"  FLOPs per step (fwd+bwd): {_si(total.flops / total.steps)}")
        for label, value, unit in (("achieved", total.flops_per_sec, "FLOP/s"), ("tokens", total.tokens_per_sec, "/s"),
                                   ("samples", total.samples_per_sec, "/s")):
            if value is not None:
                lines.append(f"  {label}: {_si(value)}{unit}")
        if total.mfu is not None:
            lines.append(f"  MFU: {total.mfu:.2%} of {_si(total.peak_flops)}FLOP/s peak")
        if total.dense_flops is not None and total.steps:
            dense_mfu = f", MFU {total.dense_mfu:.2%}" if total.dense_mfu is not None else ""
            lines.append(f"  dense attention (every pair): {_si(total.dense_flops / total.steps)} per step{dense_mfu}")
        if total.six_n_ratio is not None:
            lines.append(f"  6N approximation: {_si(total.six_n_flops / total.steps)} per step, "
                         f"{total.six_n_ratio:.3f}x the counted FLOPs")
        optimizer = self._optimizer_step_flops()
        if optimizer:
            lines.append(f"  optimizer step (apart): {_si(optimizer)}")
        return "\n".join(lines)

    def warn_once(self, message: str, key: Any = None) -> None:
        """Warn with `message` the first time this meter sees it (or its `key`: one kind of failure)."""
        key = message if key is None else key
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, FlopsMeterWarning, stacklevel=_callers_level())  # the user's line

    # ----------------------------------------------------------------------------------- helpers

    def _close(self, counts: list[BatchCount | None], seconds: Any) -> StepStats:
        self._count += 1
        counted = [c for c in counts if c is not None]
        whole = len(counted) == len(counts) and bool(counts)
        tokens = sum(c.tokens for c in counted) if counted and all(c.tokens is not None for c in counted) else None
        return StepStats(
            step=self._count, micro_batches=len(counts),
            fwd_flops=sum(unread(c, "fwd_flops") for c in counted) if whole else None,  # read when asked for
            bwd_flops=sum(unread(c, "bwd_flops") for c in counted) if whole else None,
            samples=sum(c.samples for c in counted) if whole else None, tokens=tokens if whole else None,
            six_n_flops=6 * self._non_embedding_params() * tokens if tokens is not None else None,
            attention_flops=self._attention_flops(counted),
            optimizer_flops=self._optimizer_step_flops(), peak_flops=self._peak(),
            dense_flops=sum(c.dense_flops for c in counted) if whole and self._effective else None,
            routed_rows=_summed_rows([c.routed_rows for c in counted]) if whole else None,
            _real_tokens=[c.real_tokens for c in counted], _time=seconds)

    def _mark(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    @staticmethod
    def _elapsed(begin: Any, end: Any, capturing: float) -> Any:
        if begin is None:
            return None
        if isinstance(begin, float):
            return end - begin - capturing
        return (begin, end, capturing)  # read when the step's time is asked for: no synchronization per step

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype MFU is taken against: `dtype=`, else autocast's as last seen counting a micro-batch,
        else the parameters' (bf16 weights train in bf16)."""
        return self.dtype or self._autocast_dtype or _parameter_dtype(self.model)

    def _peak(self) -> float | None:
        if self.peak_flops is not None:
            return float(self.peak_flops)
        dtype = self.compute_dtype
        if dtype not in self._peaks:
            self._peaks[dtype] = _table_peak(self.device, dtype)
            if self._peaks[dtype] is None:
                where = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type
                self.warn_once(f"fxflops.FlopsMeter: no known {str(dtype).removeprefix('torch.')} peak for {where}: "
                               "MFU is not logged; pass peak_flops= (FLOP/s per device)")
        return self._peaks[dtype]

    def _optimizer_step_flops(self) -> int | None:
        if self._optimizer_flops is False:
            self._optimizer_flops = None
            if self.optimizer is not None:
                from fxflops.optimizer import optimizer_step

                try:
                    self._optimizer_flops = optimizer_step(self.optimizer, self.model).flops
                except (TypeError, ValueError) as error:
                    self.warn_once(f"fxflops.FlopsMeter: optimizer step not counted: {error}")
        return self._optimizer_flops

    def _non_embedding_params(self) -> int:
        if self._parameters is None:
            self._parameters = non_embedding_params(self.model)
        return self._parameters

    def _attention_flops(self, counted: list[BatchCount]) -> int | None:
        if not counted or any(c.tokens is None for c in counted):
            return None
        terms = [attention_flops(self.model, c.samples, c.tokens // c.samples) for c in counted if c.samples]
        return None if None in terms else sum(terms)


class _NotCaptured(Exception):
    """A family whose capture failed: why, in one line."""


_STATES_WARNED = 16  # a model whose state changes more often than this likely changes every step: say so


def checked_seconds(seconds: Any) -> float:
    """A step's seconds as a float; NaN, infinite, negative or not a number is a ValueError that says so."""
    # float() also reads text ("1.0", b"1") and flags (True): a caller's mistake, not seconds
    refused = isinstance(seconds, (str, bytes, bytearray, bool))
    try:
        value = float("nan" if refused else seconds)
    except (TypeError, ValueError, OverflowError):  # (an int past float's range overflows)
        refused = True
    if refused:
        raise ValueError(f"fxflops: a step time is a number of seconds; got {clip(repr(seconds), 60)}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"fxflops: a step time must be finite seconds, 0 or more; got {value!r}: a timer that "
                         "failed (NaN), a sign error or an overflow, not a step to log")
    return value


def _summed_rows(rows: list[dict[str, int] | None]) -> dict[str, int] | None:
    """The rows each expert module received over a step's micro-batches; None where none was routed."""
    if all(r is None for r in rows):
        return None
    total: dict[str, int] = {}
    for found in rows:
        for path, count in (found or {}).items():
            total[path] = total.get(path, 0) + count
    return total


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _world_size() -> int:
    return torch.distributed.get_world_size() if _distributed() else 1


def _table_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type != "cuda":
        return None
    from fxflops.device import peaks

    found = peaks.peak_for(torch.cuda.get_device_name(device), dtype, tf32=peaks.tf32_enabled())
    return found[0] if found else None


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes in on this device now, or None (off, or a device autocast has no notion of)."""
    try:
        return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    except RuntimeError:  # the meta device, say
        return None


def _meta_input(tensor: torch.Tensor) -> torch.Tensor:
    """A batch tensor's meta twin that keeps requires_grad: an input that needs its gradient (a pipeline
    stage's received activation, inputs_embeds being trained) costs a grad input in the backward."""
    twin = meta_twin(tensor)
    return twin.requires_grad_(True) if tensor.requires_grad and not twin.requires_grad else twin


def _model_device(model: torch.nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _parameter_dtype(model: torch.nn.Module) -> torch.dtype:
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.get_default_dtype()


def _si(value: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.2f} "


def _describe(batch: Any) -> str:
    try:
        shapes = [tuple(t.shape) for t in tensors_in(batch)]
    except Exception:  # noqa: BLE001 - only a description
        return type(batch).__name__
    return f"shapes {shapes}" if shapes else type(batch).__name__
