"""The real-weights method: one real forward of the model on its own weights and inputs, every aten op
recorded. For models whose control flow depends on tensor values, which fake tensors cannot decide.

The model really runs, so totals may depend on the input values. It gets the same isolation as the
eager method, and copy-on-write for tensor data: a parameter, buffer or input that an op is about to
write into in place is saved first and put back afterwards.
"""

from __future__ import annotations

import torch

from fxflops.capture.attribution import ModuleTracker, module_infos
from fxflops.capture.backward import GradOwners, cleared_grads, differentiate, parameter_owners, restore_grads
from fxflops.capture.copy_on_write import CopyOnWrite
from fxflops.capture.inputs import nothing_to_run, refuse_lazy_output
from fxflops.capture.isolation import isolated
from fxflops.capture.methods import TRACE
from fxflops.capture.flex import flex_runs_eagerly
from fxflops.capture.reach import Reach
from fxflops.capture.recorder import CompositeOps, OpRecorder
from fxflops.capture.request import Request
from fxflops.capture.tensor_walk import tensors_in
from fxflops.capture.twins import to_meta
from fxflops.results import Captured



def needs_real(reason: str) -> str:
    """Why trace cannot run this model: it needs real weights and real inputs."""
    return f"needs real weights and real input tensors to run the model, but {reason}"


def capture(request: Request) -> Captured:
    model = request.model
    reason = nothing_to_run(model, request.args, request.kwargs)
    if reason is not None:
        raise RuntimeError(needs_real(reason))
    inputs = Reach((request.args, request.kwargs))
    with isolated(model, inputs) as modules:
        params = [t for _, module in modules for t in module._parameters.values() if t is not None]
        buffers = [t for _, module in modules for t in module._buffers.values() if t is not None]
        # cache objects are updated by a forward: run on rebuilt ones (their tensors and the rest shared)
        # with a backward, inputs computed by the user's own graph are cut from it: the backward stops
        # at them, as at the model's boundary, and the user's graph stays whole
        own = _cut_from_graph if request.backward else _usable
        args, kwargs = inputs.with_twins(own)
        leaves = [*params, *tensors_in((args, kwargs))]
        writes = CopyOnWrite(leaves, saved_now=buffers)
        owners = GradOwners(parameter_owners(model)) if request.backward else None
        tracker = ModuleTracker(model, is_whole=request.is_whole, keep=to_meta,
                                phase=owners.phase if owners else None)
        recorder = OpRecorder(tracker, type(model).__name__, keep=to_meta, before=writes.before, owners=owners)
        grads = cleared_grads(leaves) if request.backward else []  # a real backward fills .grad: put back after
        try:
            with torch.enable_grad() if request.backward else torch.no_grad(), flex_runs_eagerly(), tracker, recorder, \
                    CompositeOps(recorder, request.knows_op):
                if owners is not None:
                    owners.start()
                output = refuse_lazy_output(model(*args, **kwargs))
                if owners is not None:
                    differentiate(output, request.loss, owners, recorder.unrecorded)
        finally:
            writes.restore()
            restore_grads(grads)
        graph_module = recorder.finish(output)
        infos, aliases = module_infos(model)
    return Captured(graph_module, TRACE.name, infos, aliases, tracker.calls, request.whole_paths(),
                    tracker.whole_calls, backward=request.backward)


def _usable(tensor: torch.Tensor) -> torch.Tensor:
    # made under torch.inference_mode(): it keeps no version counter (the copy-on-write guard reads one)
    # and autograd cannot save it; a copy made outside inference mode has both
    return tensor.clone() if tensor.is_inference() else tensor


def _cut_from_graph(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_inference():
        return _usable(tensor)
    if tensor.grad_fn is None:
        return tensor
    return tensor.detach().requires_grad_(tensor.requires_grad)
