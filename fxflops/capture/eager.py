"""The default method: the model's own forward, run once on fake tensors, every aten op recorded.

Parameters, buffers, tensor attributes and inputs are swapped for fake twins (shape, dtype, device;
no data, no arithmetic), so what gets counted is the code path eager execution takes: branches on
`torch.compiler.is_exporting()` / `is_compiling()` take their eager side. The model is not copied;
`isolation` restores it after the call.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.nn.parameter import UninitializedTensorMixin
from torch.utils._mode_utils import no_dispatch

from fxflops.capture.attribution import ModuleTracker, module_infos
from fxflops.capture.backward import GradOwners, ReplayRetry, differentiate, parameter_owners
from fxflops.capture.model_state import record_model_state
from fxflops.capture.dynamic import SizeSymbols
from fxflops.capture.torch_versions import is_device_mismatch
from fxflops.capture.flex import flex_runs_eagerly
from fxflops.capture.input_values import InputValues, Routing
from fxflops.capture.inputs import mark_inputs, refuse_lazy_output
from fxflops.capture.isolation import global_hooks_present, isolated
from fxflops.capture.meta_kernels import MetaKernels
from fxflops.capture.sharded import dtensor_twin, is_dtensor
from fxflops.capture.symbolic_cache import FIRST_SIGHT, CacheHits
from fxflops.capture.methods import EAGER
from fxflops.capture.reach import Reach
from fxflops.capture.recorder import CompositeOps, OpRecorder
from fxflops.capture.replay import Replays, verified_backward, verifying
from fxflops.capture.request import Request
from fxflops.capture.tensor_walk import iter_tensors, map_tensors, tensors_in
from fxflops.capture.module_walk import unique_modules
from fxflops.capture.twins import meta_twin, swap_tensors
from fxflops.results import Captured


def _symbolic_kernel() -> Callable[..., Any]:
    """capture.symbolic_kernels.symbolic_kernel, imported on use (a capture with named sizes)."""
    from fxflops.capture.symbolic_kernels import symbolic_kernel

    return symbolic_kernel


class FakeTwins:
    """Fake twins of real or meta tensors, one per tensor; meta ones land on `device` (a model built on
    the meta device runs as if on the CPU, so code that reads values' devices takes its usual path)."""

    def __init__(self, mode: FakeTensorMode, device: torch.device, shapes: dict[int, list[Any]] | None = None) -> None:
        self.mode = mode
        self.device = device
        self.shapes = shapes or {}  # id(tensor) -> the symbolic shape its twin gets
        self.meta_kernels = MetaKernels(mode)
        self.cache_hits = CacheHits(mode) if self.shapes else None
        # capture.symbolic_kernels' direct kernels, for named sizes only: imported on use, as a capture without
        # them never calls one
        self.symbolic_kernel = _symbolic_kernel() if self.shapes else None

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, FakeTensor) and not tensor.is_meta:
            return tensor
        if is_dtensor(tensor):  # a rank's shard: its local tensor gets the twin, the DTensor keeps its layout
            return dtensor_twin(tensor, self)
        device = self.device if tensor.is_meta else tensor.device
        if id(tensor) in self.shapes:
            return self._symbolic(tensor, self.shapes[id(tensor)], device)
        # built around a meta tensor directly: creating it through the mode's dispatch costs 10x more
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:  # (before the forward)
            meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
        else:
            with unset_fake_temporarily():  # twins made while the forward runs (lazy modules)
                meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
        fake = FakeTensor(self.mode, meta, device)
        if tensor.requires_grad:  # a trainable parameter, or an input the backward differentiates
            fake.requires_grad_(True)
        if isinstance(tensor, torch.nn.Parameter):
            # what nn.Parameter(fake) does for a tensor subclass, less its detach through the mode
            # (125 us per parameter): the twin is fresh, so it can carry the flag itself
            fake._is_param = True
        return fake

    def _symbolic(self, tensor: torch.Tensor, sizes: list[Any], device: torch.device) -> torch.Tensor:
        """A twin whose named axes are SymInts (the mode's shape env owns them): the meta tensor the mode's
        constructor makes, wrapped as it wraps it, past its dispatch (whose cache entry for the call, made and
        checked by building the tensor again, cost more than the tensor: ~3 ms of a first sweep capture).
        It keeps the example's memory layout (channels-last, a transposed input: what estimate() sees at every
        point), a dense one in its order of strides; any other layout is taken as contiguous."""
        with no_dispatch():
            order = _dense_order(tensor)
            if order is None:
                meta = torch.empty(sizes, dtype=tensor.dtype, device="meta")
            else:
                meta = torch.empty_permuted(sizes, order, dtype=tensor.dtype, device="meta")
        fake = FakeTensor(self.mode, meta, device)
        return fake.requires_grad_(True) if tensor.requires_grad else fake

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run an op on fake tensors, repairing the two ways a fake kernel can fail where eager runs."""
        try:
            out = self.meta_kernels(func, args, kwargs)
            if out is NotImplemented and self.shapes:  # named sizes: see capture.symbolic_kernels and _cache
                out = self.symbolic_kernel(func, args, kwargs)
                if out is NotImplemented:
                    out = self.cache_hits(func, args, kwargs)
        except Exception:  # noqa: BLE001 - the mode's own dispatch raises it again, in its words, or repairs it
            out = NotImplemented
        if out is FIRST_SIGHT:  # a call not met before in this capture: the mode runs it, making no cache entry
            with self.cache_hits.uncached():
                return self._through_mode(func, args, kwargs)
        if out is not NotImplemented:
            return out
        return self._through_mode(func, args, kwargs)

    def _through_mode(self, func: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return run_relaxing_dtype(func, args, kwargs)
        except RuntimeError as error:
            # a meta tensor without a twin (one tucked inside a container attribute) met the twins:
            # it gets one, on the device the model runs on, and the op runs again
            if not is_device_mismatch(error) or not any(_is_meta(tensor) for tensor in tensors_in((args, kwargs))):
                raise
            lift = lambda t: self(t) if _is_meta(t) else t  # noqa: E731
            return run_relaxing_dtype(func, map_tensors(args, lift), map_tensors(kwargs, lift))


# how a meta kernel's refusal names the dtype it wants: "BFloat16 or supported Float16" (newer torch's
# _grouped_mm), "Expected inputs of BF16 type" (torch 2.11's)
_HALF_DTYPE_NAMES = ("Float16", "BF16")


def run_relaxing_dtype(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run an op on fake tensors; if its fake kernel refuses the floating dtype, shape it in bfloat16.

    Some meta kernels are stricter than the device kernels they stand for (aten._grouped_mm's demands
    bfloat16 while the CPU kernel takes float32), which would make the eager path uncapturable. Output
    shapes do not depend on the floating dtype: the op is shaped in bfloat16 and its floating outputs
    get the dtype the real kernel gives them back.
    """
    try:
        return _shape_kernel(func, args)(*args, **kwargs)
    except RuntimeError as error:
        floating = [t for t in tensors_in((args, kwargs)) if t.is_floating_point() and t.dtype != torch.bfloat16]
        if not floating or not any(name in str(error) for name in _HALF_DTYPE_NAMES):
            raise
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in floating])
        relax = lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t  # noqa: E731
        try:
            out = func(*map_tensors(args, relax), **map_tensors(kwargs, relax))
        except RuntimeError:
            raise error from None
        return map_tensors(out, lambda t: t.to(dtype) if t.dtype == torch.bfloat16 else t)


