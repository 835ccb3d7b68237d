"""The optimizer step timed as the kernels its implementation launches.

A fused optimizer (Apex's and DeepSpeed's FusedAdam, Megatron-LM's distributed optimizer, torch's `fused=True`)
streams each parameter's state, gradient and parameter through memory once. torch.optim's default on CUDA, the
`foreach` implementation (`_multi_tensor_adam`, `_multi_tensor_sgd`), launches one multi-tensor kernel per tensor
operation instead (weight decay, lerp, mul, addcmul, sqrt, div, add, addcdiv for AdamW), each reading and writing
its operands in full; the single-tensor `for_loop` implementation runs the same operations one parameter at a time.

The passes below were read from torch 2.14.1's torch/optim/adam.py (`_multi_tensor_adam`, `_single_tensor_adam`,
`_fused_adam`) and sgd.py (`_multi_tensor_sgd`, `_single_tensor_sgd`, `_fused_sgd`), for a step after the first
(the state exists). Each pass counts the elements it reads and writes per parameter element, by kind: the
parameter, the gradient (or a gradient-like temporary) and the optimizer state (exp_avg, exp_avg_sq, the momentum
buffer, or a temporary like them: `_foreach_sqrt`'s output). `addcmul_(v, g, g)` reads the gradient once from
memory (its second load of the same element is a cache hit). The per-tensor scalars of `capturable=True` (the step
counter, bias corrections on the device) are kernels of negligible bytes, counted as launches.

Launches: torch's multi_tensor_apply (ATen/native/cuda/MultiTensorApply.cuh) splits each tensor into chunks of
kChunkSize = 65,536 elements and launches a kernel when 320 chunks (depth_to_max_blocks) or 110 / 64 / 48 / 36 / 30
tensors (depth_to_max_tensors, by the number of tensor lists; 96 for depth 1 with a scalar list) are filled: torch
2.11 + CUDA 13 as measured (41 launches a kernel for an 852.6M-element Llama on an H200 and an H100,
benchmarks/results/gpu/h200_run7.json, h100_run1.json) and torch 2.14.1's builds before CUDA 13; its CUDA-13 builds
raise them to 2,240 chunks and 770 / 448 / 336 / 252 / 210 tensors (not modelled: fewer launches, a few us less).
Launches are counted from the elements and the parameter tensors (chunks taken as elements / 65,536: each tensor's
partial last chunk is not counted). The single-tensor loop launches one kernel per operation per parameter tensor.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from fxflops.predict.hardware import DeviceModel, device_model
from fxflops.predict.step_memory import OPTIMIZER_STATE_BYTES

FUSED, FOREACH, FOR_LOOP = "fused", "foreach", "for_loop"
IMPLEMENTATIONS = (FUSED, FOREACH, FOR_LOOP)
OPTIMIZERS = ("adam", "adamw", "sgd")
TORCH_SOURCE = "torch 2.14.1, torch/optim/adam.py and sgd.py"
CHUNK_ELEMENTS = 65536  # kChunkSize
MAX_CHUNKS = 320  # depth_to_max_blocks (torch 2.11 + cu130 as measured; torch 2.14.1's CUDA-13 builds: 2,240)
MAX_TENSORS = (110, 64, 48, 36, 30)  # depth_to_max_tensors by depth
MAX_TENSORS_SCALAR_LIST = (96, 64, 48, 36, 30)  # depth_to_max_tensors_scalarlist
LAUNCH_SOURCE = ("ATen/native/cuda/MultiTensorApply.cuh: kChunkSize 65,536 elements, depth_to_max_blocks 320, "
                 "depth_to_max_tensors 110/64/48/36/30 (torch 2.11 + CUDA 13 as measured: 41 launches a kernel for "
                 "852.6M elements; torch 2.14's CUDA-13 builds: 2,240 and 770/448/336/252/210)")
MASTER_FUSED_SOURCE = ("one fused kernel: the state (fp32 master weights and moments) read and written, the "
                       "gradient read, the parameter written (the fused Adam of mixed-precision trainers: Apex's "
                       "FusedAdam, Megatron-LM's optimizer)")


@dataclass(frozen=True)
class Pass:
    """One tensor operation of an optimizer step: elements read + written per parameter element, by kind."""

    op: str  # the torch call, as the source writes it
    param: int = 0
    grad: int = 0
    state: int = 0
    depth: int = 1  # tensor lists of its multi_tensor_apply launch
    scalar_list: bool = False  # a per-tensor scalar list (TensorListScalarListMetadata)

    def bytes(self, param_bytes: int, grad_bytes: int, state_bytes: int) -> int:
        return self.param * param_bytes + self.grad * grad_bytes + self.state * state_bytes

    @property
    def max_tensors(self) -> int:
        return (MAX_TENSORS_SCALAR_LIST if self.scalar_list else MAX_TENSORS)[self.depth - 1]


@dataclass(frozen=True)
class OptimizerKernels:
    """The kernels one optimizer step launches: `passes` over every parameter element and `scalar_kernels` over
    the per-tensor step scalars (capturable), with the state tensors it keeps per parameter (`state_tensors`:
    exp_avg and exp_avg_sq for Adam, the momentum buffer for SGD). `optimizer` None: the mixed-precision fused
    Adam of fxflops' default, one kernel over `optimizer_state_bytes` of state."""

    optimizer: str | None
    implementation: str
    passes: tuple[Pass, ...]
    state_tensors: int = 0
    scalar_kernels: int = 0
    options: tuple[tuple[str, Any], ...] = ()
    # an instance's param groups when it has several: (share of the parameter elements, share of the parameter
    # tensors, the group's kernels) each. torch steps each group with its own options (weight_decay 0 for biases
    # and norms, as Hugging Face's Trainer builds them) in its own call, so its own launches; `passes` then are the
    # first group's, and the bytes and launches are the groups'
    groups: tuple[tuple[float, float, OptimizerKernels], ...] = ()

    @property
    def label(self) -> str:
        if self.optimizer is None:
            return "fused (mixed-precision Adam)"
        if self.groups:
            shares: dict[str, float] = {}  # groups of the same kernels (a group per layer) shown once
            for share, _, group in self.groups:
                shares[group.label] = shares.get(group.label, 0.0) + share
            return f"{len(self.groups)} param groups: " + ", ".join(f"{label} on {share:.1%} of the elements"
                                                                   for label, share in shares.items())
        shown = ", ".join(f"{k}={v}" for k, v in self.options)
        return f"{self.optimizer} {self.implementation}" + (f" ({shown})" if shown else "")

    @property
    def source(self) -> str:
        return MASTER_FUSED_SOURCE if self.optimizer is None else TORCH_SOURCE + "; launches: " + LAUNCH_SOURCE

    def bytes_per_element(self, param_bytes: int, grad_bytes: int, state_bytes: int) -> int:
        """Bytes every pass moves per parameter element (`state_bytes`: one state tensor's element); over several
        param groups, their mean weighted by the groups' elements."""
        if self.groups:
            return sum(share * group.bytes_per_element(param_bytes, grad_bytes, state_bytes)
                       for share, _, group in self.groups)
        return sum(p.bytes(param_bytes, grad_bytes, state_bytes) for p in self.passes)

    def launches(self, elements: float, tensors: int) -> int:
        """Kernel launches for `elements` over `tensors` parameter tensors (0: unknown, the chunk bound only); over
        several param groups, each group's over its share of both."""
        if elements <= 0:
            return 0
        if self.groups:
            return sum(group.launches(elements * share, math.ceil(tensors * tensor_share - 1e-9))
                       for share, tensor_share, group in self.groups)
        if self.optimizer is None:
            return 1  # fxflops' default: one kernel for the step
        if self.implementation == FOR_LOOP:
            return (len(self.passes) + self.scalar_kernels) * max(tensors, 1)
        chunks = math.ceil(elements / CHUNK_ELEMENTS)
        by_chunks = math.ceil(chunks / MAX_CHUNKS)
        count = sum(max(by_chunks, math.ceil(tensors / p.max_tensors)) for p in self.passes)
        # the scalar kernels touch one element a tensor: one chunk each, bounded by the tensor count
        return count + self.scalar_kernels * max(1, math.ceil(tensors / MAX_TENSORS[0]))

    def seconds(self, elements: float, tensors: int, param_bytes: int, grad_bytes: int, state_bytes: int,
                device: DeviceModel | str) -> float:
        """Seconds of the step over `elements` parameter elements: bytes at the device's sustained bandwidth plus
        one launch overhead per kernel launched."""
        if elements <= 0:
            return 0.0
        device = device_model(device)
        moved = elements * self.bytes_per_element(param_bytes, grad_bytes, state_bytes)
        return moved / device.sustained + self.launches(elements, tensors) * device.launch_overhead

    def describe(self, param_bytes: int, grad_bytes: int, state_bytes: int) -> str:
        """The step in words for the prediction's notes: implementation, passes, bytes per element, source."""
        total = self.bytes_per_element(param_bytes, grad_bytes, state_bytes)
        if self.optimizer is None:
            return (f"optimizer step timed as one fused kernel: {total} B per parameter element ({state_bytes} B of "
                    f"state read and written, {grad_bytes} B gradient read, {param_bytes} B parameter written: the "
                    "fused Adam of mixed-precision trainers, Apex's FusedAdam, Megatron-LM's optimizer)")
        if self.groups:  # each distinct group's kernels once (a group per layer repeats them)
            each = {group.label: group.describe(param_bytes, grad_bytes, state_bytes).removeprefix(
                "optimizer step timed as torch.optim's ") for _, _, group in self.groups}
            return (f"optimizer step timed as torch.optim's {self.label}: {total:.1f} B per parameter element in all, "
                    f"each group its own step call and launches; " + "; ".join(each.values()))
        ops = ", ".join(f"{p.op} {p.bytes(param_bytes, grad_bytes, state_bytes)}" for p in self.passes)
        scalars = f", {self.scalar_kernels} kernels over the per-tensor step scalars" if self.scalar_kernels else ""
        launched = "one launch per pass per parameter tensor" if self.implementation == FOR_LOOP else \
            "multi-tensor launches of up to 320 chunks of 65,536 elements"
        return (f"optimizer step timed as torch.optim's {self.label}: {len(self.passes)} passes of {total} B per "
                f"parameter element in all ({ops}; parameter {param_bytes} B, gradient {grad_bytes} B, state "
                f"{state_bytes} B){scalars}, {launched} ({TORCH_SOURCE}"
                + ("" if self.implementation == FOR_LOOP else f"; {LAUNCH_SOURCE}") + ")")


