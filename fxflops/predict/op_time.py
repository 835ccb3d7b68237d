"""Time per op on a device: the roofline made realistic, from each op's counted FLOPs, bytes and shapes.

An op takes `max(flops / (peak x efficiency), bytes / (bandwidth x sustained)) + launch overhead`:

- GEMMs (ops with MACs: linear, mm, bmm, matmul, einsum, conv as an implicit GEMM) run at the device's
  tensor-core peak for the dtype times `DeviceModel.gemm_fraction(M, N, K)`: the large-GEMM plateau, tile and
  wave quantization, the alignment of K and N, the calibrated size correction. M, N, K come from the output
  shape and the MACs (K = MACs / output elements), so every rule's GEMM is read the same way.
- grouped GEMMs (MoE experts, `_grouped_mm`) as one GEMM of a group's shape, times `grouped_gemm_efficiency`.
- attention kernels (SDPA, flash/efficient attention, forward and backward) at the attention curve's
  fraction for their query length and head dimension; with a causal mask, of the FLOPs of the kept pairs.
- everything else (elementwise, norms, reductions, copies) at the vector rate or the sustained bandwidth.
- zero-cost ops that move no data (views, metadata), collective calls (timed by `comm_time`) and unknown
  ops without bytes take 0 s and launch nothing.

The prediction is a model with a stated error, not a measurement: see docs/guide/time.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fxflops.predict.hardware import DeviceModel, device_model
from fxflops.results.captured import BACKWARD, FORWARD, RECOMPUTE
from fxflops.results.costs import UNKNOWN, ZERO, NodeCost

GEMM, GROUPED_GEMM, ATTENTION, MEMORY, NONE = "gemm", "grouped_gemm", "attention", "elementwise", "none"
_COLLECTIVE_RULES = ("collective", "collective wait")  # rules/collectives.toml: timed by comm_time instead
_ELEMENT_BYTES = {"fp64": 8, "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
_DTYPE_KEYS = {"float64": "fp64", "double": "fp64", "float32": "fp32", "float": "fp32", "bfloat16": "bf16",
               "float16": "fp16", "half": "fp16", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


@dataclass(frozen=True)
class OpTime:
    """How one op's time came out: its class, the two roofline terms and the efficiency used."""

    kind: str  # GEMM | GROUPED_GEMM | ATTENTION | MEMORY | NONE
    seconds: float  # max(compute, memory) + overhead
    compute: float  # flops / (peak x efficiency)
    memory: float  # bytes / sustained bandwidth
    overhead: float  # launch overhead (0 for ops that launch nothing)
    efficiency: float  # the fraction of peak used for the compute term (1.0 for vector work)

    @property
    def bound(self) -> str:
        return "compute" if self.compute >= self.memory else "memory"


def dtype_key(dtype: Any) -> str:
    """"bf16" for torch.bfloat16, "bfloat16", "torch.bfloat16" or "bf16"; a one-line error otherwise."""
    text = str(dtype).removeprefix("torch.")
    if text in _ELEMENT_BYTES:
        return text
    if text in _DTYPE_KEYS:
        return _DTYPE_KEYS[text]
    raise ValueError(f"unknown dtype {dtype!r}: use a torch dtype (torch.bfloat16) or one of "
                     f"{', '.join(_ELEMENT_BYTES)}")


def op_kind(node: NodeCost) -> str:
    """Which time model an op takes (see the module's docstring)."""
    if node.rule in _COLLECTIVE_RULES:
        return NONE
    op = node.op.lower()
    if node.attention is not None or "attention" in op:
        return ATTENTION
    if node.macs:
        return GROUPED_GEMM if "grouped_mm" in op else GEMM
    if node.status == ZERO and not node.bytes:
        return NONE
    if not node.flops and not node.bytes:
        return NONE
    return MEMORY