def _shape_kernel(func: Any, args: tuple) -> Any:
    """The kernel that shapes `func` on fake tensors: aten's, but torch's Python reference for ops whose
    C++ kernel pins every symbolic size to its example value (constant_pad_nd: the F.pad in
    transformers' causal-LM loss), which would make a sweep hold at its example point only."""
    if func is torch.ops.aten.constant_pad_nd.default and any(
            isinstance(size, torch.SymInt) for size in getattr(args[0], "shape", ())):
        from torch import _refs

        return _refs.constant_pad_nd
    return func


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta and not isinstance(value, UninitializedTensorMixin)


def _target_device(model: torch.nn.Module, args: Any, kwargs: Any) -> torch.device:
    for tensor in itertools.chain(iter_tensors((args, kwargs)), model.parameters(), model.buffers()):
        if not isinstance(tensor, UninitializedTensorMixin) and not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")


def capture(request: Request) -> Captured:
    replaying = request.replay and not global_hooks_present()
    if not replaying:
        return _capture(request, False)
    if not request.backward:
        try:
            return _capture(request, True)
        except ReplayRetry:  # a call on an object handed to a copy did not do what its reference's did
            return _capture(request, False)
    if request.prepare is not None or _has_own_pre_hooks(request.model):
        # a parallel plan's capture: its blocks' backward runs (a capture that would have to run again could
        # not apply the plan a second time: FSDP keeps each module's state in torch's own global table);
        # modules with forward pre-hooks of their own (an expert-parallel dispatch): what their forward
        # received is recorded at every call (the meter reads it, timing.routed), which copies would skip
        return _capture(request, replaying, backward_replay=False)
    if verifying():  # a backward's copies checked against a capture that runs every call: that one is returned
        try:
            replayed = _capture(request, True, verify=False)
        except ReplayRetry:  # (nothing to check: the capture would run again without replay)
            return _capture(request, False)
        return verified_backward(replayed, _capture(request, False))
    try:
        return _capture(request, True)
    except ReplayRetry:  # a replayed block's backward met what only a full capture places right
        return _capture(request, False)


