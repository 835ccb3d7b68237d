"""Time per op on a device: the roofline made realistic, from each op's counted FLOPs, bytes and shapes.

An op takes `max(flops / (peak x efficiency), bytes / bandwidth) + launch overhead`, the bandwidth the sustained
one or, for a memory-bound op, its kernel class's:

- GEMMs (ops with MACs: linear, mm, bmm, matmul, einsum, conv as an implicit GEMM) run at the device's
  tensor-core peak for the dtype times `DeviceModel.gemm_fraction(M, N, K)`: the large-GEMM plateau, tile and
  wave quantization, the alignment of K and N, the calibrated size correction. M, N, K come from the output
  shape and the MACs (K = MACs / output elements), so every rule's GEMM is read the same way. A GEMM whose
  output tiles fill less than half of the SMs and whose K is deep runs split-K, as cuBLAS, cuDNN and CUTLASS run
  it (`DeviceModel.split_k`): its tiles once per part of K in the wave, plus the reduction of the parts' fp32
  partial outputs through memory after them (`split_k_reduction`, in the op's `overhead` with its launch).
- grouped GEMMs (MoE experts, `_grouped_mm`) as one GEMM of a group's shape, times `grouped_gemm_efficiency`,
  never split along K (CUTLASS's grouped kernel, which torch runs, has no stream-K).
- attention kernels (SDPA, flash/efficient attention, forward and backward) at the attention curve's
  fraction for their query length and head dimension; with a causal mask, of the FLOPs of the kept pairs.
  That is a fused (FlashAttention-class) kernel. A run whose software computes attention unfused
  (`Kernels(attention="math")`: torch's math SDPA backend, Megatron-LM's CoreAttention before FlashAttention)
  is timed as the kernels it launches instead: batched GEMMs over every (query, key) pair, each at the GEMM
  model's efficiency or its memory traffic, whichever is slower, and the scores' round trips through memory
  (softmax, attention dropout and their backward) at the sustained bandwidth, the sum times the device's
  `unfused_attention_forward` / `_backward` factor (published measurements of these kernels over this model);
  see `Kernels`.
- everything else (elementwise, norms, reductions, copies) at the vector rate or its kernel class's bandwidth
  (`memory_class`: pointwise, reduction, normalization and softmax (forward and backward), gather, copy): the
  device's bandwidth_CLASS curve by bytes moved (by row length for normalization and softmax), the sustained
  bandwidth where the device has none for the class (a run of apex's persistent layer norm,
  `Kernels(persistent_norm=True)`, times its norms at the persistent_normalization curves). A run whose software fuses pointwise ops
  (`Kernels(fuse_elementwise=True)`: Megatron-LM's fused bias + GeLU and bias + dropout + add, a GPU's one-kernel
  dropout) has each chain of them timed as one pass (`node_times`) at the sustained bandwidth: a fused kernel is
  not the pointwise class's one-op kernel, and no measurement of such kernels is published.
- the ops one call of a composite ran that torch runs on CUDA as one fused kernel (`torch.rms_norm` /
  `nn.RMSNorm`, which a capture on fake tensors records as its decomposition: pow, mean, add, rsqrt, mul ...) as
  that one kernel of the normalization class, forward and backward (`fused_calls`, `Kernels.fused_composites`).
- layer norm with the kernels torch's CUDA layer norm adds (`layer_norm_extra_seconds`): a contiguous copy of each
  strided input, and the weight's and bias's gradient kernel after the input's gradient in its backward.
- batch norm as the CUDA kernels torch launches for the input's layout, each bound by its dependent loads at the
  device's memory_latency or by its bytes (`cuda_kernels.batch_norm_launches`); a bf16/fp16 convolution on NCHW
  tensors with cuDNN's NCHW -> NHWC copies in its overhead (`layout_conversion_seconds`).
- zero-cost ops that move no data (views, metadata), collective calls (timed by `comm_time`) and unknown
  ops without bytes take 0 s and launch nothing.

The prediction is a model with a stated error, not a measurement: see docs/guide/time.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fxflops.predict.cuda_kernels import (Launch, aten_name, batch_norm_launches, conversion_bytes, layer_norm_launches,
                                         launch_seconds, weight_gradient_only)
from fxflops.predict.hardware import DeviceModel, device_model, interpolate
from fxflops.results.captured import BACKWARD, FORWARD, RECOMPUTE
from fxflops.results.costs import UNKNOWN, ZERO, NodeCost

GEMM, GROUPED_GEMM, ATTENTION, MEMORY, NONE = "gemm", "grouped_gemm", "attention", "elementwise", "none"
_COLLECTIVE_RULES = ("collective", "collective wait")  # rules/collectives.toml: timed by comm_time instead
_ELEMENT_BYTES = {"fp64": 8, "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
_DTYPE_KEYS = {"float64": "fp64", "double": "fp64", "float32": "fp32", "float": "fp32", "bfloat16": "bf16",
               "float16": "fp16", "half": "fp16", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


ATTENTION_KERNELS = ("flash", "cudnn", "math")


@dataclass(frozen=True)
class Kernels:
    """Which kernels a run's software launches where the captured ops do not say it (the capture records
    one `scaled_dot_product_attention` whichever backend runs it).

    `attention`: "flash" (default): one fused kernel that keeps the scores on chip and skips the blocks a causal
    mask drops, at the device's FlashAttention curves. "cudnn": the same kind of kernel as cuDNN builds it
    (Transformer Engine's FusedAttention, which TE's DotProductAttention picks over flash-attn on Hopper), at the
    device's cudnn_attention curves. "math": unfused attention, as torch's math SDPA backend and Megatron-LM's CoreAttention before
    FlashAttention run it: per (batch, query head) the scores Q K^T as a batched GEMM over every (query, key)
    pair (the mask applied after it), one softmax kernel over the scores (scale and mask fused into it, as
    Megatron's FusedScaleMaskSoftmax does: scores read, probabilities written), the attention dropout when
    `attention_dropout` > 0 (probabilities read, output and a one-byte mask written) and the batched GEMM with
    V; the backward: the four batched GEMMs of dV, dP, dQ, dK, the dropout's backward (gradient and mask read,
    gradient written) and the softmax's (probabilities and gradient read, gradient written). Each GEMM takes
    the slower of its compute (the GEMM model) and its traffic (both operands read, the product written).
    `attention_dropout`: dropout probability on the attention probabilities (only a "math" run launches a
    kernel for it; a flash kernel applies it in registers). Flex attention ops stay fused under "math": they
    are compiled kernels whatever backend the run's scaled_dot_product_attention calls take.

    `fuse_elementwise`: the run launches one kernel for each chain of pointwise ops the capture records one by
    one (see `fused_chains`): elementwise arithmetic, activations and their backward, a dropout's random mask,
    consecutive in one pass over tensors of one size, as Megatron-LM's JIT-fused bias + GeLU and bias +
    dropout + add do (Narayanan et al. 2021 Sec. 4.2) and as CUDA's `native_dropout` does for the CPU capture's
    `bernoulli_` + `div_` + `mul`. The chain reads what it reads from outside and writes its last output (and
    a one-byte mask per element when it draws one, kept for the backward): each intermediate result,
    written by one op and read by the next, stays in registers. False (default): each op is its own kernel.

    `persistent_norm`: the run's normalization kernels are apex's persistent fast layer norm (apex.contrib's
    FastLayerNorm: one CTA keeps its rows in registers; Megatron-LM's `persist_layer_norm`, on by default from
    a2fdcdf of 2021-10 with torch >= 1.11 for the hidden sizes it lists; Transformer Engine's LayerNorm kernels
    are the same code): its normalization ops take the device's bandwidth_persistent_normalization(_backward)
    curves instead of bandwidth_normalization(_backward) (a device without a published persistent curve: its
    normalization curves, never the faster streaming rate). False (default): the device's normalization curves.

    `fused_composites` (default True): the ops one call of a composite that torch runs on CUDA as one fused kernel
    (`torch.rms_norm` / `F.rms_norm` / `nn.RMSNorm`: `_fused_rms_norm` and `_fused_rms_norm_backward`, see
    fxflops.capture.recorder.FUSED_COMPOSITES) ran, which the capture records decomposed, are timed as that
    kernel (see `fused_calls`); False: each op as its own kernel (what a device without the fused kernel runs)."""

    attention: str = "flash"
    attention_dropout: float = 0.0
    fuse_elementwise: bool = False
    persistent_norm: bool = False
    fused_composites: bool = True

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention={self.attention!r}: pick one of {', '.join(ATTENTION_KERNELS)} "
                             "(flash: a fused kernel; cudnn: cuDNN's fused kernel; math: bmm + softmax (+ dropout) "
                             "+ bmm, the scores in memory)")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"attention_dropout={self.attention_dropout!r}: a probability in [0, 1)")


FLASH = Kernels()


@dataclass(frozen=True)
class OpTime:
    """How one op's time came out: its class, the two roofline terms and the efficiency used."""

    kind: str  # GEMM | GROUPED_GEMM | ATTENTION | MEMORY | NONE
    seconds: float  # max(compute, memory) + overhead (unfused attention: its kernels' such times, summed)
    compute: float  # flops / (peak x efficiency)
    memory: float  # bytes / bandwidth (a memory-bound op's: its class's, see memory_class)
    overhead: float  # launch overhead (0 for ops that launch nothing); a split-K GEMM's: plus the reduction of its parts
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
    conv's channel dim; a convolution_backward that computes the weight's gradient alone, or with the bias's: C_in /
    groups x the kernel, its GEMM's columns), M the rest of its elements, K = MACs / output elements. A grouped GEMM's groups
    come from its second input's leading dim (the experts' stacked weights)."""
    out = node.output_shapes[0] if node.output_shapes else ()
    numel = math.prod(out) if out else 1
    if weight_gradient_only(node):
        # the weight's gradient alone (nothing before the convolution needs a gradient: a network's first layer)
        # is the implicit GEMM dW = dY^T x im2col(X): C_out rows, C_in / groups x kernel columns, a reduction
        # over the batch's output pixels
        n = math.prod(out[1:])
    elif "conv" in node.op.lower() and len(out) >= 3:
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


def split_k_reduction(m: int, n: int, k: int, groups: int, device: DeviceModel, key: str) -> float:
    """Seconds a split-K GEMM (`DeviceModel.split_k` parts > 1) spends on reducing its parts after its tiles, as
    CUTLASS's stream-K fixup does it: every part but the last writes its fp32 partial output and the last reads
    them back into its own before writing the output, 2 x 4 bytes per output element per part but one, at the
    sustained bandwidth (the output's own write is in the op's bytes already). 0 for a GEMM that is not split."""
    splits = device.split_k(m, n, k, _ELEMENT_BYTES[key], groups)
    return 2 * 4 * (splits - 1) * m * n * max(groups, 1) / device.sustained


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


def op_time(node: NodeCost, device: DeviceModel | str, dtype: Any, kernels: Kernels = FLASH) -> OpTime:
    """The time of one op, with how it came out; `kernels`: what the run's software launches for it."""
    device = device_model(device)
    key = dtype_key(dtype)
    kind = op_kind(node)
    if kind == NONE:
        return OpTime(NONE, 0.0, 0.0, 0.0, 0.0, 1.0)
    # flex attention is a compiled fused kernel whatever the run's SDPA backend: only SDPA-family ops run unfused
    if kind == ATTENTION and kernels.attention == "math" and "flex" not in node.op:
        dims = attention_dims(node)
        if dims is not None:
            return _math_attention_time(dims, _is_backward_op(node), device, key, kernels.attention_dropout)
    if kind == MEMORY and device.memory_latency > 0:
        launches = batch_norm_launches(node, _ELEMENT_BYTES[key])
        if launches:
            return _launches_time(launches, node, device, key)
    if kind == MEMORY:
        klass, size = memory_class(node)
        if kernels.persistent_norm and klass.startswith("normalization"):
            klass = "persistent_" + klass
        bandwidth = device.class_bandwidth(klass, size)
    else:
        bandwidth = device.sustained
    memory = node.bytes / bandwidth if node.bytes else 0.0
    flops = node.flops
    overhead = device.launch_overhead
    if kind == MEMORY and not kernels.persistent_norm:
        overhead += layer_norm_extra_seconds(node, device, key)
    if kind == GEMM or kind == GROUPED_GEMM:
        m, n, k, groups = gemm_shape(node)
        # a grouped GEMM never splits K: torch's _grouped_mm is CUTLASS's grouped kernel, whose tile scheduler has
        # no stream-K (aten/src/ATen/native/cuda/GroupMM.cu)
        efficiency = device.gemm_fraction(m, n, k, _ELEMENT_BYTES[key], groups, splittable=kind == GEMM)
        if kind == GROUPED_GEMM:
            efficiency *= device.grouped_gemm_efficiency
        else:
            overhead += split_k_reduction(m, n, k, groups, device, key)
        compute = flops / (device.peak(key) * efficiency)
        if kind == GEMM and key in ("bf16", "fp16"):
            overhead += layout_conversion_seconds(node, device, key)
    elif kind == ATTENTION:
        seq, head_dim, causal = _attention_shape(node)
        if causal and node.effective_flops is not None:
            flops = node.effective_flops  # a flash kernel skips the blocks a band mask drops
        # flex attention is a compiled kernel of its own: the FlashAttention curves whatever the run's backend
        kernel = "cudnn" if kernels.attention == "cudnn" and "flex" not in node.op else "flash"
        efficiency = device.attention_fraction(seq, head_dim, backward=_is_backward_op(node),
                                               causal=causal, kernel=kernel)
        compute = flops / (device.peak(key) * efficiency)
    else:
        efficiency = 1.0
        compute = flops / device.vector_peak(key) if flops else 0.0
    return OpTime(kind, max(compute, memory) + overhead, compute, memory, overhead, efficiency)


