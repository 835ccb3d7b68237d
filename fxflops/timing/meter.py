"""A training loop's exact FLOPs, throughput and MFU per step, from one sweep capture per shape family.

`FlopsMeter(model, example_batch)` captures nothing until the first batch is counted. Batches of one
structure (the same inputs, ranks and dtypes) are a family: its first batch is captured once as a
sweep with the batch and sequence (or image) axes symbolic (`fxflops.sweeps`), the forward and the
backward autograd runs for it, and every later batch of the family is a point of that sweep: the
count `estimate(backward=True)` gives at that shape, evaluated from a compiled formula in
microseconds. Each step records FLOPs, samples, tokens, step time, achieved FLOP/s and MFU; window
averages, a summary, and the 6N approximation beside the count. Errors are warned once and never
stop training: a step that cannot be counted is recorded without FLOPs.

The core knows nothing of transformers or Lightning; `fxflops.integrations` feeds it from theirs.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fxflops.capture.inputs import tensors_in, to_meta
from fxflops.count import check_attention
from fxflops.timing.data_masks import DataMasks

# input names whose axes 0 and 1 are (batch, sequence): transformers' and most tokenizers' keys
TOKEN_KEYS = ("input_ids", "attention_mask", "labels", "token_type_ids", "position_ids", "decoder_input_ids",
              "decoder_attention_mask", "inputs_embeds")
IMAGE_KEYS = ("pixel_values", "images", "image", "x")


class ReadOnUse:
    """A count field that may hold a 0-d tensor still on its device (pairs a data mask keeps, summed where
    the mask is): read as an int, and so synchronized, the first time the field is, not when it is set."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}_value"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            raise AttributeError(self.slot)  # as a dataclass field: no default
        value = obj.__dict__[self.slot]
        if isinstance(value, torch.Tensor):
            value = obj.__dict__[self.slot] = int(value)
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.slot] = value


def unread(obj: Any, name: str) -> Any:
    """A ReadOnUse field's value as it is (an int, None, or a tensor not yet read)."""
    return obj.__dict__[f"_{name}_value"]


class FlopsMeterWarning(UserWarning):
    """The meter could not count or time something; training goes on, the step is logged without it."""


@dataclass(frozen=True)
class BatchCount:
    """One micro-batch's counted work: forward and backward FLOPs, samples, tokens."""

    fwd_flops: int = ReadOnUse()  # type: ignore[assignment]
    bwd_flops: int = ReadOnUse()  # type: ignore[assignment]
    samples: int
    tokens: int | None  # batch x sequence, padding included; None where the batch has no sequence axis
    real_tokens: Any = None  # attention mask's sum (an int, or a 0-d tensor not yet read), else None
    dense_flops: int | None = None  # fwd + bwd with every attention pair counted, when the reading is effective

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops


class _Rates:
    """Rates from a step's or a window's sums: flops, time, tokens, samples, six_n_flops, peak_flops."""

    @property
    def flops_per_sec(self) -> float | None:
        return _ratio(self.flops, self.time)

    @property
    def tflops(self) -> float | None:
        rate = self.flops_per_sec
        return None if rate is None else rate / 1e12

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilization: achieved FLOP/s over the dense peak for the compute dtype (for a window
        across ranks: all devices' FLOP/s over all devices' peak, i.e. per device)."""
        return _ratio(self.flops_per_sec, self.peak_flops)

    @property
    def dense_mfu(self) -> float | None:
        """MFU of the dense count (every attention pair), beside an effective reading's."""
        return _ratio(_ratio(self.dense_flops, self.time), self.peak_flops)

    @property
    def tokens_per_sec(self) -> float | None:
        return _ratio(self.tokens, self.time)

    @property
    def samples_per_sec(self) -> float | None:
        return _ratio(self.samples, self.time)

    @property
    def six_n_ratio(self) -> float | None:
        """6N / counted FLOPs: above 1, 6N overstated the work; below 1, it left some out."""
        return _ratio(self.six_n_flops, self.flops)