def _capture(request: Request, replaying: bool, verify: bool | None = None, backward_replay: bool = True) -> Captured:
    model = request.model
    sizes = SizeSymbols(request.sizes) if request.sizes is not None else None
    # static_shapes: only the planned axes are symbolic, not those of a stray real tensor the forward meets
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=sizes.env if sizes else None,
                          static_shapes=True if sizes else None)
    twins = FakeTwins(mode, _target_device(model, request.args, request.kwargs), _symbolic_shapes(request, sizes))
    inputs = Reach((request.args, request.kwargs))
    # (a user's global module hook must see every module call: no replay then)
    with isolated(model, inputs) as modules, _quiet_about_symbolic_args(sizes is not None):
        if request.prepare is not None:
            _prepared(model, modules, request.prepare, twins)
        else:
            swap_tensors(modules, twins)
        owners = GradOwners(parameter_owners(model)) if request.backward else None
        copying = replaying and (backward_replay or owners is None)
        tracker = ModuleTracker(model, is_whole=request.is_whole, phase=owners.phase if owners else None,
                                forward_inputs=not copying)
        # values the forward reads come from the real inputs (named sizes: the capture is shapes only)
        values = InputValues(mode, twins.run, tracker, type(model).__name__, Routing.of(request.routing)) \
            if sizes is None else None
        args, kwargs = inputs.with_twins(values.twin_input(twins) if values is not None else twins)
        recorder = OpRecorder(tracker, type(model).__name__, run=values.run if values is not None else twins.run,
                              owners=owners)
        replays = Replays(model, recorder, tracker, mode, owners, verify) if copying else None
        grad_mode = torch.enable_grad() if request.backward else torch.no_grad()
        with grad_mode, _conv_kernel_choice_fixed(sizes is not None), flex_runs_eagerly(), mode, tracker, recorder, \
                CompositeOps(recorder, request.knows_op, symbolic=sizes is not None), _sizes_named_in_errors(sizes), \
                values.numpy_reads() if values is not None else contextlib.nullcontext():
            if owners is not None:
                owners.start()
            if replays is not None:
                replays.install()
            output = refuse_lazy_output(model(*args, **kwargs))
            if owners is not None:
                differentiate(output, request.loss, owners, recorder.unrecorded)
        graph_module = recorder.finish(output)
        mark_inputs(graph_module, (args, kwargs))  # the twins: which placeholder is which input
        record_model_state(graph_module, modules, owners.seeds if owners is not None else None,  # for memory
                           tensors_in((args, kwargs)))
        infos, aliases = module_infos(model)
    return Captured(graph_module, EAGER.name, infos, aliases, tracker.calls, request.whole_paths(),
                    tracker.whole_calls, backward=request.backward, sizes=sizes,
                    cautions=[*recorder.cautions, *(values.cautions if values is not None else ())],
                    forward_inputs=tracker.forward_inputs)


def _has_own_pre_hooks(model: torch.nn.Module) -> bool:
    """Whether a module of `model` has forward pre-hooks of its own."""
    return any(module._forward_pre_hooks for module in model.modules())