def _launches_time(launches: list[Launch], node: NodeCost, device: DeviceModel, key: str) -> OpTime:
    """The kernels torch launches for one op (cuda_kernels.batch_norm_launches), one after the other: each the slower
    of its dependent load rounds at the device's memory_latency and its bytes at the sustained bandwidth, plus a
    launch. The op's FLOPs at the vector rate bound the sum from below."""
    memory = sum(launch_seconds(launch, device.sm_count, device.threads_per_sm, device.memory_latency,
                                device.sustained) for launch in launches)
    compute = node.flops / device.vector_peak(key) if node.flops else 0.0
    overhead = len(launches) * device.launch_overhead
    return OpTime(MEMORY, max(compute, memory) + overhead, compute, memory, overhead, 1.0)


def layout_conversion_seconds(node: NodeCost, device: DeviceModel, key: str) -> float:
    """Seconds of the NCHW -> NHWC copies cuDNN runs around one bf16/fp16 convolution op on NCHW tensors
    (cuda_kernels.conversion_bytes, `conv_layout_conversions` per call): each copy's bytes at the copy class's
    bandwidth, plus a launch each; 0 for channels-last tensors and other ops."""
    moved, kernels = conversion_bytes(node, _ELEMENT_BYTES[key], device.conv_layout_conversions)
    return _copies_seconds(moved, kernels, device)


