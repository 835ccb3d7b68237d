"""The CUDA kernels torch launches for ops whose count does not say how they run: batch norm, and the layout
conversions cuDNN puts around a convolution whose tensors are NCHW.

Batch norm (aten.native_batch_norm and its backward; bf16/fp16/fp32, not cuDNN's: torch's
_select_batch_norm_backend never picks cuDNN for a bf16 input) runs the kernels of
aten/src/ATen/native/cuda/Normalization.cu(h), chosen by the input's layout (batch_norm_choose_impl):

- NCHW contiguous, training forward: batch_norm_collect_statistics_kernel (one block per channel, 512 threads,
  Welford over N x H x W: one pass over the input), an elementwise kernel over the channels
  (batch_norm_update_stats_and_invert), batch_norm_transform_input_kernel (blocks of (channel, batch slice): the
  input read, the output written). Backward: batch_norm_backward_kernel, one block per channel, two passes over the
  input and the output's gradient (the sums, then the input's gradient written).
- channels-last (strides[1] == 1): the apex-derived kernels of flexible_launch_configs' grid, 4 loads in flight a
  thread: batch_norm_collect_statistics_channels_last_kernel + the elementwise kernel +
  batch_norm_transform_input_channels_last_kernel forward, batch_norm_backward_reduce_channels_last_kernel +
  batch_norm_backward_elemt_channels_last_kernel backward.

Each kernel's threads load an element, wait for it and fold it in before the next load (the loop bodies in
Normalization.cuh): a thread has one load in flight (the channels-last kernels: PARALLEL_LOADS = 4, at once), so a
block's time is its loop's iterations x `memory_latency`, and a grid runs ceil(blocks / (sm_count x resident blocks
an SM holds)) such waves. A kernel takes the slower of that and its bytes at the sustained bandwidth, plus a launch.
One block per channel over a large plane (64 channels x 56 x 56 at batch 64: 64 blocks on 132 SMs, 448 dependent
loads a thread) is far below the bandwidth, which is what the H100 run's ResNet-50 step measured.

Layout conversions: a bf16/fp16 convolution whose tensors are NCHW runs cuDNN's NHWC tensor-core kernels, with
`conv_layout_conversions` NCHW -> NHWC copies of an activation per call (forward: the input; input gradient: the
output's gradient; weight gradient: the input), each a copy kernel (read and write) at the copy class's bandwidth.
Channels-last tensors need none (torch passes cuDNN the input's memory format: cudnn_conv_suggest_memory_format).

Layer norm (aten.native_layer_norm and its backward) runs the kernels of aten/src/ATen/native/cuda/layer_norm_kernel.cu,
whose host code makes its tensors contiguous first: layer_norm_cuda and layer_norm_backward_cuda take
`input.expect_contiguous()`, LayerNormBackwardKernelImpl `dY.contiguous()`, each a copy kernel (read and written) of
a tensor that is not (`NodeCost.strided_inputs`: a transposed residual stream, as nn.MultiheadAttention with
batch_first hands back). Its backward is two kernels: the input's gradient (layer_norm_grad_input_kernel: dY and X
read, dX written, what the captured op's bytes count) and, when the weight's or the bias's gradient is asked for,
GammaBetaBackward (dY and X read again with the fp32 mean and rstd, dgamma and dbeta written), as the rms_norm
backward (op_time._fused_call_time) is two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fxflops.results.costs import NodeCost

# Normalization.cuh's launch constants (CUDA; ROCm's MAX_BLOCK_SIZE is 256, not modelled)
MAX_BLOCK_SIZE = 512
MAX_GRID_SIZE = 65535
ELEMENTS_PER_ITER = 4  # PARALLEL_LOADS of the channels-last kernels
ELEMENTS_PER_THREAD = 16
OPTIMAL_TILE_W = 32
MAX_H_BLOCK = 128
MAX_BLOCKS_PER_SM = 32  # resident blocks per SM, compute capability 8.0-10.0 (CUDA C++ Programming Guide)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the time model reads it: its grid, the dependent load rounds each thread makes, the
    bytes it moves."""

    name: str
    blocks: int
    threads: int  # per block
    rounds: int  # loads a thread waits on, one after the other
    bytes: int


def aten_name(op: str) -> str:
    """An op's name without its namespace and overload ("aten.native_batch_norm.default" -> "native_batch_norm")."""
    return op.split(".")[1] if op.startswith("aten.") and "." in op else op


def weight_gradient_only(node: NodeCost) -> bool:
    """A convolution_backward that computes no input gradient, the weight's (and maybe the bias's) alone (a network's
    first layer): its first output has the weight's shape (its third input) and not the input's (the second), so it
    is no input gradient of the same shape; a second output, if any, is the bias's 1-d gradient."""
    if "convolution_backward" not in node.op or len(node.input_shapes) < 3 \
            or not 1 <= len(node.output_shapes) <= 2 or any(len(shape) != 1 for shape in node.output_shapes[1:]):
        return False
    out = node.output_shapes[0]
    return len(out) >= 3 and out == node.input_shapes[2] and out != node.input_shapes[1]


