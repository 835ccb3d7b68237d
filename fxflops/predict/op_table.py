"""A measured op table (what `benchmarks/gpu_check.py` writes): each row as the op fxflops counts, the time
model's prediction for it, and a device's constants fitted from it.

A row is `{"kind": "gemm" | "memory" | "attention", "op": ..., "shape": [...], "dtype": ..., "seconds": ...}`
(an attention row: `backend` "flash" | "cudnn" | "math", `causal`, `forward_seconds`, `backward_seconds`);
`graph_seconds` where measured: the op replayed back to back from a CUDA graph, the host's launch cost out.
Each row is turned into the NodeCost the capture gives that op (an estimate of the op alone, on the meta
device), so a prediction for a row is `op_time` of exactly what a model's count holds.

`fit_device(table, base)` fits, besides what `calibrate` fits from profile pairs (launch overhead, sustained
bandwidth, the GEMM size correction), the GEMM alignment factors and the attention curves of each kernel
(flash, cuDNN, unfused math) and each memory-bound kernel class's bandwidth from the rows it is given: the caller
chooses which rows fit and which validate.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from fxflops.predict.hardware import DeviceModel, device_model, interpolate, with_constant
from fxflops.predict.op_time import ATTENTION, GEMM, MEMORY, ROW_CLASSES, Kernels, _math_attention_time, \
    attention_dims, dtype_key, gemm_shape, memory_class, node_times, op_kind, op_time
from fxflops.results.captured import BACKWARD, FORWARD
from fxflops.results.costs import NodeCost

DTYPE = "bfloat16"
MEMORY_FIT_BYTES = 64 * 2**20  # memory-bound rows moving more than this fit the bandwidth (past a 60 MB L2)
TINY_BYTES = 64 * 1024


@dataclass(frozen=True)
class Row:
    """One measured op: what ran, the node fxflops counts for it, and its measured seconds."""

    label: str  # "mm 4096x4096x4096", "flash attention forward (4, 16, 4096, 128) causal", ...
    kind: str  # GEMM | MEMORY | ATTENTION (op_time's classes)
    nodes: tuple[NodeCost, ...]  # what fxflops counts for it: one op, or the ops it decomposes into (rms_norm)
    seconds: float  # the time the model predicts: device time (graph replay where measured, else events)
    kernel: str = "flash"  # attention rows: the kernel that ran ("flash", "cudnn", "math")
    source: dict = None  # type: ignore[assignment]  # the table's row
    # seconds from a CUDA graph's back-to-back replay (the host's launch out); False: CUDA events around calls
    # launched one by one from Python, whose small ops carry the host's dispatch (~5 us)
    graphed: bool = True

    @property
    def node(self) -> NodeCost:
        return self.nodes[0]

    @property
    def single(self) -> bool:
        """Counted as one op: only such rows fit a constant (a decomposed op's kernel is not its ops')."""
        return len(self.nodes) == 1


# ------------------------------------------------------------------------------------- rows as nodes


def _ops() -> dict[str, Callable[..., Any]]:
    import torch
    import torch.nn.functional as F

    return {
        "mm": torch.mm,
        "linear": F.linear,
        "layer_norm": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
        "rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w),
        "gelu": F.gelu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "silu": F.silu,
        "softmax": lambda x: torch.softmax(x, -1),
        "add": lambda x: x + x,
        "mul": lambda x, w: x * w,
        "embedding": F.embedding,
    }


def _inputs(op: str, shape: list[int]) -> tuple[Any, ...]:
    import torch

    meta = {"device": "meta", "dtype": torch.bfloat16}
    if op == "mm":
        m, n, k = shape
        return torch.empty(m, k, **meta), torch.empty(k, n, **meta)
    if op == "linear":
        m, n, k = shape
        return torch.empty(m, k, **meta), torch.empty(n, k, **meta)
    if op == "embedding":
        tokens, vocab, width = shape
        return torch.empty(tokens, device="meta", dtype=torch.long), torch.empty(vocab, width, **meta)
    x = torch.empty(*shape, **meta)
    width = shape[-1]
    if op == "layer_norm":
        return x, torch.empty(width, **meta), torch.empty(width, **meta)
    if op in ("rms_norm", "mul"):
        return x, torch.empty(width, **meta)
    return (x,)


def _one_op(fn: Callable[..., Any]) -> Any:
    """A module whose forward is `fn` alone (what estimate() is given)."""
    from torch import nn

    class Op(nn.Module):
        def forward(self, *inputs: Any) -> Any:
            return fn(*inputs)

    return Op()


@cache
def op_nodes(op: str, shape: tuple[int, ...]) -> tuple[NodeCost, ...]:
    """The nodes fxflops counts for one GEMM or memory-bound op of the table (the op alone, on meta): one,
    or the ops a composite decomposes into (rms_norm: pow, mean, add, rsqrt, mul...)."""
    import fxflops

    if op not in _ops():
        raise ValueError(f"op table: no known op {op!r} (known: {', '.join(_ops())})")
    est = fxflops.estimate(_one_op(_ops()[op]), _inputs(op, list(shape)), conventions="torch")
    nodes = tuple(node for node in est.nodes if op_kind(node) != "none")
    if not nodes:
        raise ValueError(f"op table: {op} {list(shape)} counts no timed op")
    return nodes


@cache
def attention_nodes(shape: tuple[int, int, int, int], causal: bool) -> tuple[NodeCost, NodeCost]:
    """(forward, backward) nodes of SDPA on (batch, heads, seq, head dim) bf16 inputs."""
    import torch
    import torch.nn.functional as F

    import fxflops

    q, k, v = (torch.empty(*shape, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    est = fxflops.estimate(_one_op(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
                           (q, k, v), conventions="torch", backward=True)
    forward = [n for n in est.nodes if op_kind(n) == ATTENTION and n.phase == FORWARD]
    backward = [n for n in est.nodes if op_kind(n) == ATTENTION and n.phase == BACKWARD]
    if len(forward) != 1 or len(backward) != 1:
        raise ValueError(f"op table: SDPA {shape} counts {len(forward)} forward and {len(backward)} backward "
                         f"attention ops, not one each")
    return forward[0], backward[0]


def rows(table: Mapping[str, Any], parts: Iterable[str] | None = None) -> list[Row]:
    """The table's rows (of `parts`: "gemm", "gemm_grid", "gemm_alignment", "memory", "attention"), each with
    its node. Memory rows of a backward op, and rows without a time, are left out (the backward of an op
    alone is timed with the autograd engine's own host work in it)."""
    ops = table.get("ops", table)
    out: list[Row] = []
    for part in parts or [p for p in ops if isinstance(ops[p], list)]:
        for entry in ops.get(part, []):
            if not isinstance(entry, dict) or entry.get("error") or entry.get("dtype", DTYPE) != DTYPE \
                    or entry.get("kind") not in ("gemm", "memory", "attention"):  # an optimizer step is not one op
                continue
            if entry["kind"] == "attention":
                out += _attention_rows(entry)
            elif not entry["op"].endswith("_backward"):
                nodes = op_nodes(entry["op"], tuple(entry["shape"]))
                graph = entry.get("graph_seconds")
                seconds = graph if isinstance(graph, (int, float)) else entry["seconds"]
                label = f"{entry['op']} {'x'.join(map(str, entry['shape']))}"
                kind = op_kind(nodes[0]) if len(nodes) == 1 else MEMORY
                out.append(Row(label, kind, nodes, float(seconds), source=entry,
                               graphed=isinstance(graph, (int, float))))
    return out


def _attention_rows(entry: dict) -> list[Row]:
    shape = tuple(entry["shape"])
    forward, backward = attention_nodes(shape, bool(entry["causal"]))
    name = f"{entry['backend']} attention {tuple(shape)}{' causal' if entry['causal'] else ''}"
    return [Row(f"{name} forward", ATTENTION, (forward,), float(entry["forward_seconds"]), entry["backend"], entry,
                graphed=False),
            Row(f"{name} backward", ATTENTION, (backward,), float(entry["backward_seconds"]), entry["backend"],
                entry, graphed=False)]


# ------------------------------------------------------------------------------------------ predictions


def predicted(row: Row, device: DeviceModel | str) -> float:
    """The time model's seconds for a row, with the kernel the row ran (attention) as the run's software."""
    return sum(t.seconds for t in node_times(row.nodes, device, DTYPE, Kernels(attention=row.kernel)))


def roofline(row: Row, device: DeviceModel | str) -> float:
    """The plain roofline: FLOPs at the datasheet peak or bytes at the datasheet bandwidth, whichever is
    longer (no efficiency, no launch)."""
    device = device_model(device)
    peak = device.peak(dtype_key(DTYPE)) if row.node.macs or row.kind == ATTENTION else device.vector_peak("bf16")
    return sum(max(node.flops / peak, node.bytes / device.hbm_bandwidth) for node in row.nodes)


# ----------------------------------------------------------------------------------------------- fitting


def fit_device(fit_rows: list[Row], base: DeviceModel | str, label: str) -> tuple[DeviceModel, dict[str, tuple]]:
    """`base` with every constant the rows show fitted to them: (device, {name: (value, source)}). The
    order matters: the launch overhead first (tiny ops), the bandwidth and each kernel class's (large
    memory-bound ops), the GEMM size correction (GEMMs whose K and N rows are 128-byte aligned), the
    alignment factors (the others, over the size-corrected model), then each attention kernel's curves."""
    device = device_model(base)
    fitted: dict[str, tuple] = {}
    fit_rows = [row for row in fit_rows if row.single]

    def take(name: str, value: Any, source: str) -> None:
        nonlocal device
        fitted[name] = (value, source)
        device = with_constant(device, name, value, source)

    # only graph replays: a tiny op launched alone from Python is timed at the host's dispatch, not the launch
    # gap among back-to-back kernels the constant is (where the table has none, the base's stays)
    tiny = [r.seconds for r in fit_rows if r.kind == MEMORY and r.node.bytes <= TINY_BYTES and r.graphed]
    if tiny:
        take("launch_overhead", round(statistics.median(tiny), 9),
             f"median device time of {len(tiny)} ops moving <= 64 KiB, back to back from a CUDA graph, {label}")
    large = [r for r in fit_rows if r.kind == MEMORY and r.node.bytes >= MEMORY_FIT_BYTES]
    rates = [r.node.bytes / (r.seconds - device.launch_overhead) for r in large if r.seconds > device.launch_overhead]
    if rates:
        take("sustained_bandwidth", round(min(statistics.median(rates) / device.hbm_bandwidth, 1.0), 4),
             f"median of {len(rates)} memory-bound ops moving >= 64 MiB (bytes as fxflops counts them over the "
             f"measured time), {label}")
    for name, value, source in _class_curves(fit_rows, device, label):
        take(name, value, source)
    gemms = [r for r in fit_rows if r.kind == GEMM]
    # only compute-bound GEMMs fit (a memory-bound one's time says nothing of the GEMM's efficiency): the counts
    # cited are of those used
    aligned = [r for r in gemms if _alignment(r) >= 128 and _compute_ratio(r, device) is not None]
    curve = _size_correction(aligned, device)
    if curve:
        take("gemm_size_correction", curve, f"measured / modelled efficiency of {len(aligned)} GEMMs whose K and "
                                            f"N rows are 128-byte aligned, median per octave of (MNK)^(1/3), {label}")
    gemms = [r for r in gemms if _compute_ratio(r, device) is not None]
    factors = _alignment_factors(gemms, device)
    if factors:
        take("gemm_alignment", factors, f"measured / modelled efficiency of {len(gemms)} GEMMs by the largest "
                                        f"alignment (bytes) dividing K's and N's rows, median each, {label}")
    for name, value, source in _attention_curves(fit_rows, device, label):
        take(name, value, source)
    return device, fitted


def _class_curves(fit_rows: list[Row], device: DeviceModel, label: str) -> list[tuple[str, Any, str]]:
    """Each memory-bound kernel class's bandwidth curve (op_time.memory_class) from its large ops (moving >= 64
    MiB: past the L2): bytes / (time - launch) over hbm_bandwidth, the median per row length (normalization,
    softmax) or per octave of bytes moved (the others). A class without such ops keeps the base's curve."""
    out = []
    by_class: dict[str, dict[float, list[float]]] = {}
    for row in fit_rows:
        if row.kind != MEMORY or row.node.bytes < MEMORY_FIT_BYTES or row.seconds <= device.launch_overhead:
            continue
        kind, size = memory_class(row.node)
        x = float(size) if kind in ROW_CLASSES else float(2 ** round(math.log2(size)))
        fraction = row.node.bytes / (row.seconds - device.launch_overhead) / device.hbm_bandwidth
        by_class.setdefault(kind, {}).setdefault(x, []).append(fraction)
    for kind, points in by_class.items():
        ops = sorted({row.label.split(" ")[0] for row in fit_rows if row.kind == MEMORY
                      and row.node.bytes >= MEMORY_FIT_BYTES and memory_class(row.node)[0] == kind})
        curve = [[x, round(min(statistics.median(values), 1.0), 4)] for x, values in sorted(points.items())]
        by = "row length" if kind in ROW_CLASSES else "octave of bytes moved"
        out.append((f"bandwidth_{kind}", curve,
                    f"{kind} ops measured ({', '.join(ops)}; {sum(map(len, points.values()))} moving >= 64 MiB): bytes "
                    f"as fxflops counts them / (time - launch_overhead) over hbm_bandwidth, median per {by}, {label}"))
    return out


def _alignment(row: Row) -> int:
    """The largest power-of-two byte alignment (2 to 128) of a bf16 GEMM's K and N rows."""
    m, n, k, _ = gemm_shape(row.node)
    alignment = 2
    while alignment < 128 and all((dim * 2) % (alignment * 2) == 0 for dim in (k, n)):
        alignment *= 2
    return alignment


def _compute_ratio(row: Row, device: DeviceModel) -> float | None:
    """Modelled over measured compute time of a compute-bound GEMM (the factor the model is off by)."""
    modelled = op_time(row.node, device, DTYPE)
    if modelled.compute < modelled.memory or row.seconds <= modelled.overhead:
        return None
    # the launch, and a split-K GEMM's reduction of its parts, taken out: what is left is the tiles' time
    return modelled.compute / (row.seconds - modelled.overhead)


def _ratios_by(gemms: list[Row], device: DeviceModel, applied: Callable[[int, int, int], float],
               key: Callable[[Row, int, int, int], Any]) -> dict[Any, list[float]]:
    """Measured over modelled efficiency of each compute-bound GEMM with the factor the model `applied` to it
    taken out (what that factor would have to be for the GEMM to be exact), grouped by `key`."""
    groups: dict[Any, list[float]] = {}
    for row in gemms:
        ratio = _compute_ratio(row, device)
        if ratio is None:
            continue
        m, n, k, _ = gemm_shape(row.node)
        groups.setdefault(key(row, m, n, k), []).append(ratio * applied(m, n, k))
    return groups


def _size(m: int, n: int, k: int) -> float:
    return (float(m) * n * k) ** (1 / 3)


def _size_correction(aligned: list[Row], device: DeviceModel) -> list[list[float]]:
    ratios = _ratios_by(aligned, device, lambda m, n, k: interpolate(device.gemm_size_correction, _size(m, n, k)),
                        lambda row, m, n, k: round(math.log2(_size(m, n, k))))
    return [[float(2 ** octave), round(statistics.median(values), 4)] for octave, values in sorted(ratios.items())]


def _alignment_factors(gemms: list[Row], device: DeviceModel) -> list[list[float]]:
    by_bytes = _ratios_by(gemms, device, lambda m, n, k: device.alignment_factor((k, n), 2),
                          lambda row, m, n, k: min(_alignment(row), 128))
    if 128 not in by_bytes:
        return []
    full = statistics.median(by_bytes[128])
    return [[float(alignment), round(min(statistics.median(values) / full, 1.0), 4)]
            for alignment, values in sorted(by_bytes.items())]


def _attention_curves(fit_rows: list[Row], device: DeviceModel, label: str) -> list[tuple[str, Any, str]]:
    """Each fused kernel's forward / causal forward / backward curve at head dim 128 (fraction of peak by
    query length), the head-dim factor from the flash rows, and the unfused kernels' measured / modelled."""
    out = []
    peak = device.peak("bf16")
    for kernel, prefix in (("flash", "attention"), ("cudnn", "cudnn_attention")):
        for curve_name, backward, causal in (("forward", False, False), ("forward_causal", False, True),
                                             ("backward", True, False)):
            points = _attention_points(fit_rows, kernel, backward, causal, 128, peak, device.launch_overhead)
            if points:
                out.append((f"{prefix}_{curve_name}", points,
                            f"torch SDPA's {kernel} backend measured, bf16, head dim 128, "
                            f"{'causal, FLOPs of the kept pairs' if causal else 'no mask'}, "
                            f"{'backward' if backward else 'forward'}: achieved / peak per query length, {label}"))
    head = []
    for head_dim in (64, 128, 256):
        points = _attention_points(fit_rows, "flash", False, False, head_dim, peak, device.launch_overhead)
        reference = _attention_points(fit_rows, "flash", False, False, 128, peak, device.launch_overhead)
        if points and reference:
            ratios = [value / interpolate(reference, seq) for seq, value in points]
            head.append([float(head_dim), round(statistics.median(ratios), 4)])
    if len(head) > 1:
        out.append(("attention_head_dim", head, f"flash forward at each head dim over head dim 128, median over "
                                                f"query lengths, {label}"))
    for backward in (False, True):
        ratios: dict[int, list[float]] = {}
        for row in fit_rows:
            if row.kind != ATTENTION or row.kernel != "math" or _backward(row) != backward:
                continue
            dims = attention_dims(row.node)
            modelled = _math_attention_time(dims, backward, with_constant(
                device, f"unfused_attention_{'backward' if backward else 'forward'}", [[1, 1.0]], "fit"), "bf16", 0.0)
            ratios.setdefault(dims[1], []).append(row.seconds / modelled.seconds)
        if ratios:
            out.append((f"unfused_attention_{'backward' if backward else 'forward'}",
                        [[float(seq), round(statistics.median(v), 4)] for seq, v in sorted(ratios.items())],
                        f"torch SDPA's math backend measured over the unfused model, by query length, {label}"))
    return out


def _backward(row: Row) -> bool:
    return row.node.phase == BACKWARD


def _attention_points(fit_rows: list[Row], kernel: str, backward: bool, causal: bool, head_dim: int,
                      peak: float, overhead: float) -> list[list[float]]:
    """Achieved / peak of the kernel's rows at one head dim, per query length (the launch taken out, as the
    model adds it back)."""
    by_seq: dict[int, list[float]] = {}
    for row in fit_rows:
        if row.kind != ATTENTION or row.kernel != kernel or _backward(row) != backward:
            continue
        batch, heads, seq, dim = row.source["shape"]
        if dim != head_dim or bool(row.source["causal"]) != causal or (backward and causal):
            continue
        flops = row.node.effective_flops if causal and row.node.effective_flops is not None else row.node.flops
        if row.seconds > overhead:
            by_seq.setdefault(seq, []).append(flops / (row.seconds - overhead) / peak)
    return [[float(seq), round(statistics.median(v), 4)] for seq, v in sorted(by_seq.items())]


def calibrate_table(table: Mapping[str, Any] | str, base: DeviceModel | str, path: str | None = None,
                    name: str | None = None) -> DeviceModel:
    """Every constant a measured op table shows, fitted to all its rows and cited to its run (the table's
    `env`: GPU, driver, torch, date); with `path`, written there as a device file (`base = ...`, loadable
    by path, or by `name` when shipped beside the presets). The table is what `benchmarks/gpu_check.py
    --only env,ops` writes on your GPU, as a dict or its JSON file's path."""
    import json
    from pathlib import Path

    from fxflops.predict.calibrate import base_reference, write_device_file

    if isinstance(table, (str, Path)):
        table = json.loads(Path(table).read_text(encoding="utf-8"))
    base_name = base_reference(base) if path is not None else ""  # refused before anything is fitted or written
    measured = rows(table)
    if not measured:
        raise ValueError("calibrate_table: the table has no op rows (run benchmarks/gpu_check.py with its ops section)")
    env = table.get("env", {})
    label = (f"measured on {env.get('name', 'a GPU')}, torch {env.get('torch', '?')}, {str(env.get('date', '?'))[:10]}"
             f" (benchmarks/gpu_check.py)")
    device, fitted = fit_device(measured, base, label)
    if path is not None:
        write_device_file(path, base_name, fitted, name=name,
                          note=f"fitted by fxflops.predict.op_table.calibrate_table to {len(measured)} measured ops")
        return device_model(path)
    return device
