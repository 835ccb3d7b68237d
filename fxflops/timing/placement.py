"""Where a timed pass runs: device and its name, compute dtype and peak, inputs moved there.

Also the contexts a timed loop runs in (the device made current, the garbage collector paused) and the
parallel sizes the summary reports; shared by profile(), profile_generate() and the DeepSpeed API.
"""

from __future__ import annotations

import contextlib
import gc
import platform
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxflops.api import collector_paused
from fxflops.device import peaks


# ------------------------------------------------------------------------------ device and dtype


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (cpu for a model without tensors)."""
    tensor = next(iter(model.parameters()), None)
    if tensor is None:
        tensor = next(iter(model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def resolve_device(model: nn.Module, device: str | torch.device | None) -> torch.device:
    """Where the timed pass runs: `device`, or the model's own; never the meta device."""
    target = torch.device(device) if device is not None else model_device(model)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    if target.type == "meta":
        raise ValueError("profile() runs the model, but it lives on the meta device; "
                         "use fxflops.estimate() for a meta model, or load real weights")
    return target


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return _cpu_name()
    return device.type


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def compute_dtype(model: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in: autocast's when it is on, else the model's dominant float dtype."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    sizes: dict[torch.dtype, int] = {}
    for param in model.parameters():
        if param.is_floating_point():
            sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    return max(sizes, key=sizes.get) if sizes else torch.get_default_dtype()


def resolve_peak(device: torch.device, dtype: torch.dtype, peak_flops: float | None) -> tuple[float | None, str | None]:
    """(peak FLOP/s, its source): the user's value, else the GPU table; a CPU has no table value."""
    if peak_flops is not None:
        return float(peak_flops), "user"
    if device.type != "cuda":
        return None, None
    found = peaks.peak_for(device_name(device), dtype, tf32=peaks.tf32_enabled())
    return found if found is not None else (None, None)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect garbage now and not during the timed steps: after a trace (the estimate) a full
    collection can take longer than a whole forward and would land in one step's numbers."""
    gc.collect()
    with collector_paused():
        yield


def device_context(device: torch.device) -> contextlib.AbstractContextManager:
    """Make `device` current, so CUDA events are recorded on its streams."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# --------------------------------------------------------------------------------------- inputs


def normalize_args(args: Any) -> tuple:
    if args is None:
        return ()
    return tuple(args) if isinstance(args, tuple | list) else (args,)


def on_device(value: Any, device: torch.device) -> Any:
    """The same pytree with tensors that live elsewhere copied to `device`."""
    return pytree.tree_map(
        lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) and leaf.device != device else leaf, value
    )


def batch_size_of(value: Any) -> int | None:
    """The first dimension of the first input tensor that has one."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.ndim:
            return int(leaf.shape[0])
    return None


# ----------------------------------------------------------------------------------- parallelism


def parallel_sizes(mp_size: int | None, dp_size: int | None) -> tuple[int | None, int | None, int | None]:
    """(world size, data parallel size, model parallel size), or Nones outside any parallel run.

    The world size comes from torch.distributed when it is initialized; the data parallel size,
    when not given, is what the world size leaves after model parallelism.
    """
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed and mp_size is None and dp_size is None:
        return None, None, None
    mp = mp_size or 1
    world = torch.distributed.get_world_size() if distributed else mp * (dp_size or 1)
    dp = dp_size or max(world // mp, 1)
    return world, dp, mp
