"""Predicted latency without a GPU: each op's roofline time, summed per module.

An op takes max(flops / peak, bytes / bandwidth): it is bound by its arithmetic or by its memory
traffic, whichever is slower (`fxflops.traffic` gives the bytes). Ops with MACs (matmuls, convs,
attention) run at the device's dense peak for the dtype — tf32 for fp32 when PyTorch allows it, as
`peaks.peak_for` decides; ops without MACs (elementwise, norms, reductions) at its plain fp32 rate
(or fp64), since they do not run on tensor cores. Given `peak_flops`, every op uses that one peak.

A module's predicted latency is the sum of its ops' times; it is memory-bound when most of that time
is spent in memory-bound ops. The model is the module "". The prediction assumes unfused kernels
and no launch overhead: fusion moves fewer bytes, tiny ops take longer than their roofline.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from fxflops.device import peaks
from fxflops.results import Estimate, NodeCost
from fxflops.tree import module_sums

COMPUTE, MEMORY = "compute", "memory"


@dataclass(frozen=True)
class ModulePrediction:
    """One module's roofline: inclusive of its submodules, like ModuleStats."""

    name: str
    latency: float  # seconds: the sum of its ops' max(flops / peak, bytes / bandwidth)
    memory_bound_latency: float  # the part of latency spent in ops bound by memory
    self_memory_bound_latency: float  # the part of that its own ops (not its submodules') spend
    flops: int
    bytes: int

    @property
    def bound(self) -> str:
        """"memory" when most of its time is in memory-bound ops, else "compute"."""
        return MEMORY if self.memory_bound_latency * 2 > self.latency else COMPUTE

    @property
    def intensity(self) -> float | None:
        """FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else None

    @property
    def achieved_flops(self) -> float | None:
        """The FLOP/s the prediction implies."""
        return self.flops / self.latency if self.latency else None


@dataclass(frozen=True)
class Prediction:
    """Estimate.predict()'s result: the roofline latency of every module on one device."""

    device: str  # the table's name for it, or "given" when peak_flops and bandwidth were passed
    dtype: str  # the peak's dtype key: "bf16", "tf32", "fp32", ...
    peak_flops: float  # FLOP/s of ops with MACs
    vector_flops: float  # FLOP/s of ops without MACs
    bandwidth: float  # bytes/s
    modules: dict[str, ModulePrediction]  # qualified name -> prediction, the estimate's order
    source: str = ""  # where the peaks come from

    @property
    def latency(self) -> float:
        """The whole model's predicted latency, in seconds."""
        return self.modules[""].latency

    @property
    def bound(self) -> str:
        return self.modules[""].bound

    @property
    def intensity(self) -> float | None:
        return self.modules[""].intensity

    @property
    def ridge(self) -> float:
        """The intensity (FLOPs per byte) above which an op is compute-bound on this device."""
        return self.peak_flops / self.bandwidth

    @property
    def memory_bound_share(self) -> float:
        """The share of the predicted time spent in memory-bound ops."""
        root = self.modules[""]
        return root.memory_bound_latency / root.latency if root.latency else 0.0

    def top_memory_bound(self, count: int = 5) -> list[ModulePrediction]:
        """The modules that own the most memory-bound time themselves, most first (leaves before parents)."""
        ranked = sorted((m for m in self.modules.values() if m.name and m.self_memory_bound_latency > 0),
                        key=lambda m: -m.self_memory_bound_latency)
        return ranked[:count]


def predict(estimate: Estimate, device: str | None = None, *, dtype: torch.dtype | str | None = None,
            peak_flops: float | None = None, bandwidth: float | None = None) -> Prediction:
    """The roofline prediction of `estimate` on `device` (a name from fxflops.device.peaks, e.g. "H100 SXM";
    default: the current CUDA device), or on the given `peak_flops` (FLOP/s) and `bandwidth` (bytes/s)."""
    peak, vector, memory, label, key, source = _device_numbers(estimate, device, dtype, peak_flops, bandwidth)

    def times(node: NodeCost) -> tuple[float, float]:
        return node.flops / (peak if node.macs else vector), node.bytes / memory

    def latency_of(node: NodeCost) -> float:
        return max(times(node))

    def memory_bound_of(node: NodeCost) -> float:
        compute_time, memory_time = times(node)
        return memory_time if memory_time > compute_time else 0.0

    _, latency = module_sums(estimate.nodes, latency_of, estimate.aliases, estimate.modules)
    own_memory_bound, memory_bound = module_sums(estimate.nodes, memory_bound_of, estimate.aliases, estimate.modules)
    modules = {
        name: ModulePrediction(name, latency[name], memory_bound[name], own_memory_bound[name], stats.flops,
                               stats.bytes)
        for name, stats in estimate.modules.items()
    }
    return Prediction(label, key, peak, vector, memory, modules, source)