MASTER_FUSED = OptimizerKernels(None, FUSED, (Pass("fused step", param=1, grad=1, state=2, depth=4),))


def _adam_passes(decoupled: bool, weight_decay: float, amsgrad: bool, maximize: bool, capturable: bool,
                 implementation: str) -> tuple[tuple[Pass, ...], int]:
    """(passes, scalar kernels) of torch's Adam / AdamW step."""
    if implementation == FUSED:  # _fused_adam: _foreach_add_(state_steps, 1), then _fused_adam(w)_ in one kernel
        state = 3 if amsgrad else 2
        return (Pass("_fused_adam(w)_", param=2, grad=1, state=2 * state, depth=4 + int(amsgrad)),), 1
    passes = []
    if maximize:  # grads = _foreach_neg(grads) (the loop: -grads[i])
        passes.append(Pass("neg(grad)", grad=2, depth=2))
    if weight_decay:
        if decoupled:
            passes.append(Pass("mul_(param)", param=2, depth=1))
        else:  # grads = _foreach_add(grads, params, alpha=wd) (in place on the negated copy under maximize)
            passes.append(Pass("add(grad, param)", param=1, grad=2, depth=2 if maximize else 3))
    passes += [Pass("lerp_(exp_avg, grad)", grad=1, state=2, depth=2),
               Pass("mul_(exp_avg_sq)", state=2, depth=1),
               Pass("addcmul_(exp_avg_sq, grad, grad)", grad=1, state=2, depth=3)]
    if amsgrad:  # _foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        passes.append(Pass("maximum_(max_exp_avg_sq, exp_avg_sq)", state=3, depth=2))
    passes += [Pass("sqrt(exp_avg_sq)", state=2, depth=2),
               Pass("div_(denom)", state=2, depth=1, scalar_list=not capturable),
               Pass("add_(denom, eps)", state=2, depth=1)]
    if capturable:  # the step size a tensor: foreach divides denom by it (the loop folds it into its div and add_),
        # then addcdiv_ without a scalar
        if implementation == FOREACH:
            passes.append(Pass("div_(denom, step_size)", state=2, depth=2))
        passes.append(Pass("addcdiv_(param, exp_avg, denom)", param=2, state=2, depth=3))
    else:
        passes.append(Pass("addcdiv_(param, exp_avg, denom)", param=2, state=2, depth=3, scalar_list=True))
    scalars = 0
    if capturable:
        # foreach: add_(steps), pow x2, sub_ x2, neg_, div_, reciprocal_, sqrt_; the loop: step += 1, beta ** step x2,
        # 1 - x2, lr / bc1, neg, sqrt, bc2_sqrt * step_size_neg, eps / step_size_neg
        scalars = 9 if implementation == FOREACH else 10
    return tuple(passes), scalars


