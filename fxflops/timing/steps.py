"""Step records and windows: what the training meter records per micro-batch, per step and per span of steps.

`BatchCount` is one micro-batch's counted work, `StepStats` one optimizer step (its micro-batches and
time; rates derived on read), `WindowStats` several steps or ranks together (sums over sums); `summed`
and `combined` build windows, `Totals` keeps a whole run's in bounded memory. Counts a data mask adds
(`ReadOnUse` fields) and CUDA event times stay on the device until read. The 6N approximation and
nanoGPT's attention term, recorded beside the count, are here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


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


@dataclass(frozen=True)
class BatchCount:
    """One micro-batch's counted work: forward and backward FLOPs, samples, tokens."""

    fwd_flops: int = ReadOnUse()  # type: ignore[assignment]
    bwd_flops: int = ReadOnUse()  # type: ignore[assignment]
    samples: int
    tokens: int | None  # batch x sequence, padding included; None where the batch has no sequence axis
    real_tokens: Any = None  # attention mask's sum (an int, or a 0-d tensor not yet read), else None
    dense_flops: int | None = None  # fwd + bwd with every attention pair counted, when the reading is effective
    # rows each expert module received, read from the forward (timing.routed); None: no routed sizes
    routed_rows: dict[str, int] | None = None

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops


class _Rates:
    """Rates from a step's or a window's sums: flops, time, tokens, samples, six_n_flops, peak_flops."""

    _SHOWN = ("time", "flops_per_sec", "mfu", "samples_per_sec", "tokens_per_sec")  # derived, in the repr too

    def __repr__(self) -> str:
        """The recorded fields, then the rates derived from them (those not known are left out)."""
        fields = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.repr]
        derived = [(name, getattr(self, name)) for name in self._SHOWN if name not in dict(fields)]
        shown = ", ".join(f"{name}={value!r}" for name, value in fields + derived if value is not None)
        return f"{type(self).__name__}({shown})"

    @property
    def flops_per_sec(self) -> float | None:
        return ratio(self.flops, self.time)

    @property
    def tflops(self) -> float | None:
        rate = self.flops_per_sec
        return None if rate is None else rate / 1e12

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilization: achieved FLOP/s over the dense peak for the compute dtype (for a window
        across ranks: all devices' FLOP/s over all devices' peak, i.e. per device)."""
        return ratio(self.flops_per_sec, self.peak_flops)

    @property
    def dense_mfu(self) -> float | None:
        """MFU of the dense count (every attention pair), beside an effective reading's."""
        return ratio(ratio(self.dense_flops, self.time), self.peak_flops)

    @property
    def tokens_per_sec(self) -> float | None:
        return ratio(self.tokens, self.time)

    @property
    def samples_per_sec(self) -> float | None:
        return ratio(self.samples, self.time)

    @property
    def six_n_ratio(self) -> float | None:
        """6N / counted FLOPs: above 1, 6N overstated the work; below 1, it left some out."""
        return ratio(self.six_n_flops, self.flops)


@dataclass(repr=False)
class StepStats(_Rates):
    """One optimizer step: the sum of its micro-batches, and its time. Rates are derived on read."""

    step: int
    micro_batches: int
    fwd_flops: int | None = ReadOnUse()  # type: ignore[assignment]  # None: some micro-batch was not counted
    bwd_flops: int | None = ReadOnUse()  # type: ignore[assignment]
    samples: int | None  # None: some micro-batch was not counted (its samples are not known either)
    tokens: int | None
    six_n_flops: int | None  # 6 x non-embedding params x tokens, transformers' total_flos per step
    attention_flops: int | None  # 12 x layers x heads x head dim x seq x tokens (6N + this: nanoGPT's, torchtitan's)
    optimizer_flops: int | None  # the optimizer step's FLOPs, not in `flops`
    peak_flops: float | None  # per device, for the compute dtype
    dense_flops: int | None = None  # fwd + bwd with every attention pair counted (attention="effective" only)
    # rows each expert module received over the step, as its forwards routed them (measured, not assumed);
    # None where the model routes nothing
    routed_rows: dict[str, int] | None = None
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



