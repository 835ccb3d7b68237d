"""Where people train: `transformers` (FlopsCallback) and `lightning` (FlopsMonitor) feed a FlopsMeter.

Each submodule imports its framework; `import fxflops` imports neither (install fxflops[transformers]
or fxflops[lightning]). What they share, reading the inputs a training step really gives the model,
is here and needs torch only.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch


class ForwardInputs:
    """The (args, kwargs) of each training-mode forward call of one module, with whether grad was enabled
    for it (a pass under torch.no_grad(), a teacher's or a reference forward, has no backward), by a
    forward pre-hook that only appends them to a list. attach() adds the hook, detach() removes it
    (callbacks call detach at train end and on exceptions, so the user's model keeps no hook); while
    paused() (a capture of the meter runs the forward on fake tensors) calls are not recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[tuple, dict], bool]] = []
        self._handle: Any = None
        self._paused = False

    def attach(self, module: torch.nn.Module) -> None:
        self.detach()
        self._handle = module.register_forward_pre_hook(self._record, with_kwargs=True)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.calls = []

    @property
    def attached(self) -> bool:
        return self._handle is not None

    def take(self) -> list[tuple[tuple[tuple, dict], bool]]:
        """The calls recorded since the last take(), each ((args, kwargs), grad enabled)."""
        calls, self.calls = self.calls, []
        return calls

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _record(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and not self._paused and not _redirected(module):
            # the batch's own tensors: no copy, no sync
            self.calls.append(((tuple(args), dict(kwargs)), torch.is_grad_enabled()))


def _redirected(module: torch.nn.Module) -> bool:
    """Whether this call of the module runs another method through its __call__: Lightning's DDP and FSDP
    strategies set an instance `forward` that calls training_step, so the wrapper's hooks fire; the real
    forward is then called inside it (and recorded)."""
    forward = module.__dict__.get("forward")
    return forward is not None and getattr(forward, "__func__", None) is not type(module).forward


def warn_uncounted(meter: Any, steps: list[Any]) -> None:
    """At a logging step: say which of the `steps` since the last log were not counted and why (a warning
    whose text names the steps, so it is shown at every log where it holds, not once at the start)."""
    reasons = meter.uncounted()
    missing = [s.step for s in steps if s.flops is None]
    if not missing:
        return
    from fxflops.timing.meter import FlopsMeterWarning

    span = f"step {missing[0]}" if len(missing) == 1 else f"steps {missing[0]}-{missing[-1]}"
    why = reasons or "no training forward of the counted module was seen"
    warnings.warn(f"fxflops: {len(missing)} of the {len(steps)} steps logged now ({span}) were not counted ({why}): "
                  "their FLOPs, FLOP/s and MFU are not logged", FlopsMeterWarning, stacklevel=3)