def _sgd_passes(weight_decay: float, momentum: float, nesterov: bool, maximize: bool,
                implementation: str) -> tuple[Pass, ...]:
    """Passes of torch's SGD step (momentum buffers existing: a step after the first)."""
    if implementation == FUSED:  # _fused_sgd_: parameter, gradient and momentum buffer in one kernel
        return (Pass("_fused_sgd_", param=2, grad=1, state=2 if momentum else 0, depth=3 if momentum else 2),)
    passes = []
    if maximize:
        passes.append(Pass("neg(grad)", grad=2, depth=2))
    if weight_decay:
        passes.append(Pass("add(grad, param)", param=1, grad=2, depth=2 if maximize else 3))
    if momentum:
        passes += [Pass("mul_(momentum_buffer)", state=2, depth=1),
                   Pass("add_(momentum_buffer, grad)", grad=1, state=2, depth=2)]
        if nesterov:
            passes.append(Pass("add_(grad, momentum_buffer)", grad=2, state=1, depth=2))
            passes.append(Pass("add_(param, grad)", param=2, grad=1, depth=2))
        else:
            passes.append(Pass("add_(param, momentum_buffer)", param=2, state=1, depth=2))
    else:
        passes.append(Pass("add_(param, grad)", param=2, grad=1, depth=2))
    return tuple(passes)