@dataclass
class StepStats(_Rates):
    """One optimizer step: the sum of its micro-batches, and its time. Rates are derived on read."""

    step: int
    micro_batches: int
    fwd_flops: int | None = ReadOnUse()  # type: ignore[assignment]  # None: some micro-batch was not counted
    bwd_flops: int | None = ReadOnUse()  # type: ignore[assignment]
    samples: int
    tokens: int | None
    six_n_flops: int | None  # 6 x non-embedding params x tokens, transformers' total_flos per step
    attention_flops: int | None  # 12 x layers x heads x head dim x seq x tokens (6N + this: nanoGPT's, torchtitan's)
    optimizer_flops: int | None  # the optimizer step's FLOPs, not in `flops`
    peak_flops: float | None  # per device, for the compute dtype
    dense_flops: int | None = None  # fwd + bwd with every attention pair counted (attention="effective" only)
    _real_tokens: list[Any] = field(default_factory=list, repr=False)
    _time: Any = field(default=None, repr=False)  # seconds, or (start event, end event, capture seconds)

    @property
    def flops(self) -> int | None:
        """The step's forward + backward FLOPs over all its micro-batches."""
        return None if self.fwd_flops is None or self.bwd_flops is None else self.fwd_flops + self.bwd_flops

    @property
    def real_tokens(self) -> int | None:
        """Tokens the attention mask keeps (padding left out), when every micro-batch had a mask."""
        if not self._real_tokens or any(value is None for value in self._real_tokens):
            return None
        return sum(int(value) for value in self._real_tokens)

    @property
    def time(self) -> float | None:
        """The step's seconds (CUDA events are read, and so synchronized, here: only when asked)."""
        if isinstance(self._time, tuple):
            start, end, capturing = self._time
            end.synchronize()
            self._time = start.elapsed_time(end) / 1e3 - capturing
        return self._time