def layer_norm_extra_seconds(node: NodeCost, device: DeviceModel, key: str) -> float:
    """Seconds of the kernels torch's CUDA layer norm runs beside the one its op's bytes count
    (cuda_kernels.layer_norm_launches): the contiguous copies of its strided inputs at the copy class's bandwidth
    and, in a backward with the weight's or bias's gradient, the GammaBetaBackward kernel at the normalization
    backward curve for its row, a launch each; 0 for other ops."""
    moved, copies, reduction, reductions = layer_norm_launches(node, _ELEMENT_BYTES[key])
    seconds = _copies_seconds(moved, copies, device)
    if reductions:
        seconds += reduction / device.class_bandwidth("normalization_backward", _norm_row(node, True, 1)) \
            + reductions * device.launch_overhead
    return seconds


def _copies_seconds(moved: float, copies: int, device: DeviceModel) -> float:
    """`copies` copy kernels moving `moved` bytes in all, at the copy class's bandwidth for one's size, a launch each."""
    if not copies:
        return 0.0
    return moved / device.class_bandwidth("copy", moved / copies) + copies * device.launch_overhead


# the memory classes whose bandwidth curve is by row length, not bytes moved
ROW_CLASSES = ("normalization", "normalization_backward", "persistent_normalization",
               "persistent_normalization_backward", "softmax", "softmax_backward")
