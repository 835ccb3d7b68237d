"""DeepSpeed Flops Profiler API on top of fxflops: `get_model_profile`, `FlopsProfiler`, `get_accelerator`.

Same signatures and return values as `deepspeed.profiling.flops_profiler`, so code written for it
runs unchanged. What differs is underneath: the numbers come from a traced graph and the rule
table (no torch function is patched), latency from hooks that synchronize once per step, and
the model gets no attributes; every hook is removed by `stop_profile()` / `end_profile()`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fxflops.api import deep_models
from fxflops.integrations.deepspeed_profiler import FlopsProfiler, fold_ignored, print_profile_report
from fxflops.report.formats import macs_to_string, number_to_string, params_to_string
from fxflops.timing.generate import profile_generate
from fxflops.timing.placement import model_device
from fxflops.timing.preserving import preserved
from fxflops.timing.profiling import profile

# FlopsProfiler and print_profile_report live in deepspeed_profiler; this is their documented public path
__all__ = ["Accelerator", "FlopsProfiler", "get_accelerator", "get_model_profile", "print_profile_report"]


@functools.partial(deep_models, also=inspect.signature(profile).parameters)  # **options go on to profile()
def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Any = [],  # noqa: B006 - DeepSpeed's signature; never mutated
    kwargs: dict[str, Any] = {},  # noqa: B006 - DeepSpeed's signature; never mutated
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int | None = None,
    warm_up: int | None = None,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: list[type] | None = None,
    mode: str = "forward",
    func_name: str | None = None,
    *,
    input_res: tuple[int, ...] | None = None,
    input_constructor: Callable[[Any], Any] | None = None,
    print_aggregated_profile: bool | None = None,
    as_strings: bool | None = None,
    num_steps: int | None = None,
    **options: Any,
) -> tuple[Any, ...]:
    """DeepSpeed's `get_model_profile`: returns (flops, macs, params), as strings when `as_string`.

    `input_shape` builds one input tensor of that shape (in the model's dtype and device);
    otherwise `args`/`kwargs` are the inputs. `mode` is "forward" or "generate"
    (`model.generate(...)`); `func_name` is DeepSpeed's older name for it. Modules of the types in
    `ignore_modules` are not timed and their own cost is reported on their parent, as in DeepSpeed.
    Like DeepSpeed, the profile runs in eval mode, but the model's training flags are restored
    afterwards. `options` go to `fxflops.profile` (steps, device, peak_flops, conventions, ...);
    one timed step and one warm-up by default, and the top module per depth.

    DeepSpeed's older calls are recognised by their keywords and return what they returned. With
    `input_res=` (the input's whole shape, also accepted in input_shape's place) and optionally
    `input_constructor=` (called with input_res; a dict is passed as keywords), as from 0.3.12 to 0.5.9:
    (macs, params), top 3 modules. With any of 0.3.11's `print_aggregated_profile=`, `as_strings=`,
    `num_steps=`: (macs, params, steps), with its defaults (5 warm-ups, 10 timed steps). DeepSpeed 0.5.10
    returned (flops, macs, params) for the same keywords as 0.5.9; call it with input_shape= instead.
    """
    v0311 = [name for name, value in (("print_aggregated_profile", print_aggregated_profile),
                                      ("as_strings", as_strings), ("num_steps", num_steps)) if value is not None]
    older = bool(v0311) or input_res is not None or input_constructor is not None
    if older:
        if input_res is None and input_shape is not None and not args and not kwargs:
            input_res, input_shape = input_shape, None  # passed positionally, as DeepSpeed's examples do
        if input_shape is not None or args or kwargs:
            raise ValueError("input_res= belongs to DeepSpeed's older call, which takes its inputs from input_res "
                             "(and input_constructor); give those instead of input_shape/args/kwargs")
        args, kwargs = _older_inputs(model, input_res, input_constructor)
        top_modules = 3 if top_modules is None else top_modules
        if v0311:
            aggregated = print_aggregated_profile is not False  # 0.3.11 printed it by default
            options["steps"] = 10 if num_steps is None else num_steps
            warm_up = 5 if warm_up is None else warm_up
            detailed = detailed and print_profile
            print_profile = print_profile or aggregated
            top_modules = top_modules if aggregated else 0
            as_string = as_string if as_strings is None else as_strings
    mode = func_name or mode
    if mode not in ("forward", "generate"):
        raise ValueError(f"mode must be 'forward' or 'generate', got {mode!r}")
    if input_shape is not None:
        args = [_input_of_shape(model, input_shape)]
    if not args and not kwargs:
        raise ValueError("give input_shape, args or kwargs")
    warm_up = 1 if warm_up is None else warm_up
    skip = tuple(ignore_modules or ())
    options.setdefault("steps", 1)
    with preserved(model, model_device(model)):
        model.eval()
        if mode == "generate":
            result = profile_generate(model, args, kwargs, warm_up=warm_up, skip_types=skip, **options)
        else:
            result = profile(model, args, kwargs, warm_up=warm_up, skip_types=skip, **options)
    fold_ignored(result, model, skip)
    if print_profile:
        print_profile_report(result, profile_step=warm_up, module_depth=module_depth,
                             top_modules=1 if top_modules is None else top_modules,
                             detailed=detailed, output_file=output_file)
    flops, macs, params = result.total_flops, result.total_macs, result.total_params
    if older:
        counted = (macs_to_string(macs), params_to_string(params)) if as_string else (macs, params)
        return (*counted, options["steps"]) if v0311 else counted
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params


def _older_inputs(model: nn.Module, input_res: Any, input_constructor: Callable[[Any], Any] | None) -> tuple:
    """(args, kwargs) as DeepSpeed's older call made them: constructor(input_res) or a tensor of that shape."""
    if input_res is None:
        raise ValueError("DeepSpeed's older get_model_profile needs input_res= (the input's shape, or what "
                         "input_constructor takes)")
    if input_constructor is None:
        return [_input_of_shape(model, tuple(input_res))], {}
    made = input_constructor(input_res)
    if isinstance(made, dict):
        return [], made
    return (list(made) if isinstance(made, (tuple, list)) else [made]), {}


def _input_of_shape(model: nn.Module, input_shape: tuple[int, ...]) -> torch.Tensor:
    """DeepSpeed's `input_shape` tensor: that shape, the model's first parameter's dtype and device."""
    if not isinstance(input_shape, tuple) or not input_shape:
        raise ValueError(f"input_shape must be a non-empty tuple, got {input_shape!r}")
    param = next(iter(model.parameters()), None)
    if param is None:
        return torch.ones(input_shape)
    # ones rather than DeepSpeed's new_empty: uninitialized memory can hold NaNs and denormals,
    # which change CPU timings.
    return torch.ones(input_shape, dtype=param.dtype, device=param.device)


class Accelerator:
    """The part of DeepSpeed's `get_accelerator()` its profiler examples use, over torch.cuda or the CPU.

    `device(i)` is the context its examples open around a profile (torch.cuda.device on CUDA, a
    no-op on the CPU); `device_name(i)` is "cuda:i" / "cpu" as DeepSpeed names devices.
    """

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()

    def is_available(self) -> bool:
        return True  # the CPU always is; DeepSpeed's CPU accelerator says the same

    def device_name(self, device_index: int | None = None) -> str:
        name = "cuda" if self.cuda else "cpu"
        return name if device_index is None or not self.cuda else f"{name}:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self.cuda else 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device()) if self.cuda else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.cuda else 1

    def device(self, device_index: int | None = None) -> Any:
        return torch.cuda.device(device_index) if self.cuda else contextlib.nullcontext()

    def synchronize(self, device_index: int | None = None) -> None:
        if self.cuda:
            torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self.cuda else True

    def is_fp16_supported(self) -> bool:
        return True


def get_accelerator() -> Accelerator:
    """DeepSpeed's `deepspeed.accelerator.get_accelerator()`, for its profiler examples to run unchanged."""
    return Accelerator()