@dataclass(frozen=True)
class WindowStats(_Rates):
    """Sums over several steps (a window, a whole run, or every rank's step); rates are sums over sums."""

    steps: int
    flops: int | None
    samples: int
    tokens: int | None
    time: float | None  # the seconds the steps took (across ranks: the slowest rank's)
    six_n_flops: int | None
    peak_flops: float | None  # of all the devices the FLOPs ran on together
    world_size: int = 1
    dense_flops: int | None = None  # with every attention pair counted (attention="effective" only)

    @property
    def flops_per_step(self) -> float | None:
        return _ratio(self.flops, self.steps)



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

    Use: `meter.start()` before a step (or pass `time=` to step()), `meter.micro_batch(batch)` per
    forward/backward, `meter.step()` after optimizer.step(); or `meter.step(batch)` for both.
    """

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
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be 1 or more steps, got {window}")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module  # the same arithmetic; the wrapper's forward would synchronize buffers
        self.model = model
        self.dims = dict(dims) if dims is not None else None
        self.loss = loss
        self.device = torch.device(device) if device is not None else _model_device(model)
        self.dtype = dtype
        self.peak_flops = peak_flops
        self.optimizer = optimizer
        self.steps: deque[StepStats] = deque(maxlen=window)
        self.captures = 0  # sweep captures made (one per shape family, more where a model's path changes)
        self._options = {"conventions": conventions, "rules": rules}
        if attention is not None:  # "dense" (every (query, key) pair) or "effective" (the pairs masks keep)
            check_attention(attention)
            self._options["attention"] = attention
        self._effective = attention == "effective"
        self._families: dict[Any, _Family | None] = {}  # None: a family that could not be captured
        self._warned: set[Any] = set()
        self._pending: list[BatchCount | None] = []
        self._autocast_dtype: torch.dtype | None = None
        self._started: Any = None
        self._last_mark: Any = None
        self._count = 0
        self._capturing = 0.0  # seconds the current step spent capturing: not the step's own time
        self._totals = _Totals()
        self._peaks: dict[torch.dtype, float | None] = {}
        self._optimizer_flops: int | None | bool = False  # False: not counted yet
        self._parameters: int | None = None
        if example_batch is not None:
            self.count(example_batch)  # the first family captured now, not inside the first step
            self._capturing = 0.0

    # ------------------------------------------------------------------------------ the loop's calls

    def start(self) -> None:
        """Mark the start of a step; the next step() measures from here (CUDA events on a GPU)."""
        self._started = self._mark()
        self._capturing = 0.0

    def micro_batch(self, batch: Any) -> BatchCount | None:
        """Count one forward + backward of `batch` into the current step (call once per micro-batch)."""
        self._autocast_dtype = _autocast_dtype(self.device) or self._autocast_dtype
        counted = self.count(batch)
        self._pending.append(counted)
        return counted

    def step(self, batch: Any = None, *, time: float | None = None) -> StepStats:
        """Close one optimizer step (its micro-batches, plus `batch` if given) and record it.

        `time` is the step's seconds; without it, from start() if called, else since the last step(),
        less the time this step spent capturing a new shape family."""
        if batch is not None:
            self.micro_batch(batch)
        end = self._mark()
        if time is None:
            begin = self._started if self._started is not None else self._last_mark
            time = self._elapsed(begin, end, self._capturing)
        self._started = None
        self._capturing = 0.0
        self._last_mark = end
        stats = self._close(self._pending, time)
        self._pending = []
        self.steps.append(stats)
        self._totals.add(stats)
        return stats

    # ---------------------------------------------------------------------------------- counting

    def count(self, batch: Any) -> BatchCount | None:
        """The forward + backward FLOPs of `batch` (None, warned once, if it cannot be counted)."""
        try:
            args, kwargs = _call_inputs(batch)
            tensors = tensors_in((args, kwargs))
            family = self._family(args, kwargs, tensors)
            if family is None:
                return None
            point = family.point(tensors)
            fwd, bwd, dense = family.flops(point, self, tensors)
        except Exception as error:  # noqa: BLE001 - the meter never stops training
            self.warn_once(f"fxflops.FlopsMeter: could not count a batch of {_describe(batch)}: "
                           f"{_first_line(error)}; the step is logged without FLOPs", key=type(error))
            return None
        samples = point.get("batch", tensors[0].shape[0] if tensors and tensors[0].dim() else 1)
        tokens = samples * point["seq"] if "seq" in point else None
        mask = kwargs.get("attention_mask") if isinstance(kwargs, dict) else None
        real = mask.sum() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None  # read at log time
        return BatchCount(fwd, bwd, samples, tokens, real, dense if self._effective else None)

    def _family(self, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> _Family | None:
        key = _structure(args, kwargs, tensors, self.model.training)
        family = self._families.get(key)
        if family is not None and not family.fits(tensors):
            # an axis the dims do not name changed size: that shape is a family of its own
            self.warn_once(f"fxflops.FlopsMeter: {family.misfit(tensors)}, an axis dims= does not name: each new "
                           "size there costs a capture; name it in dims= (e.g. dims={'batch': 0, 'seq': 1})",
                           key=("misfit", key))
            key = (key, tuple(tuple(t.shape) for t in tensors))
            family = self._families.get(key)
        if key in self._families:
            return family  # None: this family could not be captured, and was warned about
        self._families[key] = None  # until captured: a failure is not tried again every step
        dims = self.dims if self.dims is not None else infer_dims(args, kwargs)
        begin = time.perf_counter()
        try:
            family = _Family(self.model, to_meta((args, kwargs)), dims, self._sweep_options(kwargs))
        finally:
            self._capturing += time.perf_counter() - begin
        self.captures += family.captures
        self._families[key] = family
        return family

    def _sweep_options(self, kwargs: dict) -> dict[str, Any]:
        loss = self.loss
        if loss is None and "labels" in kwargs:
            loss = _output_loss  # the model computes its loss: the backward starts there, as training's does
        return {**self._options, "backward": True, "loss": loss}

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
            "step_time": stats.time if isinstance(stats, StepStats) else _ratio(stats.time, stats.steps),
            "samples_per_sec": stats.samples_per_sec, "tokens_per_sec": stats.tokens_per_sec,
            "6n_flops": stats.six_n_flops if isinstance(stats, StepStats) else _ratio(stats.six_n_flops, stats.steps),
            "6n_over_counted": stats.six_n_ratio,
            "dense_flops": stats.dense_flops if isinstance(stats, StepStats) else _ratio(stats.dense_flops, stats.steps),
            "dense_mfu": stats.dense_mfu,
        }
        if isinstance(stats, WindowStats):
            values["world_size"] = stats.world_size
        return {f"{prefix}{key}": value for key, value in values.items() if value is not None}

    def reduce(self, stats: StepStats | WindowStats | None = None, group: Any = None) -> WindowStats:
        """Every rank's `stats` (default: its last step) summed over the job's process group: global
        FLOPs, samples and tokens, the slowest rank's time, world size, and MFU per device.

        A collective: every rank must call it at the same step (a callback's logging step does). Outside
        torch.distributed, or in a world of one, it is the local figure and communicates nothing."""
        stats = stats if stats is not None else (self.steps[-1] if self.steps else None)
        local = summed([stats]) if isinstance(stats, StepStats) else stats
        if local is None:
            local = summed([])
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return local
        return _all_reduced(local, group)

    def summary(self) -> str:
        """The run so far in a few lines: FLOPs per step, rates, MFU, and 6N beside the count."""
        total = self.total()
        lines = [f"fxflops: {total.steps} steps, {self.captures} capture{'s' if self.captures != 1 else ''}"]
        if total.flops is not None and total.steps:
            lines.append(f"  FLOPs per step (fwd+bwd): {_si(total.flops / total.steps)}")
        for label, value, unit in (("achieved", total.flops_per_sec, "FLOP/s"), ("tokens", total.tokens_per_sec, "/s"),
                                   ("samples", total.samples_per_sec, "/s")):
            if value is not None:
                lines.append(f"  {label}: {_si(value)}{unit}")
        if total.mfu is not None:
            lines.append(f"  MFU: {total.mfu:.2%} of {_si(total.peak_flops)}FLOP/s peak")
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
            warnings.warn(message, FlopsMeterWarning, stacklevel=3)

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
            samples=sum(c.samples for c in counted), tokens=tokens,
            six_n_flops=6 * self._non_embedding_params() * tokens if tokens is not None else None,
            attention_flops=self._attention_flops(counted),
            optimizer_flops=self._optimizer_step_flops(), peak_flops=self._peak(),
            dense_flops=sum(c.dense_flops for c in counted) if whole and self._effective else None,
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
        terms = [attention_flops(self.model, c.samples, c.tokens // c.samples) for c in counted]
        return None if None in terms else sum(terms)


class _Family:
    """One shape family: its sweep, its named axes, and a compiled total per captured piece."""

    def __init__(self, model: torch.nn.Module, inputs: tuple[tuple, dict], dims: Mapping[str, Any],
                 options: dict[str, Any]) -> None:
        from fxflops.sweeps import sweep

        args, kwargs = inputs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the meter warns once itself; unknown ops stay in the sweep
            self.sweep = sweep(model, args, kwargs, dims=dims, **options)
        self.example = [tuple(t.shape) for t in tensors_in(inputs)]
        self.axes = self.sweep.plan.axes
        self._counting = self.sweep._counting  # the table and conventions its pieces were counted with
        self._effective = options.get("attention") == "effective"
        self._totals: dict[int, tuple[tuple[Callable, ...], DataMasks | None]] = {}
        self._known: dict[tuple, Any] = {}
        self.captures = len(self.sweep.pieces)

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether the tensors differ from the example only on named axes."""
        if len(tensors) != len(self.example):
            return False
        for index, (tensor, shape) in enumerate(zip(tensors, self.example)):
            named = self.axes.get(index, {})
            if tensor.dim() != len(shape):
                return False
            for axis, size in enumerate(shape):
                if axis not in named and tensor.shape[axis] != size:
                    return False
        return True

    def misfit(self, tensors: list[torch.Tensor]) -> str:
        for index, (tensor, shape) in enumerate(zip(tensors, self.example)):
            if tuple(tensor.shape) != shape:
                return f"input {index} has shape {tuple(tensor.shape)}, the family's first batch {shape}"
        return "the inputs differ in number from the family's first batch"

    def point(self, tensors: list[torch.Tensor]) -> dict[str, int]:
        point: dict[str, int] = {}
        for index, named in self.axes.items():
            shape = tensors[index].shape
            for axis, name in named.items():
                if point.setdefault(name, shape[axis]) != shape[axis]:
                    raise ValueError(f"size {name} is {point[name]} on one input and {shape[axis]} on input {index}")
        return point

    def flops(self, point: dict[str, int], meter: FlopsMeter, tensors: list[torch.Tensor]) -> tuple[Any, Any, int]:
        """(forward, backward, dense forward + backward) FLOPs at `point`. Attention ops whose masks are data
        count, in an effective reading, the masks of the batch's `tensors`: then the forward and backward
        are 0-d tensors on the masks' device, not yet read."""
        key = tuple(point.values())
        found = self._known.get(key)
        if isinstance(found, Exception):
            raise found  # a point that could not be captured: not tried again every step
        if found is None:
            before, begin = len(self.sweep.pieces), time.perf_counter()
            try:
                piece = self.sweep.piece(**point)
            except Exception as error:
                self._known[key] = error
                raise
            finally:
                meter.captures += len(self.sweep.pieces) - before
                meter._capturing += time.perf_counter() - begin
            compiled = self._totals.get(id(piece))
            if compiled is None:
                compiled = self._totals[id(piece)] = self._compile(piece, meter)
            full = self.sweep.point(point)
            found = self._known[key] = (*(function(full) for function in compiled[0]), compiled[1], full)
        fwd, bwd, dense_fwd, dense_bwd, dense, masks, full = found
        if masks is None:
            return fwd, bwd, dense
        try:
            mask_fwd, mask_bwd = masks.flops(tensors, full)
        except Exception as error:  # noqa: BLE001 - the batch counts dense there, and says so once
            meter.warn_once(f"fxflops.FlopsMeter: a data mask could not be counted on the batch "
                            f"({_first_line(error)}): those attention ops count dense", key=("data mask", type(error)))
            mask_fwd, mask_bwd = dense_fwd, dense_bwd
        return fwd + mask_fwd, bwd + mask_bwd, dense

    def _compile(self, piece: Any, meter: FlopsMeter) -> tuple[tuple[Callable, ...], DataMasks | None]:
        """The piece's totals compiled; in an effective reading, its data masks kept apart to count per batch."""
        masks = None
        if self._effective:
            masks = DataMasks(piece, self._counting.table, self._counting.conventions)
            for module, reason in masks.skipped.items():
                meter.warn_once(f"fxflops.FlopsMeter: the attention mask of {module}: {reason}; its pairs are "
                                "not counted from the batch, it counts dense", key=("data mask", module))
            masks = masks if masks.terms else None
        return _compiled_totals(piece, masks.names if masks is not None else frozenset()), masks


def _compiled_totals(piece: Any, apart: frozenset[str]) -> tuple[Callable[[Mapping[str, int]], int], ...]:
    """The piece's forward and backward FLOPs less the nodes `apart`, those nodes' dense forward and
    backward, and the dense total, each one expression compiled to a Python function: sums of the
    nodes' costs, as the Estimate's root totals are."""
    import sympy

    from fxflops.capture.dynamic import user_symbol
    from fxflops.sweeps import compile_expression

    def compiled(terms: list[Any]) -> Callable[[Mapping[str, int]], int]:
        expr = sympy.Add(*terms) if terms else sympy.Integer(0)
        function = compile_expression(expr) if isinstance(expr, sympy.Basic) else None
        if function is not None:
            return function
        return lambda point: int(sympy.sympify(expr).xreplace({user_symbol(n): v for n, v in point.items()}))

    def dense(c: Any) -> Any:
        return c.dense_flops if c.dense_flops is not None else c.flops

    costs = [c for c in piece.costs if c.flops != 0 or dense(c) != 0]
    return (compiled([c.flops for c in costs if not c.is_backward and c.name not in apart]),
            compiled([c.flops for c in costs if c.is_backward and c.name not in apart]),
            compiled([dense(c) for c in costs if not c.is_backward and c.name in apart]),
            compiled([dense(c) for c in costs if c.is_backward and c.name in apart]),
            compiled([dense(c) for c in costs]))


_FOLD = 512  # steps folded into the totals at a time


class _Totals:
    """Sums over every step (the deque keeps only the window): steps are folded in when read, so a
    step's CUDA events are read then, not as it closes."""

    def __init__(self) -> None:
        self._sums: WindowStats | None = None
        self._unread: list[StepStats] = []

    def add(self, stats: StepStats) -> None:
        self._unread.append(stats)
        if len(self._unread) >= 2 * _FOLD:  # bounded memory: the oldest steps' events are long recorded
            oldest, self._unread = summed(self._unread[:_FOLD]), self._unread[_FOLD:]
            self._sums = combined(self._sums, oldest) if self._sums else oldest

    def stats(self) -> WindowStats:
        if self._unread or self._sums is None:
            self._sums = combined(self._sums, summed(self._unread)) if self._sums else summed(self._unread)
            self._unread = []
        return self._sums


def infer_dims(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The named axes of a common batch: token inputs (batch, seq), images (batch, height, width), else batch."""
    if isinstance(kwargs, dict):
        for key in TOKEN_KEYS:
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                return {"batch": 0, "seq": 1}
        for key in IMAGE_KEYS:
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor) and value.dim() == 4:
                return {"batch": 0, "height": 2, "width": 3}
    tensors = tensors_in((args, kwargs))
    if not tensors:
        raise ValueError("the batch holds no tensor")
    first = tensors[0]
    if first.dim() == 2 and not first.is_floating_point():
        return {"batch": 0, "seq": 1}
    if first.dim() == 4 and first.is_floating_point():
        return {"batch": 0, "height": 2, "width": 3}
    if first.dim() == 0:
        raise ValueError("the first input is a scalar: give dims= naming the batch axis")
    return {"batch": 0}


def non_embedding_params(model: torch.nn.Module) -> int:
    """Parameters outside embedding tables: the N of transformers' 6·N·tokens (a lookup is no matmul)."""
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() for i, p in unique.items() if i not in embedding)


def attention_flops(model: torch.nn.Module, batch: int, seq: int) -> int | None:
    """12·L·H·Q·T per token, for batch x seq tokens: the attention matmuls' fwd+bwd that nanoGPT and
    torchtitan add to 6N (no causal halving, no GQA saving). None without a transformers-style config."""
    shape = attention_shape(model)
    if shape is None:
        return None
    layers, heads, head_dim = shape
    return 12 * layers * heads * head_dim * seq * batch * seq


def attention_shape(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """(layers, heads, head dim) from a transformers-style config, else None."""
    config = getattr(model, "config", None)
    try:
        layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None
    return layers, heads, int(head_dim)


def _output_loss(output: Any) -> Any:
    """The output's `loss`: what a transformers model given labels returns and the Trainer differentiates."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError("the batch has labels but the model's output has no loss tensor: pass loss= to the meter")
    return loss


def _call_inputs(batch: Any) -> tuple[tuple, dict]:
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], tuple) and isinstance(batch[1], dict):
        return batch  # (args, kwargs), as a forward hook sees a call
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, list | tuple):
        return tuple(batch), {}
    return (batch,), {}


def _structure(args: tuple, kwargs: dict, tensors: list[torch.Tensor], training: bool) -> tuple:
    """What a family shares: the call's arguments, tensors' ranks and dtypes, plain values, training flag."""
    plain = tuple((k, v) for k, v in kwargs.items() if isinstance(v, bool | int | float | str | type(None)))
    return (len(args), tuple(kwargs), plain, tuple((t.dim(), t.dtype) for t in tensors), training)


def summed(steps: Iterable[StepStats]) -> WindowStats:
    """Steps together: sums of FLOPs, samples, tokens, seconds (None where any step lacks one)."""
    steps = list(steps)
    flops = [s.flops for s in steps]
    times = [s.time for s in steps]
    tokens = [s.tokens for s in steps]
    six_n = [s.six_n_flops for s in steps]
    dense = [s.dense_flops for s in steps]
    peaks = {s.peak_flops for s in steps}
    return WindowStats(
        steps=len(steps),
        flops=sum(flops) if steps and None not in flops else None,
        samples=sum(s.samples for s in steps),
        tokens=sum(tokens) if steps and None not in tokens else None,
        time=sum(times) if steps and None not in times else None,
        six_n_flops=sum(six_n) if steps and None not in six_n else None,
        peak_flops=peaks.pop() if len(peaks) == 1 else None,
        dense_flops=sum(dense) if steps and None not in dense else None)


def combined(a: WindowStats, b: WindowStats) -> WindowStats:
    """Two spans of steps together."""
    def both(x: Any, y: Any) -> Any:
        return None if x is None or y is None else x + y

    return WindowStats(steps=a.steps + b.steps, flops=both(a.flops, b.flops) if b.steps else a.flops,
                       samples=a.samples + b.samples,
                       tokens=both(a.tokens, b.tokens) if b.steps else a.tokens,
                       time=both(a.time, b.time) if b.steps else a.time,
                       six_n_flops=both(a.six_n_flops, b.six_n_flops) if b.steps else a.six_n_flops,
                       peak_flops=a.peak_flops if not b.steps or a.peak_flops == b.peak_flops else None,
                       dense_flops=both(a.dense_flops, b.dense_flops) if b.steps else a.dense_flops)


def _all_reduced(local: WindowStats, group: Any) -> WindowStats:
    """Sums (FLOPs, samples, tokens, 6N, peaks, dense FLOPs) and the slowest time over the group, in two all_reduces."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    known = [local.flops, local.tokens, local.six_n_flops, local.peak_flops, local.dense_flops]
    sums = torch.tensor([float(local.samples), *(v if v is not None else 0 for v in known),
                         *(1.0 if v is None else 0.0 for v in known)], dtype=torch.float64, device=device)
    slowest = torch.tensor([local.time if local.time is not None else math.inf], dtype=torch.float64, device=device)
    dist.all_reduce(sums, group=group)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    values = sums.tolist()
    missing = values[1 + len(known):]
    flops, tokens, six_n, peak, dense = (None if missing[i] else values[1 + i] if i == 3 else int(values[1 + i])
                                         for i in range(len(known)))
    seconds = slowest.item()
    return WindowStats(steps=local.steps, flops=flops, samples=int(values[0]), tokens=tokens,
                       time=None if math.isinf(seconds) else seconds, six_n_flops=six_n, peak_flops=peak,
                       world_size=dist.get_world_size(group), dense_flops=dense)


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


def _model_device(model: torch.nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _parameter_dtype(model: torch.nn.Module) -> torch.dtype:
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.get_default_dtype()


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


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


def _first_line(error: BaseException) -> str:
    summary = getattr(error, "summary", None)
    text = summary() if callable(summary) else str(error)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