# rules/ names of each memory-bound kernel class (op names decide first: see memory_class)
_NORMALIZATION_RULES = ("layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "norm_backward")
_GATHER_RULES = ("lookup", "embedding_backward", "embedding_bag", "index", "index_put_accumulate", "scatter_add",
                 "scatter_reduce")
# ops rules/zero.toml lists under `copy` that copy nothing: fills, masks and random draws write each element from a
# value (or read it once, as masked_fill and tril do): pointwise kernels
_FILL_OPS = ("fill", "zero_", "masked_fill", "tril", "triu", "new_zeros", "new_ones", "new_full", "zeros_like",
             "ones_like", "full_like", "rand_like", "randn_like", "uniform", "normal", "bernoulli")


def memory_class(node: NodeCost) -> tuple[str, float]:
    """(kernel class, size) of a memory-bound op: the class whose bandwidth curve times it (hardware's
    MEMORY_CLASSES; a backward op of normalization or softmax has its own) and the curve's x: the row length for
    normalization and softmax, whose kernels reduce each row on chip (`_norm_row`; a softmax's: its input's last
    dim, the capture keeping no `dim`); the bytes moved for the others. A dropout's random draw is pointwise; so
    is any op no class names."""
    op = node.op.lower()
    name = aten_name(op)
    rule = node.rule or ""
    row = node.input_shapes[0][-1] if node.input_shapes and node.input_shapes[0] else 1
    backward = "_backward" if "backward" in name else ""
    if "softmax" in name:
        return "softmax" + backward, row
    if rule in _NORMALIZATION_RULES or name.endswith("_norm_backward"):
        return "normalization" + backward, _norm_row(node, bool(backward), row)
    if any(r in name for r in _RANDOM_OPS):
        return "pointwise", node.bytes
    if rule in _GATHER_RULES or "nll_loss" in name or name.startswith(("gather", "scatter", "index")):
        return "gather", node.bytes
    if rule == "copy" and not name.startswith(_FILL_OPS):
        return "copy", node.bytes
    if rule == "reduction":
        return "reduction", node.bytes
    return "pointwise", node.bytes


def _norm_row(node: NodeCost, backward: bool, last: int) -> int:
    """The elements one normalization reduces over: its input's elements over its statistics' (a forward's second
    output, a backward's third input: layer norm's mean over `normalized_shape`, all of it, not its last dim; group
    norm's (N, groups), so C / groups x H x W; batch norm's per-channel, so N x H x W; RMS norm's rstd). `last`
    (the input's last dim) where the op has no statistics (an eval batch norm's are empty)."""
    shapes = node.input_shapes[2:3] if backward else node.output_shapes[1:2]
    x = node.input_shapes[1 if backward else 0] if len(node.input_shapes) > (1 if backward else 0) else ()
    stats = math.prod(shapes[0]) if shapes else 0
    elements = math.prod(x) if x else 0
    if stats <= 0 or elements < stats or elements % stats:
        return last
    return elements // stats


def attention_dims(node: NodeCost) -> tuple[int, int, int, int, int] | None:
    """(batch x query heads, query length, key length, head dim of q/k, head dim of v) of an attention op, from
    its query, key and value inputs (the first three inputs of a forward op; inputs 1-3 of a backward op, whose
    first input is the output's gradient); None when the inputs are not three 4-D tensors."""
    from fxflops.rules.kept_pairs import SEQ_FIRST

    shapes = [shape for shape in node.input_shapes if len(shape) == 4]
    first = 1 if "backward" in node.op.lower() else 0
    if len(shapes) < first + 3:
        return None
    query, key, value = shapes[first:first + 3]
    seq_axis, head_axis = (1, 2) if node.op.startswith(SEQ_FIRST) else (2, 1)
    return (query[0] * query[head_axis], query[seq_axis], key[seq_axis], query[-1], value[-1])


def _math_attention_time(dims: tuple[int, int, int, int, int], backward: bool, device: DeviceModel, key: str,
                         dropout: float) -> OpTime:
    """Unfused attention's kernels (see `Kernels`), summed: batched GEMMs at the slower of the GEMM model and
    their traffic, the scores' elementwise passes at the sustained bandwidth, a launch each."""
    groups, lq, lk, e, ev = dims
    element = _ELEMENT_BYTES[key]
    peak = device.peak(key)
    if backward:  # dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q
        gemms = ((lk, ev, lq), (lq, lk, ev), (lq, e, lk), (lk, e, lq))
        passes = 3 * element  # softmax backward: P and dP read, dS written
    else:  # S = Q K^T, O = P V
        gemms = ((lq, lk, e), (lq, ev, lk))
        passes = 2 * element  # softmax (scale and mask inside): S read, P written
    kernels = len(gemms) + 1
    if dropout > 0:  # forward: P read, output and a one-byte mask written; backward: gradient and mask read, written
        passes += 2 * element + 1
        kernels += 1
    seconds = compute = memory = 0.0
    flops = 0
    for m, n, k in gemms:
        work = 2 * groups * m * n * k
        flops += work
        gemm_compute = work / (peak * device.gemm_fraction(m, n, k, element, groups))
        gemm_memory = groups * (m * k + k * n + m * n) * element / device.sustained
        compute += gemm_compute
        memory += gemm_memory
        seconds += max(gemm_compute, gemm_memory) + split_k_reduction(m, n, k, groups, device, key)
    elementwise = passes * groups * lq * lk / device.sustained
    memory += elementwise
    overhead = kernels * device.launch_overhead
    # what published measurements of these kernels took over what the roofline above gives them (the device's
    # unfused_attention curves, by query length; 1.0 where none is published)
    measured = interpolate(device.unfused_attention_backward if backward else device.unfused_attention_forward, lq)
    seconds = (seconds + elementwise) * measured + overhead
    efficiency = flops / (peak * compute) if compute else 1.0
    return OpTime(ATTENTION, seconds, compute, memory, overhead, efficiency)


def _is_backward_op(node: NodeCost) -> bool:
    """An attention op of the backward pass proper (a recomputed forward runs the forward kernel)."""
    return node.phase == BACKWARD or "backward" in node.op.lower()


# pointwise ops a fused kernel can take into one pass: rules/ names (elementwise arithmetic, activations and their
# backward) and the random draws of a dropout (a CPU capture's bernoulli_, a GPU's native_dropout)
_POINTWISE_RULES = ("elementwise", "activation", "activation_backward")
_RANDOM_OPS = ("bernoulli", "dropout", "rand_like")


def _pointwise(node: NodeCost) -> bool:
    """An op a pointwise fusion takes in: of those rules or a random draw, and of the pointwise kernel class (rule
    `activation_backward` holds the softmax backward too, a row reduction no pointwise kernel computes)."""
    op = node.op.lower()
    return op_kind(node) == MEMORY and (node.rule in _POINTWISE_RULES or any(r in op for r in _RANDOM_OPS)) \
        and memory_class(node)[0] == "pointwise"


def _in_place(node: NodeCost) -> bool:
    """An in-place op (aten.NAME_.overload): it writes its first input."""
    parts = node.op.split(".")
    return len(parts) > 1 and parts[1].endswith("_") and not parts[1].startswith("_")


def _numel(node: NodeCost) -> int:
    return math.prod(node.output_shapes[0]) if node.output_shapes and node.output_shapes[0] else 1


def fused_calls(nodes: list[NodeCost]) -> list[tuple[list[int], list[int], bool]]:
    """(indices, the forward call's indices, backward) of each fused composite kernel: the forward (or recomputed) ops one call ran (nodes
    with one `fused_call`'s kind and call, consecutive among the ops that launch something, their steps rising:
    a replayed block's copies keep their reference's call number), and separately the backward ops that
    differentiate them (wherever autograd ran them). Ops that launch nothing are left out."""
    groups: list[tuple[list[int], list[int], bool]] = []
    owner: dict[str, int] = {}  # forward node name -> its group
    current: list[int] = []
    last: Any = None
    for i, node in enumerate(nodes):
        if op_kind(node) == NONE:
            continue
        tag = node.fused_call
        if tag is not None and node.phase != BACKWARD:
            if not (current and last is not None and (tag.kind, tag.call) == (last.kind, last.call)
                    and tag.step > last.step and node.phase == nodes[current[0]].phase):
                current = []
                groups.append((current, current, False))
            current.append(i)
            owner[node.name] = len(groups) - 1
            last = tag
            continue
        current, last = [], None
    backward: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        if node.phase == BACKWARD and node.differentiates in owner and op_kind(node) != NONE:
            backward.setdefault(owner[node.differentiates], []).append(i)
    return groups + [(members, groups[group][1], True) for group, members in sorted(backward.items())]


def _fused_call_time(members: list[NodeCost], call: list[NodeCost], backward: bool, device: DeviceModel, key: str
                     ) -> OpTime:
    """The fused kernels of a composite call's ops (forward) or of their backward, at the device's normalization
    (backward) curve for the row length, a launch each, as torch runs rms_norm on CUDA (layer_norm_kernel.cu, seen
    in benchmarks/results/gpu/h200_rms_norm_kernels.json): forward one kernel that reads the input and the weight
    and writes the output and the fp32 rstd it saves for the backward, E x input + R x weight + E x output + 4 E / R
    bytes (E elements, R the row length); backward two, the input's gradient (input, output gradient, weight and
    rstd read, input gradient written: 2 E x input + E x output + R x weight + 4 E / R) and, with a weight, the
    weight's (input, output gradient and rstd read again, weight gradient written: E x input + E x output + R x
    weight + 4 E / R). FLOPs: the ops' own, at the vector rate. `call`: the forward call's ops: E is its first op's
    first input's elements, E / R its smallest output's (rms_norm's statistics, one per row)."""
    tag = call[0].fused_call
    x = call[0].input_shapes[0] if call[0].input_shapes else ()
    e = math.prod(x) if x else 1
    rows = min((math.prod(n.output_shapes[0]) for n in call if n.output_shapes and n.output_shapes[0]), default=0)
    if rows <= 0 or e % rows:
        rows = max(e // max(x[-1] if x else 1, 1), 1)
    r = max(e // rows, 1)
    kernels = 1
    if backward:
        traffic = 2 * e * tag.input_item + e * tag.output_item + r * tag.weight_item + 4 * rows
        if tag.weight_item:
            traffic += e * tag.input_item + e * tag.output_item + r * tag.weight_item + 4 * rows
            kernels = 2
    else:
        traffic = e * tag.input_item + r * tag.weight_item + e * tag.output_item + 4 * rows
    klass = "normalization_backward" if backward else "normalization"
    memory = traffic / device.class_bandwidth(klass, r)
    flops = sum(n.flops for n in members)
    compute = flops / device.vector_peak(key) if flops else 0.0
    overhead = kernels * device.launch_overhead
    return OpTime(MEMORY, max(compute, memory) + overhead, compute, memory, overhead, 1.0)


def _shared(times: list[OpTime], indices: list[int], members: list[NodeCost], whole: OpTime) -> None:
    """`whole` (one kernel's time) split among its ops in proportion to their own traffic (evenly without any)."""
    weights = [n.bytes for n in members] if any(n.bytes for n in members) else [1] * len(members)
    total = sum(weights)
    for i, weight in zip(indices, weights):
        share = weight / total
        times[i] = OpTime(MEMORY, whole.seconds * share, whole.compute * share, whole.memory * share,
                          whole.overhead * share, 1.0)


def fused_chains(nodes: list[NodeCost], taken: frozenset[int] = frozenset()) -> list[list[int]]:
    """Indices of the chains a fusing run launches as one kernel each: consecutive pointwise ops (ops that
    launch nothing, views and allocations, in between do not break a chain) of one phase whose outputs have
    the same number of elements; any other op, or one in `taken` (a fused composite's), ends a chain. Chains of
    one op are left out."""
    chains: list[list[int]] = []
    chain: list[int] = []
    for i, node in enumerate(nodes):
        if op_kind(node) == NONE:
            continue
        if i in taken:
            if len(chain) > 1:
                chains.append(chain)
            chain = []
            continue
        if chain and _pointwise(node) and node.phase == nodes[chain[0]].phase \
                and _numel(node) == _numel(nodes[chain[0]]):
            chain.append(i)
            continue
        if len(chain) > 1:
            chains.append(chain)
        chain = [i] if _pointwise(node) else []
    if len(chain) > 1:
        chains.append(chain)
    return chains


def node_times(nodes: Iterable[NodeCost], device: DeviceModel | str, dtype: Any, kernels: Kernels = FLASH
               ) -> list[OpTime]:
    """Each node's OpTime in order; with `kernels.fuse_elementwise` a fused chain's one pass (its FLOPs at the
    vector rate or its traffic at the sustained bandwidth, and one launch) shared among its ops in proportion
    to their own traffic. The chain's traffic: its ops' bytes less each intermediate result's write and read
    (every op but the last hands its output, elements x the dtype's size, to the next) and each in-place random
    draw's read of the buffer it overwrites, plus a one-byte mask per element for each random draw (the dropout
    mask kept for the backward). With `kernels.fused_composites`, each fused composite call's ops (`fused_calls`)
    take one kernel's time (`_fused_call_time`), shared the same way."""
    device = device_model(device)
    key = dtype_key(dtype)
    nodes = list(nodes)
    times = [op_time(node, device, key, kernels) for node in nodes]
    taken: set[int] = set()
    if kernels.fused_composites and any(node.fused_call is not None for node in nodes):
        for indices, call, backward in fused_calls(nodes):
            members = [nodes[i] for i in indices]
            _shared(times, indices, members, _fused_call_time(members, [nodes[i] for i in call], backward, device, key))
            taken.update(indices)
    if not kernels.fuse_elementwise:
        return times
    element = _ELEMENT_BYTES[key]
    for chain in fused_chains(nodes, frozenset(taken)):
        members = [nodes[i] for i in chain]
        numel = _numel(members[0])
        draws = [n for n in members if any(r in n.op.lower() for r in _RANDOM_OPS)]
        # an in-place draw (bernoulli_) overwrites a fresh buffer it never reads: the fused kernel draws in
        # registers, so that read (counted in its bytes) is no traffic
        in_place = sum(1 for n in draws if _in_place(n))
        traffic = sum(n.bytes for n in members) - (2 * (len(members) - 1) + in_place) * numel * element \
            + len(draws) * numel
        traffic = max(traffic, numel * element)  # at least its output written (an op of another dtype in it)
        flops = sum(n.flops for n in members)
        compute = flops / device.vector_peak(key) if flops else 0.0
        memory = traffic / device.sustained
        seconds = max(compute, memory) + device.launch_overhead
        _shared(times, chain, members, OpTime(MEMORY, seconds, compute, memory, device.launch_overhead, 1.0))
    return times


def node_seconds(node: NodeCost, device: DeviceModel | str, dtype: Any, kernels: Kernels = FLASH) -> float:
    """Predicted seconds of one op on `device` computing in `dtype` (see the module's docstring)."""
    return op_time(node, device, dtype, kernels).seconds


def estimate_seconds(est: Any, device: DeviceModel | str, dtype: Any = None, kernels: Kernels = FLASH
                     ) -> dict[str, Any]:
    """Predicted compute time of an Estimate's ops (one rank's step as counted), summed.

    Returns {"total": s, "phases": {"forward": s, "backward": s, "recompute": s},
    "modules": {qualified name: {phase: s}} (each op at its innermost module, "" = the model),
    "inclusive": {qualified name: {phase: s}} (a module with everything under it; "" is the total),
    "kinds": {op kind: s}, "ops": number of ops timed, "unknown": ops no rule counts that were timed by
    their bytes alone (their FLOPs are not known), "device": name, "dtype": key}. Collective calls
    are not in it (comm_time times them). `dtype`: the compute dtype; default the estimate's own. `kernels`:
    what the run's software launches where the ops do not say it (unfused attention)."""
    device = device_model(device)
    key = dtype_key(dtype if dtype is not None else (getattr(est, "dtype", None) or "float32"))
    return sum_seconds(est.nodes, device, key, kernels)


def sum_seconds(nodes: Iterable[NodeCost], device: DeviceModel, key: str, kernels: Kernels = FLASH
                ) -> dict[str, Any]:
    """estimate_seconds() over any iterable of NodeCost."""
    phases = {FORWARD: 0.0, BACKWARD: 0.0, RECOMPUTE: 0.0}
    modules: dict[str, dict[str, float]] = {}
    kinds: dict[str, float] = {}
    timed = unknown = 0
    nodes = list(nodes)
    for node, timing in zip(nodes, node_times(nodes, device, key, kernels)):
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