def _num_threads(n: int) -> int:
    """getNumThreads: the smallest of 32, 64, 128, 256, 512 that holds n, else 512."""
    for size in (32, 64, 128, 256, MAX_BLOCK_SIZE):
        if n <= size:
            return size
    return MAX_BLOCK_SIZE


def _last_pow2(n: int) -> int:
    """lastPow2: the largest power of two <= n (1 for n < 1)."""
    return 1 << (max(n, 1).bit_length() - 1)


def _flexible(reduction: int, stride: int, coop: bool) -> tuple[int, int, int, int]:
    """flexible_launch_configs: (block x, block y, grid x, grid y) of the channels-last kernels."""
    block_x = min(_last_pow2(stride), OPTIMAL_TILE_W)
    block_y = min(_last_pow2(math.ceil(reduction / ELEMENTS_PER_THREAD)), MAX_BLOCK_SIZE // block_x)
    if block_x * block_y != MAX_BLOCK_SIZE:
        block_x = min(_last_pow2(stride), MAX_BLOCK_SIZE // block_y)
    grid_x = math.ceil(stride / block_x)
    grid_y = min(math.ceil(reduction / (block_y * ELEMENTS_PER_THREAD)), MAX_H_BLOCK)
    if coop and grid_y < 8:
        grid_y = 1
    return block_x, block_y, grid_x, grid_y


def _is_batch_norm(node: NodeCost) -> str | None:
    """"forward" or "backward" for torch's native batch norm ops, else None."""
    name = aten_name(node.op)
    if name == "native_batch_norm_backward":
        return "backward"
    if name in ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
                "_native_batch_norm_legit_no_training"):
        return "forward"
    return None


def batch_norm_launches(node: NodeCost, element: int) -> list[Launch] | None:
    """The kernels torch's CUDA batch norm launches for one captured op (see the module's docstring), or None for any
    other op (or one whose input is not N x C x ...). `element`: the input's bytes per element."""
    which = _is_batch_norm(node)
    if which is None:
        return None
    x = node.input_shapes[1 if which == "backward" else 0] if node.input_shapes else ()
    if len(x) < 2 or min(x) <= 0:
        return None
    n, c, plane = x[0], x[1], math.prod(x[2:])
    numel = n * c * plane
    if which == "forward":
        stats = node.output_shapes[1] if len(node.output_shapes) > 1 else ()
        training = bool(stats) and math.prod(stats) > 0  # an eval batch norm keeps no statistics
        return _forward(n, c, plane, numel, element, training, node.channels_last)
    return _backward(n, c, plane, numel, element, node.channels_last, bool(node.output_shapes and node.output_shapes[0]))


def _forward(n: int, c: int, plane: int, numel: int, element: int, training: bool, channels_last: bool
             ) -> list[Launch]:
    update = Launch("batch_norm_update_stats_and_invert" if training else "batch_norm_calc_invstd",
                    max(math.ceil(c / 128), 1), 128, 1, 16 * c)
    if channels_last:
        bx, by, gx, gy = _flexible(n * plane, c, coop=False)
        transform = Launch("batch_norm_transform_input_channels_last_kernel", gx * gy, bx * by,
                           math.ceil(n * plane / (by * gy * ELEMENTS_PER_ITER)), 2 * numel * element)
        if not training:
            return [update, transform]
        bx, by, gx, gy = _flexible(n * plane, c, coop=True)
        stats = Launch("batch_norm_collect_statistics_channels_last_kernel", gx * gy, bx * by,
                       math.ceil(n * plane / (by * gy * ELEMENTS_PER_ITER)) + (1 if gy > 1 else 0), numel * element)
        return [stats, update, transform]
    tf = _num_threads(plane)
    ty = max(1, MAX_BLOCK_SIZE // tf)
    # batch_norm_elemt_cuda_template: blocks of (channel, batch slice)
    tf_t = max(_num_threads(plane // 4), min(_num_threads(plane), 64))
    tb = max(64 // tf_t, 1)
    gy = min(max(1, min((256 * 1024) // c, math.ceil(n / tb))), MAX_GRID_SIZE)
    transform = Launch("batch_norm_transform_input_kernel", c * gy, tf_t * tb,
                       math.ceil(n / (tb * gy)) * math.ceil(plane / tf_t), 2 * numel * element)
    if not training:
        return [update, transform]
    stats = Launch("batch_norm_collect_statistics_kernel", c, tf * ty, math.ceil(n / ty) * math.ceil(plane / tf),
                   numel * element)
    return [stats, update, transform]


def _backward(n: int, c: int, plane: int, numel: int, element: int, channels_last: bool, input_grad: bool
              ) -> list[Launch]:
    if channels_last:
        bx, by, gx, gy = _flexible(n * plane, c, coop=True)
        reduce = Launch("batch_norm_backward_reduce_channels_last_kernel", gx * gy, bx * by,
                        math.ceil(n * plane / (by * gy * ELEMENTS_PER_ITER)) + (1 if gy > 1 else 0),
                        2 * numel * element)
        if not input_grad:
            return [reduce]
        bx, by, gx, gy = _flexible(n * plane, c, coop=False)
        elemt = Launch("batch_norm_backward_elemt_channels_last_kernel", gx * gy, bx * by,
                       math.ceil(n * plane / (by * gy * ELEMENTS_PER_ITER)), 3 * numel * element)
        return [reduce, elemt]
    tf = _num_threads(plane)
    ty = max(1, MAX_BLOCK_SIZE // tf)
    rounds = math.ceil(n / ty) * math.ceil(plane / tf)
    if not input_grad:  # batch_norm_backward_reduce_kernel alone (the sums: weight and bias gradients)
        threads = min(max(_num_threads(plane), 32), MAX_BLOCK_SIZE // min(_last_pow2(n), MAX_BLOCK_SIZE // 32))
        by = min(_last_pow2(n), MAX_BLOCK_SIZE // 32)
        return [Launch("batch_norm_backward_reduce_kernel", c, threads * by,
                       math.ceil(n / by) * math.ceil(plane / threads), 2 * numel * element)]
    # the fused kernel: the sums over input and gradient (both loaded at once), then the input's gradient, each
    # element loaded again (the plane of a block does not stay in cache between its passes: docs/guide/time.md)
    return [Launch("batch_norm_backward_kernel", c, tf * ty, 2 * rounds, 5 * numel * element)]


def launch_seconds(launch: Launch, sm_count: int, threads_per_sm: int, latency: float, bandwidth: float) -> float:
    """One launch's time, its launch overhead apart: the slower of its dependent load rounds (waves of the grid x rounds
    x latency) and its bytes at `bandwidth`."""
    resident = max(1, min(MAX_BLOCKS_PER_SM, threads_per_sm // max(launch.threads, 1)))
    waves = math.ceil(launch.blocks / (sm_count * resident))
    return max(waves * launch.rounds * latency, launch.bytes / bandwidth)


def conversion_bytes(node: NodeCost, element: int, copies: int) -> tuple[int, int]:
    """(bytes, kernels) of cuDNN's NCHW -> NHWC copies for one captured convolution op whose tensors are NCHW (see
    the module's docstring): `copies` per convolution call, each reading and writing one activation. A forward
    (aten.convolution / conv2d ...) converts its input; a convolution_backward its output's gradient for the input's
    gradient and its input for the weight's (a network's first layer computes the weight's alone). (0, 0) for other
    ops, channels-last ones, or a device that runs none (`copies` 0)."""
    if copies <= 0 or node.channels_last:
        return 0, 0
    name = aten_name(node.op)
    shapes = node.input_shapes
    if name == "convolution_backward" and len(shapes) >= 3 and len(shapes[1]) >= 4:
        tensors = [shapes[1]] if weight_gradient_only(node) else [shapes[0], shapes[1]]
    elif name in ("convolution", "conv1d", "conv2d", "conv3d", "_convolution", "cudnn_convolution") and shapes \
            and len(shapes[0]) >= 4:
        tensors = [shapes[0]]
    else:
        return 0, 0
    moved = sum(2 * math.prod(t) * element for t in tensors) * copies
    return moved, len(tensors) * copies


def _is_layer_norm(node: NodeCost) -> str | None:
    """"forward" or "backward" for torch's native layer norm ops, else None."""
    name = aten_name(node.op)
    return {"native_layer_norm": "forward", "native_layer_norm_backward": "backward"}.get(name)


def layer_norm_launches(node: NodeCost, element: int) -> tuple[int, int, int, int]:
    """(copy bytes, copies, reduction bytes, reductions) torch's CUDA layer norm adds to one captured op beyond the
    kernel its bytes count (see the module's docstring): a contiguous copy (read and written) of each input in
    `node.strided_inputs`, and for a backward that computes the weight's or the bias's gradient the GammaBetaBackward
    kernel (dY and X read again, 4-byte mean and rstd per row, the gradients written at the element size).
    (0, 0, 0, 0) for any other op. `element`: the input's bytes per element."""
    which = _is_layer_norm(node)
    if which is None or not node.input_shapes:
        return 0, 0, 0, 0
    copies = [i for i in node.strided_inputs if i < len(node.input_shapes) and node.input_shapes[i]]
    moved = sum(2 * math.prod(node.input_shapes[i]) * element for i in copies)
    if which == "forward" or len(node.input_shapes) < 4:
        return moved, len(copies), 0, 0
    x, stats = node.input_shapes[1], node.input_shapes[2]
    params = [s for s in node.output_shapes[1:] if s]
    if not params:
        return moved, len(copies), 0, 0
    rows = math.prod(stats) if stats else 1
    reduction = 2 * math.prod(x) * element + 2 * 4 * rows + sum(math.prod(s) for s in params) * element
    return moved, len(copies), reduction, 1
