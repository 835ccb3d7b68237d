"""Capture: turn a model and example inputs into an FX graph whose nodes carry shapes and modules.

One module per method (`eager`, the default; `export`; `symbolic`; `trace`), declared in `methods`;
`replay` copies a repeated block's nodes instead of running it (`block_state`: what it compares;
`block_io`: where the block's tensors come from and go), `isolation` leaves the model and torch as
they were while `twins` stand in for its tensors, `inputs`, `tensor_walk` and `reach` handle the
example inputs, `attribution` names the module behind each op, `recorder` turns executed aten ops
into graph nodes, `kernel_checks` finds ops a real kernel would refuse, `diagnosis` explains failures. Every method hands the count stage a
`fxflops.results.Captured`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fxflops.capture.branches import control_flow_cautions
from fxflops.capture.diagnosis import CaptureError, describe_failure
from fxflops.capture.dynamic import SizePlan
from fxflops.capture.input_values import Routing
from fxflops.capture.inputs import floating_dtype, inputs_from_shape, nothing_to_run, shapes_of
from fxflops.capture.isolation import in_turn
from fxflops.capture.kernel_checks import rejected_ops
from fxflops.capture.lookups import out_of_range_lookups
from fxflops.capture.mode import training_mode_cautions
from fxflops.capture.sharded import forget_sharding_decisions
from fxflops.capture.module_walk import uncompiled
# the default method's module comes with the package (a first estimate would otherwise import it, ~8 ms
# with the replay of repeated blocks); the other methods' are imported on first use
from fxflops.capture import eager as _eager  # noqa: F401,E402  (isort: skip)
from fxflops.capture.quiet import torch_logging_quiet
from fxflops.capture.methods import AUTO, AUTO_ORDER, CHOICES, METHODS, TRACE
from fxflops.capture.request import Request
from fxflops.capture.running import capture_running
from fxflops.capture.tensor_walk import tensors_in
from fxflops.capture.trace import needs_real
from fxflops.results import Attempt, Captured

__all__ = ["CaptureError", "Request", "capture", "inputs_from_shape", "tensors_in", "uncompiled"]


def capture(model: torch.nn.Module, args: tuple, kwargs: dict, method: str = AUTO,
            is_leaf: Callable[[torch.nn.Module], bool] = lambda m: False,
            is_whole: Callable[[torch.nn.Module], bool] = lambda m: False, backward: bool = False,
            loss: Callable[[Any], torch.Tensor] | None = None, sizes: SizePlan | None = None,
            knows_op: Callable[[Any, Any], bool] = lambda op, function: True, replay: bool = True,
            prepare: Callable[[torch.nn.Module], None] | None = None, routing: Any = None) -> Captured:
    """Capture with the requested method, or with each in turn for "auto"; raise CaptureError if all fail.

    With `backward`, the graph also holds the backward autograd runs for `loss(output)`; with `sizes`,
    the planned input axes are symbolic and every shape in the graph is an expression in them.
    `knows_op(op, function)` says whether the rule table names a composite aten op (linear, einsum) or
    the builtin that called it: the eager and trace methods record those whole, and the rest as the
    ops they decompose into. `replay=False` runs every call of a repeated block (see capture.replay).
    `prepare(model)` runs on the model, its tensors meta twins (then faked), before its forward (eager only).
    `routing` ("balanced", "worst" or per-expert token counts) is what a router's topk is assumed to pick
    where the forward reads the picks' values (see capture.input_values)."""
    if method not in CHOICES:
        raise ValueError(f"method must be one of {', '.join(CHOICES)}; got {method!r}")
    model = uncompiled(model)
    Routing.of(routing)  # a malformed routing fails here, before any method runs
    request = Request(model, tuple(args), dict(kwargs), is_leaf, is_whole, backward, loss, sizes, knows_op, replay, prepare,
                      routing)
    methods = AUTO_ORDER if method == AUTO else (METHODS[method],)
    if prepare is not None:
        methods = _able(methods, method, "runs_prepare", "cannot apply a parallel plan; a plan is applied")
    if backward:
        methods = _with_backward(methods, method)
    if sizes is not None:
        methods = _able(methods, method, "symbolic_sizes", "captures concrete sizes only; symbolic sizes are captured")
    with in_turn():  # another thread's capture swaps the weights for twins meanwhile: wait for it
        forget_sharding_decisions()  # an earlier process group's cached decisions name its groups
        return _first_capture(request, methods, method, args, kwargs)


def _first_capture(request: Request, methods: tuple, method: str, args: Any, kwargs: Any) -> Captured:
    model = request.model
    attempts: list[Attempt] = []
    for candidate in methods:
        reason = nothing_to_run(model, args, kwargs) if method == AUTO and candidate is TRACE else None
        if reason is not None:
            attempts.append(Attempt(TRACE.name, f"skipped: {needs_real(reason)}"))
            continue
        try:
            with capture_running(), torch_logging_quiet():  # fake tensors make torch log tracebacks a real run never would
                captured = candidate.capture_function()(request)
        except Exception as error:  # each method's failure is reported, then the next one is tried
            attempts.append(describe_failure(candidate.name, error, model))
            continue
        captured.attempts = attempts
        captured.input_shapes = shapes_of((args, kwargs))
        captured.dtype = floating_dtype(model, args, kwargs)
        captured.training = model.training
        captured.cautions = [*captured.cautions, *out_of_range_lookups(captured.graph_module),
                             *control_flow_cautions(captured.graph_module), *rejected_ops(captured.graph_module),
                             *training_mode_cautions(model, request.backward)]
        return captured
    raise CaptureError(type(model).__name__, attempts)


def _with_backward(methods: tuple, requested: str) -> tuple:
    """The methods that can record a backward; a method asked for by name that cannot is an error."""
    return _able(methods, requested, "records_backward",
                 "captures the forward only; the backward is recorded as autograd runs it,")


def _able(methods: tuple, requested: str, capability: str, refusal: str) -> tuple:
    """The methods with `capability`; if none is left, a ValueError naming those that have it."""
    able = tuple(m for m in methods if getattr(m, capability))
    if not able:
        names = ", ".join(repr(m.name) for m in AUTO_ORDER if getattr(m, capability))
        raise ValueError(f"method={requested!r} {refusal} by method {names} (or 'auto')")
    return able