def _prepared(model: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]], prepare: Any,
              twins: FakeTwins) -> None:
    """`prepare(model)` (a parallel plan) run on plain meta twins of the model's tensors, which then get
    their fake twins, the shards' local tensors theirs (DTensor's layout kept).

    A plan shards with torch's own code: parallelize_module chunks each parameter tp ways, fully_shard
    dp ways, to take this rank's piece. On fake tensors every piece is made through the fake mode (a
    128-way chunk of one parameter took 4 ms, 60x a meta tensor's), so a plan cost time in proportion to
    the world size; on meta tensors (torch's own meta-device initialization, as torchtitan shards a model
    built on meta) it is C++ alone. fully_shard keeps its own references to the shards it made; its lazy
    initialization on the first forward (FSDPParam.reset_sharded_param, the route torch gives to
    parameters swapped after fully_shard: load_state_dict(assign=True), to_empty) takes the fake twins the
    modules now hold and pads them as it pads its own, so the forward runs the ops it runs on shards
    made fake."""
    swap_tensors(modules, _plan_twin)
    prepare(model)
    # the plan may register modules (expert parallelism's stand-ins for other ranks' experts): all of them
    swap_tensors(unique_modules(model), twins)


def _dense_order(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The dims of a dense, non-contiguous tensor from the outermost in memory to the innermost (what
    torch.empty_permuted lays out again at other sizes: channels-last is (0, 2, 3, 1)); None for a contiguous
    tensor, and for one whose strides that order does not give back (overlapping, gaps)."""
    if tensor.is_contiguous():
        return None
    strides = tensor.stride()
    order = tuple(sorted(range(tensor.dim()), key=lambda dim: (-strides[dim], dim)))
    with no_dispatch():
        again = torch.empty_permuted(tuple(tensor.shape), order, device="meta").stride()
    sized = [dim for dim in range(tensor.dim()) if tensor.shape[dim] != 1]  # a size-1 dim's stride says nothing
    return order if all(again[dim] == strides[dim] for dim in sized) else None


def _plan_twin(tensor: torch.Tensor) -> torch.Tensor:
    """A meta twin that, like the fake twin it becomes, keeps the flag of a buffer or tensor attribute the
    backward differentiates (meta_twin keeps a parameter's only): the gradients flowing to it are counted."""
    twin = meta_twin(tensor)
    return twin.requires_grad_(True) if tensor.requires_grad and not twin.requires_grad else twin


def _symbolic_shapes(request: Request, sizes: SizeSymbols | None) -> dict[int, list[Any]]:
    if sizes is None:
        return {}
    inputs = tensors_in((request.args, request.kwargs))
    found = {id(tensor): sizes.sizes(index, tensor) for index, tensor in enumerate(inputs)}
    return {key: shape for key, shape in found.items() if shape is not None}


@contextlib.contextmanager
def _conv_kernel_choice_fixed(symbolic: bool) -> Iterator[None]:
    """Under named sizes, CPU convolutions keep to their native kernel (oneDNN and NNPACK off).

    A fake convolution asks torch which CPU kernel would run (torch._C._select_conv_backend) to give its
    output that kernel's memory format. The choice reads sizes: NNPACK needs batch >= 16, oneDNN is
    picked by channels x area thresholds (64*h*w <= 20480 ...), so each became a guard that split a
    ResNet-50 sweep over batch 1..64 and sizes 33..517 into a piece per region. None of them changes a
    count: a rule reads shapes, dtypes and arguments, never strides (formulas have .shape and .ndim
    only), and for these kernels the memory format follows the input's and weight's own layout, so
    the same ops run either way (the sweep tests check at() against estimate(), bytes included)."""
    if not symbolic:
        yield
        return
    # the flags' own setters, not torch.backends.mkldnn.flags(): that one also rewrites the TF32 and fp32
    # precision settings, and warns about TF32 on Intel GPUs while doing so
    mkldnn, nnpack = torch._C._get_mkldnn_enabled(), torch._C._get_nnpack_enabled()
    torch._C._set_mkldnn_enabled(False)
    torch._C._set_nnpack_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(mkldnn)
        torch._C._set_nnpack_enabled(nnpack)


@contextlib.contextmanager
def _sizes_named_in_errors(sizes: SizeSymbols | None) -> Iterator[None]:
    """A failing op's message names sizes as the user does ("got seq channels"), not as s25."""
    try:
        yield
    except Exception as error:
        if sizes is not None and error.args and isinstance(error.args[0], str):
            error.args = (sizes.translate(error.args[0]), *error.args[1:])
        raise


@contextlib.contextmanager
def _quiet_about_symbolic_args(symbolic: bool) -> Iterator[None]:
    """FX warns about every raw SymInt argument a node gets; recorded nodes keep theirs on purpose
    (the count stage reads sizes from them)."""
    if not symbolic:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Raw SymInt value", category=UserWarning)
        yield