def _device_numbers(estimate: Estimate, device: str | None, dtype: torch.dtype | str | None,
                    peak_flops: float | None, bandwidth: float | None) -> tuple:
    """(matrix peak, vector peak, bandwidth, device label, dtype key, source)."""
    compute_dtype = _dtype(dtype if dtype is not None else estimate.dtype)
    if device is None and peak_flops is not None and bandwidth is not None:
        _check_positive(peak_flops=peak_flops, bandwidth=bandwidth)
        key = peaks.dtype_key(compute_dtype) or str(compute_dtype)
        return peak_flops, peak_flops, bandwidth, "given", key, "given: peak_flops and bandwidth"
    if device is None and (peak_flops is None) != (bandwidth is None) and not torch.cuda.is_available():
        missing = "bandwidth= (bytes/s)" if bandwidth is None else "peak_flops= (FLOP/s)"
        raise ValueError(f"predict() without a device needs both peak_flops= and bandwidth=: give {missing} "
                         "too, or name a device to take it from (device=\"H100 SXM\")")
    row = _row(device)
    key = peaks.dtype_key(compute_dtype, tf32=peaks.tf32_enabled())
    if key == "tf32" and key not in row.flops:
        key = "fp32"
    if peak_flops is None and (key is None or key not in row.flops):
        raise ValueError(f"the peaks table has no {compute_dtype} rate for {row.label} "
                         f"(it has {', '.join(row.flops)}); pass dtype= or peak_flops=")
    vector_key = "fp64" if key == "fp64" else "fp32"
    matrix = peak_flops if peak_flops is not None else row.flops[key]
    vector = peak_flops if peak_flops is not None else row.vector.get(vector_key, row.flops.get(vector_key, matrix))
    memory = bandwidth if bandwidth is not None else row.bandwidth
    _check_positive(peak_flops=matrix, bandwidth=memory)
    return matrix, vector, memory, row.label, key or str(compute_dtype), _source(row, peak_flops, bandwidth)


def _source(row: peaks.GpuPeaks, peak_flops: float | None, bandwidth: float | None) -> str:
    """Which numbers the user gave and which the table did: a given number is not the datasheet's."""
    given = [name for name, value in (("peak_flops", peak_flops), ("bandwidth", bandwidth)) if value is not None]
    taken = [name for name, value in (("peaks", peak_flops), ("bandwidth", bandwidth)) if value is None]
    table = f"table: {row.label} ({row.source})"
    if not given:
        return table
    if not taken:
        return f"given: peak_flops and bandwidth (device {row.label})"
    return f"given: {given[0]}; {table} for its {taken[0]}"


def _row(device: str | None) -> peaks.GpuPeaks:
    if device is not None:
        return peaks.named(device)
    if not torch.cuda.is_available():
        raise ValueError("predict() needs a device: name one from the peaks table (device=\"H100 SXM\"; "
                         f"known: {known_devices()}), or give peak_flops= and bandwidth=")
    row = peaks.lookup(torch.cuda.get_device_name())
    if row is None:
        raise ValueError(f"the peaks table does not know this GPU ({torch.cuda.get_device_name()!r}): "
                         f"name a device (known: {known_devices()}), or give peak_flops= and bandwidth=")
    return row


def known_devices() -> str:
    return ", ".join(row.label for row in peaks.GPU_PEAKS)


def _dtype(value: torch.dtype | str | None) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value is None:
        return torch.float32
    found = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype {value!r}; use a torch.dtype such as torch.bfloat16")
    return found


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        # True is an int to Python and inf compares > 0: neither is a rate (inf predicts 0 s)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
            unit = "FLOP/s" if name == "peak_flops" else "bytes/s"
            raise ValueError(f"{name} must be positive and finite ({unit}), got {value!r}")