@dataclass(frozen=True, repr=False)
class WindowStats(_Rates):
    """Sums over several steps (a window, a whole run, or every rank's step); rates are sums over sums.
    Its repr shows the rates (flops_per_sec, mfu, ...) beside the sums."""

    steps: int
    flops: int | None
    samples: int | None
    tokens: int | None
    time: float | None  # the seconds the steps took (across ranks: the slowest rank's)
    six_n_flops: int | None
    peak_flops: float | None  # of all the devices the FLOPs ran on together
    world_size: int = 1
    dense_flops: int | None = None  # with every attention pair counted (attention="effective" only)
    # how a job's figures were formed from the ranks' (None: one rank's own): JOB_SUMMED, every rank's local
    # count all-reduced, or JOB_SCALED, this rank's local count x world size (no collective)
    job_total: str | None = None

    @property
    def flops_per_step(self) -> float | None:
        return ratio(self.flops, self.steps)



JOB_SUMMED = "sum over ranks"  # every rank's local count, all-reduced
JOB_SCALED = "local x world"  # this rank's local count times the world size: ranks assumed to run the same ops


def scaled(local: WindowStats, world: int) -> WindowStats:
    """A job's figures as `world` ranks each doing what this rank did (no collective): sums x world, the
    same time, the peak of `world` devices, so MFU per device is this rank's."""
    def times(value: Any) -> Any:
        return None if value is None else value * world

    return WindowStats(steps=local.steps, flops=times(local.flops), samples=times(local.samples),
                       tokens=times(local.tokens), time=local.time, six_n_flops=times(local.six_n_flops),
                       peak_flops=times(local.peak_flops), world_size=world, dense_flops=times(local.dense_flops),
                       job_total=JOB_SCALED)


_FOLD = 512  # steps folded into the totals at a time


class Totals:
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


def summed(steps: Iterable[StepStats]) -> WindowStats:
    """Steps together: sums of FLOPs, samples, tokens, seconds (None where any step lacks one)."""
    steps = list(steps)
    flops = [s.flops for s in steps]
    times = [s.time for s in steps]
    tokens = [s.tokens for s in steps]
    six_n = [s.six_n_flops for s in steps]
    samples = [s.samples for s in steps]
    dense = [s.dense_flops for s in steps]
    peaks = {s.peak_flops for s in steps}
    return WindowStats(
        steps=len(steps),
        flops=sum(flops) if steps and None not in flops else None,
        samples=sum(samples) if steps and None not in samples else None,
        tokens=sum(tokens) if steps and None not in tokens else None,
        time=sum(times) if steps and None not in times else None,
        six_n_flops=sum(six_n) if steps and None not in six_n else None,
        peak_flops=peaks.pop() if len(peaks) == 1 else None,
        dense_flops=sum(dense) if steps and None not in dense else None)


def combined(a: WindowStats, b: WindowStats, job_total: str | None = None) -> WindowStats:
    """Two spans of steps together (`job_total`: how both were formed from the ranks', if they were)."""
    def both(x: Any, y: Any) -> Any:
        return None if x is None or y is None else x + y

    return WindowStats(steps=a.steps + b.steps, flops=both(a.flops, b.flops) if b.steps else a.flops,
                       samples=both(a.samples, b.samples) if b.steps else a.samples,
                       tokens=both(a.tokens, b.tokens) if b.steps else a.tokens,
                       time=both(a.time, b.time) if b.steps else a.time,
                       six_n_flops=both(a.six_n_flops, b.six_n_flops) if b.steps else a.six_n_flops,
                       peak_flops=a.peak_flops if not b.steps or a.peak_flops == b.peak_flops else None,
                       dense_flops=both(a.dense_flops, b.dense_flops) if b.steps else a.dense_flops,
                       world_size=a.world_size, job_total=job_total)


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


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator
