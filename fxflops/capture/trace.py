"""The real-weights method: one real forward of the model on its own weights and inputs, every aten op
recorded. For models whose control flow depends on tensor values, which fake tensors cannot decide.

The model really runs, so totals may depend on the input values. It gets the same isolation as the
eager method, and copy-on-write for tensor data: a parameter, buffer or input that an op is about to
write into in place is saved first and put back afterwards.
"""

from __future__ import annotations

from typing import Any

import torch

from fxflops.capture.attribution import ModuleTracker, module_infos
from fxflops.capture.inputs import has_meta_tensors, tensors_in, to_meta, with_twins
from fxflops.capture.isolation import isolated
from fxflops.capture.methods import TRACE
from fxflops.capture.recorder import CompositeOps, OpRecorder
from fxflops.capture.request import Request
from fxflops.results import Captured

NEEDS_REAL = ("needs real weights and real input tensors; the model or its inputs are on the meta device "
              "(or given as shapes), so there is nothing to run")


class CopyOnWrite:
    """Saves a protected tensor's data just before an op first writes into it (or a view of it).

    Ops are known to write by their schema. Some schemas do not say so (native_batch_norm updates its
    running statistics in place): `saved_now` tensors, the small buffers, are saved up front.
    """

    def __init__(self, tensors: list[torch.Tensor], saved_now: list[torch.Tensor]) -> None:
        self._owners = {_storage_key(t): t for t in tensors}
        self._saved = {_storage_key(t): (t, t.detach().clone()) for t in saved_now}
        self._mutable: dict[Any, bool] = {}

    def before(self, func: Any, args: tuple, kwargs: dict) -> None:
        mutable = self._mutable.get(func)
        if mutable is None:
            mutable = self._mutable[func] = bool(getattr(func, "_schema", None) and func._schema.is_mutable)
        if mutable:
            for tensor in tensors_in((args, kwargs)):
                key = _storage_key(tensor)
                owner = self._owners.get(key)
                if owner is not None and key not in self._saved:
                    self._saved[key] = (owner, owner.detach().clone())
        return None

    def restore(self) -> None:
        with torch.no_grad():
            for owner, saved in self._saved.values():
                owner.copy_(saved)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def capture(request: Request) -> Captured:
    model = request.model
    if has_meta_tensors(model, request.args, request.kwargs):
        raise RuntimeError(NEEDS_REAL)
    with isolated(model) as modules:
        params = [t for _, module in modules for t in module._parameters.values() if t is not None]
        buffers = [t for _, module in modules for t in module._buffers.values() if t is not None]
        # cache objects are updated by a forward: run on copies of them (their tensors shared, not copied)
        args, kwargs = with_twins(request.args, _same), with_twins(request.kwargs, _same)
        writes = CopyOnWrite([*params, *tensors_in((args, kwargs))], saved_now=buffers)
        tracker = ModuleTracker(model, is_whole=request.is_whole, keep=to_meta)
        recorder = OpRecorder(tracker, type(model).__name__, keep=to_meta, prepare=writes.before)
        try:
            with torch.no_grad(), tracker, recorder, CompositeOps(recorder):
                output = model(*args, **kwargs)
        finally:
            writes.restore()
        graph_module = recorder.finish(output)
        infos, aliases = module_infos(model)
    return Captured(graph_module, TRACE.name, infos, aliases, tracker.calls, request.whole_paths(),
                    tracker.whole_calls)


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
