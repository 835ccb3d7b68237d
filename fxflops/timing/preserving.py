"""Leaving the model as a timed pass found it: state, buffers, in-place writes, device.

Used around every run that executes the user's model: profile(), profile_generate(), the estimates of
live calls (EstimateCache) and the DeepSpeed API.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from fxflops.capture.copy_on_write import CopyOnWrite
from fxflops.capture.isolation import isolated


@contextlib.contextmanager
def preserved(model: nn.Module, device: torch.device) -> Iterator[CopyOnWrite]:
    """Leave the model as a timed pass found it: what `capture.isolation` restores (attributes, hooks,
    submodules, classes, training flags, torch's global hook tables, the RNGs), buffer values
    (BatchNorm running statistics) and parameters written in place by a forward run under the
    yielded guard's `watching()` (the warm-up forwards). A parameter written outside it is reported.
    """
    rng_devices = [device.index] if device.type == "cuda" else []
    with isolated(model) as modules:
        params = [t for _, module in modules for t in module._parameters.values() if t is not None]
        buffers = [t for _, module in modules for t in module._buffers.values() if t is not None]
        writes = CopyOnWrite(params, saved_now=buffers)
        try:
            with torch.random.fork_rng(devices=rng_devices):
                yield writes
        finally:
            writes.restore()
            unsaved = writes.unsaved_writes()
    if unsaved:
        names = [name for name, param in model.named_parameters() if any(param is t for t in unsaved)]
        warnings.warn(f"the timed forwards wrote into parameters {', '.join(names[:5])} in place, and fxflops could "
                      "not put their values back (they were written outside the warm-up); use warm_up >= 1",
                      RuntimeWarning, stacklevel=3)


@contextlib.contextmanager
def moved_to(model: nn.Module, device: torch.device | None) -> Iterator[None]:
    """Run with the model on `device` (None: where it is); move it back afterwards, also after an exception."""
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    if device is None or not devices or devices == {device}:
        yield
        return
    if len(devices) > 1:
        raise ValueError(f"the model spans devices {sorted(map(str, devices))}; "
                         "pass device=None to profile it where it is")
    (original,) = devices
    model.to(device)
    try:
        yield
    finally:
        model.to(original)