def optimizer_kernels(optimizer: Any, implementation: str | None = None) -> OptimizerKernels:
    """The kernels of one step of `optimizer` ("adam", "adamw" or "sgd" with torch's defaults, or a
    torch.optim.Adam / AdamW / SGD instance, read from its param groups: several groups of trainable parameters
    each their own kernels, `groups`) under `implementation` ("fused", "foreach" or "for_loop"; None: each group's
    `fused` / `foreach`, else torch's default on CUDA, foreach)."""
    from fxflops.memory.optimizer_state import _name_and_options

    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"optimizer_impl={implementation!r}: pick one of {', '.join(IMPLEMENTATIONS)}")
    name, options = _name_and_options(optimizer)
    groups = [(group, [p for p in group["params"] if p.requires_grad])  # torch steps only what has a gradient
              for group in getattr(optimizer, "param_groups", [])]
    groups = [(group, params) for group, params in groups if params]
    if len(groups) == 1:  # the one group's options (torch fills in the defaults it does not set)
        options = {**options, **{k: v for k, v in groups[0][0].items() if k != "params"}}
    elif groups:
        elements = [sum(p.numel() for p in params) for _, params in groups]
        tensors = [len(params) for _, params in groups]
        if sum(elements):
            each = tuple((n / sum(elements), t / sum(tensors),
                          _kernels(name, {**options, **group}, implementation))
                         for n, t, (group, _) in zip(elements, tensors, groups))
            kinds = {group.implementation for _, _, group in each}
            return dataclasses.replace(each[0][2], implementation=kinds.pop() if len(kinds) == 1 else "mixed",
                                       state_tensors=max(group.state_tensors for _, _, group in each),
                                       options=(), groups=each)
    return _kernels(name, options, implementation)