def gemm_shape(node: NodeCost) -> tuple[int, int, int, int]:
    """(M, N, K, groups) of a GEMM-like op from its output shape and MACs: N is the output's last dim (a
    conv's channel dim), M the rest of its elements, K = MACs / output elements. A grouped GEMM's groups
    come from its second input's leading dim (the experts' stacked weights)."""
    out = node.output_shapes[0] if node.output_shapes else ()
    numel = math.prod(out) if out else 1
    if "conv" in node.op.lower() and len(out) >= 3:
        n = out[1]
    else:
        n = out[-1] if out else 1
    m = max(numel // max(n, 1), 1)
    k = max(round(node.macs / max(numel, 1)), 1)
    groups = 1
    if "grouped_mm" in node.op.lower() and len(node.input_shapes) > 1 and len(node.input_shapes[1]) == 3:
        groups = node.input_shapes[1][0]
        m = max(m // groups, 1)  # rows are split among the groups (tokens routed to experts)
    return m, n, k, groups


def _attention_shape(node: NodeCost) -> tuple[int, int, bool]:
    """(query length, head dim, banded) of an attention op. Its first input is (B, H, L, E), or (B, L, H, E)
    for the flash/efficient kernels' own ops. Banded: a causal or sliding-window mask, which flash kernels
    apply by skipping blocks (any other mask is applied to every block)."""
    from fxflops.rules.kept_pairs import CAUSAL, SEQ_FIRST

    query = node.input_shapes[0] if node.input_shapes else ()
    seq_axis = -3 if node.op.startswith(SEQ_FIRST) else -2
    seq = query[seq_axis] if len(query) >= -seq_axis else 1
    head_dim = query[-1] if query else 128
    pattern = node.attention or ""
    banded = pattern.startswith(CAUSAL) or pattern.startswith("sliding window")
    return seq, head_dim, banded


def op_time(node: NodeCost, device: DeviceModel | str, dtype: Any) -> OpTime:
    """The time of one op, with how it came out."""
    device = device_model(device)
    key = dtype_key(dtype)
    kind = op_kind(node)
    if kind == NONE:
        return OpTime(NONE, 0.0, 0.0, 0.0, 0.0, 1.0)
    memory = node.bytes / device.sustained if node.bytes else 0.0
    flops = node.flops
    if kind == GEMM or kind == GROUPED_GEMM:
        m, n, k, groups = gemm_shape(node)
        efficiency = device.gemm_fraction(m, n, k, _ELEMENT_BYTES[key], groups)
        if kind == GROUPED_GEMM:
            efficiency *= device.grouped_gemm_efficiency
        compute = flops / (device.peak(key) * efficiency)
    elif kind == ATTENTION:
        seq, head_dim, causal = _attention_shape(node)
        if causal and node.effective_flops is not None:
            flops = node.effective_flops  # a flash kernel skips the blocks a band mask drops
        efficiency = device.attention_fraction(seq, head_dim, backward=_is_backward_op(node),
                                               causal=causal)
        compute = flops / (device.peak(key) * efficiency)
    else:
        efficiency = 1.0
        compute = flops / device.vector_peak(key) if flops else 0.0
    overhead = device.launch_overhead
    return OpTime(kind, max(compute, memory) + overhead, compute, memory, overhead, efficiency)


def _is_backward_op(node: NodeCost) -> bool:
    """An attention op of the backward pass proper (a recomputed forward runs the forward kernel)."""
    return node.phase == BACKWARD or "backward" in node.op.lower()


def node_seconds(node: NodeCost, device: DeviceModel | str, dtype: Any) -> float:
    """Predicted seconds of one op on `device` computing in `dtype` (see the module's docstring)."""
    return op_time(node, device, dtype).seconds


def estimate_seconds(est: Any, device: DeviceModel | str, dtype: Any = None) -> dict[str, Any]:
    """Predicted compute time of an Estimate's ops (one rank's step as counted), summed.

    Returns {"total": s, "phases": {"forward": s, "backward": s, "recompute": s},
    "modules": {qualified name: {phase: s}} (each op at its innermost module, "" = the model),
    "inclusive": {qualified name: {phase: s}} (a module with everything under it; "" is the total),
    "kinds": {op kind: s}, "ops": number of ops timed, "unknown": ops no rule counts that were timed by
    their bytes alone (their FLOPs are not known), "device": name, "dtype": key}. Collective calls
    are not in it (comm_time times them). `dtype`: the compute dtype; default the estimate's own."""
    device = device_model(device)
    key = dtype_key(dtype if dtype is not None else (getattr(est, "dtype", None) or "float32"))
    return sum_seconds(est.nodes, device, key)


def sum_seconds(nodes: Iterable[NodeCost], device: DeviceModel, key: str) -> dict[str, Any]:
    """estimate_seconds() over any iterable of NodeCost."""
    phases = {FORWARD: 0.0, BACKWARD: 0.0, RECOMPUTE: 0.0}
    modules: dict[str, dict[str, float]] = {}
    kinds: dict[str, float] = {}
    timed = unknown = 0
    for node in nodes:
        timing = op_time(node, device, key)
        if timing.kind == NONE:
            continue
        timed += 1
        unknown += node.status == UNKNOWN
        phases[node.phase] = phases.get(node.phase, 0.0) + timing.seconds
        per_module = modules.setdefault(node.module, {})
        per_module[node.phase] = per_module.get(node.phase, 0.0) + timing.seconds
        kinds[timing.kind] = kinds.get(timing.kind, 0.0) + timing.seconds
    inclusive: dict[str, dict[str, float]] = {}
    for name, per_phase in modules.items():
        for owner in _owners(name):
            into = inclusive.setdefault(owner, {})
            for phase, seconds in per_phase.items():
                into[phase] = into.get(phase, 0.0) + seconds
    return {"total": sum(phases.values()), "phases": phases, "modules": modules, "inclusive": inclusive,
            "kinds": kinds, "ops": timed, "unknown": unknown, "device": device.name, "dtype": key}


def _owners(name: str) -> list[str]:
    """The module and every module above it, by qualified name: "a.b.c" -> "", "a", "a.b", "a.b.c"."""
    parts = name.split(".") if name else []
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def stream_seconds(nbytes: float, device: DeviceModel | str, kernels: int = 1) -> float:
    """Seconds to stream `nbytes` through memory in `kernels` memory-bound kernels (an optimizer step,
    a gradient copy): bytes / sustained bandwidth plus one launch overhead each."""
    device = device_model(device)
    return nbytes / device.sustained + kernels * device.launch_overhead