def _kernels(name: str, options: dict[str, Any], implementation: str | None) -> OptimizerKernels:
    """The kernels of one step of `name` with one param group's `options`."""
    if implementation is None:  # torch's _default_to_fused_or_foreach: a differentiable step runs the loop
        implementation = FUSED if options.get("fused") else FOR_LOOP \
            if options.get("foreach") is False or options.get("differentiable") else FOREACH
    weight_decay = float(options.get("weight_decay", 0) or 0)
    maximize = bool(options.get("maximize", False))
    shown = {"weight_decay": weight_decay, "maximize": maximize}
    if name == "sgd":
        momentum, nesterov = float(options.get("momentum", 0) or 0), bool(options.get("nesterov", False))
        passes, scalars, states = _sgd_passes(weight_decay, momentum, nesterov, maximize, implementation), 0, \
            int(bool(momentum))
        shown.update(momentum=momentum, nesterov=nesterov)
    else:
        amsgrad, capturable = bool(options.get("amsgrad", False)), bool(options.get("capturable", False))
        decoupled = bool(options.get("decoupled_weight_decay", name == "adamw"))
        passes, scalars = _adam_passes(decoupled, weight_decay, amsgrad, maximize, capturable, implementation)
        states = 3 if amsgrad else 2
        shown.update(amsgrad=amsgrad, capturable=capturable)
    kept = tuple((k, v) for k, v in shown.items() if v)  # the options that change the kernels, when set
    return OptimizerKernels(name, implementation, passes, states, scalars, kept)


def element_bytes(kernels: OptimizerKernels, optimizer_state_bytes: int, param_bytes: int) -> int:
    """Bytes of one element of the tensors torch.optim steps (its parameters, and its state: torch keeps it like
    the parameters). `optimizer_state_bytes` (what the memory per rank counts) says which: n state tensors x the
    model's `param_bytes` (the model's own parameters), or (n + 1) x 4 (fp32 copies, counted with the state as
    master weights: FSDP2's fp32 sharded parameters under bf16 compute)."""
    n = kernels.state_tensors
    if optimizer_state_bytes == n * param_bytes:
        return param_bytes
    if optimizer_state_bytes == (n + 1) * 4:
        return 4
    raise ValueError(f"optimizer_state_bytes={optimizer_state_bytes} does not describe torch.optim's {kernels.label}: "
                     f"it keeps {n} state tensor(s) like the parameters it steps, so give {n * param_bytes} (the "
                     f"model's {param_bytes}-byte parameters) or {(n + 1) * 4} (fp32 copies as master weights)")


def resolve(optimizer: Any, implementation: str | None, optimizer_state_bytes: int | None, param_bytes: int,
            caller: str) -> tuple[OptimizerKernels | None, int]:
    """(the optimizer step's kernels, its state bytes per parameter element) from a caller's settings: no
    `optimizer` is the one fused pass over `optimizer_state_bytes` (default OPTIMIZER_STATE_BYTES: Adam with fp32
    master weights) and no kernels; a torch.optim one (name or instance) is its `implementation`'s kernels over its state
    tensors kept like the parameters (`param_bytes` each), or the (n + 1) x 4 of fp32 copies if given so. Settings
    torch.optim cannot hold are refused by `caller`'s name before anything is captured."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{caller}: optimizer_impl={implementation!r}: pick one of {', '.join(IMPLEMENTATIONS)}")
    if optimizer is None and implementation not in (None, FUSED):
        raise ValueError(f"{caller}: optimizer_impl={implementation!r} times torch.optim's own kernels: name the "
                         "optimizer too (optimizer='adamw', 'adam', 'sgd' or a torch.optim instance)")
    if optimizer is None:
        return None, OPTIMIZER_STATE_BYTES if optimizer_state_bytes is None else optimizer_state_bytes
    kernels = optimizer_kernels(optimizer, implementation)
    if optimizer_state_bytes is None:  # torch.optim: its state tensors like the model's parameters
        return kernels, kernels.state_tensors * param_bytes
    element_bytes(kernels, optimizer_state_bytes, param_bytes)  # refuses what torch.optim cannot hold
    return kernels, optimizer_state_bytes
