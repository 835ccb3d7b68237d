"""Counting families: batches of one structure, counted from one sweep capture evaluated at each batch's sizes.

A `Family` is the sweep of a family's first batch with its batch and sequence (or image) axes
symbolic (`infer_dims` names them), and a compiled forward and backward total per captured piece, so a
later batch of the family costs an evaluation, not a capture. Under attention="effective" its attention
ops whose masks are data are kept apart and counted on each batch's own mask (`timing.data_masks`).
What a batch is (`call_inputs`), what a family shares (`structure`) and the loss a transformers
batch differentiates (`output_loss`) are read here.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fxflops.capture.backward import own_loss
from fxflops.capture.tensor_walk import tensors_in
from fxflops.timing.data_masks import DataMasks
from fxflops.timing.routed import NOT_OBSERVED, NotObserved, RoutedSizes, RowObserver, routed_modules

Warn = Callable[[str, Any], None]  # the meter's warn_once(message, key): a family reports through it

# input names whose axes 0 and 1 are (batch, sequence): transformers' and most tokenizers' keys
TOKEN_KEYS = ("input_ids", "attention_mask", "labels", "token_type_ids", "position_ids", "decoder_input_ids",
              "decoder_attention_mask", "inputs_embeds")
IMAGE_KEYS = ("pixel_values", "images", "image", "x")


class Family:
    """One shape family: its sweep, its named axes, and a compiled total per captured piece.

    `warn(message, key)` reports what the family cannot count exactly (once per key); `captures` and
    `capturing` (seconds) grow as later points need pieces of their own: the meter reads them."""

    def __init__(self, model: torch.nn.Module, inputs: tuple[tuple, dict], dims: Mapping[str, Any],
                 options: dict[str, Any], warn: Warn) -> None:
        from fxflops.sweeps import sweep

        args, kwargs = inputs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the meter warns once itself; unknown ops stay in the sweep
            self.sweep = sweep(model, args, kwargs, dims=dims, **options)
        self.example = [tuple(t.shape) for t in tensors_in(inputs)]
        self.axes = self.sweep.plan.axes
        self._counting = self.sweep._counting  # the table and conventions its pieces were counted with
        self._effective = options.get("attention") == "effective"
        # per piece: its compiled totals, its data masks, and its routed sizes' modules (name -> module)
        self._totals: dict[int, tuple[tuple[Callable, ...], DataMasks | None, RoutedSizes]] = {}
        self._known: dict[tuple, Any] = {}
        self._warn = warn
        self.captures = len(self.sweep.pieces)
        self.capturing = 0.0  # seconds spent capturing pieces after the first
        self.watched: set[str] = set()  # modules whose input rows are a routed size (timing.routed)

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether the tensors differ from the example only on named axes."""
        if len(tensors) != len(self.example):
            return False
        for index, (tensor, shape) in enumerate(zip(tensors, self.example)):
            named = self.axes.get(index, {})
            if tensor.dim() != len(shape):
                return False
            for axis, size in enumerate(shape):
                if axis not in named and tensor.shape[axis] != size:
                    return False
        return True

    def misfit(self, tensors: list[torch.Tensor]) -> str:
        for index, (tensor, shape) in enumerate(zip(tensors, self.example)):
            if tuple(tensor.shape) != shape:
                return f"input {index} has shape {tuple(tensor.shape)}, the family's first batch {shape}"
        return "the inputs differ in number from the family's first batch"

    def point(self, tensors: list[torch.Tensor]) -> dict[str, int]:
        point: dict[str, int] = {}
        for index, named in self.axes.items():
            shape = tensors[index].shape
            for axis, name in named.items():
                if point.setdefault(name, shape[axis]) != shape[axis]:
                    raise ValueError(f"size {name} is {point[name]} on one input and {shape[axis]} on input {index}")
        return point

    def flops(self, point: dict[str, int], tensors: list[torch.Tensor],
              observer: RowObserver | None = None) -> tuple[Any, Any, int, int, dict[str, int] | None]:
        """(forward, backward, dense forward, dense backward, routed rows) FLOPs at `point`. Attention ops
        whose masks are data count, in an effective reading, the masks of the batch's `tensors`: then the
        forward and backward are 0-d tensors on the masks' device, not yet read. A mixture of experts counts
        the rows each expert received as `observer` read them from the forward (`timing.routed`): the
        routed rows per expert module are returned, else None (NotObserved where they were not read)."""
        key = tuple(point.values())
        found = self._known.get(key)
        if isinstance(found, Exception):
            raise found  # a point that could not be captured: not tried again every step
        if found is None:
            before, begin = len(self.sweep.pieces), time.perf_counter()
            try:
                piece = self.sweep.piece(**point)
                compiled = self._totals.get(id(piece))
                if compiled is None:
                    compiled = self._totals[id(piece)] = (*self._compile(piece), routed_modules(piece))
                    self.watched.update(compiled[2].paths)
            except Exception as error:
                self._known[key] = error
                raise
            finally:
                self.captures += len(self.sweep.pieces) - before
                self.capturing += time.perf_counter() - begin
            full = self.sweep.point(point)
            values = None if compiled[2] else tuple(function(full) for function in compiled[0])  # read once
            found = self._known[key] = (compiled, full, values)
        (functions, masks, routed), full, values = found
        rows = None
        if routed:  # evaluated at this micro-batch's routed rows
            if observer is None:
                raise NotObserved(NOT_OBSERVED)
            sizes, rows = routed.bind(observer.take(routed.paths), full)
            values = tuple(function({**full, **sizes}) for function in functions)
        fwd, bwd, apart_fwd, apart_bwd, dense_fwd, dense_bwd = values
        if masks is None:
            return fwd, bwd, dense_fwd, dense_bwd, rows
        try:
            mask_fwd, mask_bwd = masks.flops(tensors, full)
        except Exception as error:  # noqa: BLE001 - the batch counts dense there, and says so once
            self._warn(f"fxflops.FlopsMeter: a data mask could not be counted on the batch "
                       f"({first_line(error)}): those attention ops count dense", ("data mask", type(error)))
            mask_fwd, mask_bwd = apart_fwd, apart_bwd
        return fwd + mask_fwd, bwd + mask_bwd, dense_fwd, dense_bwd, rows

    def _compile(self, piece: Any) -> tuple[tuple[Callable, ...], DataMasks | None]:
        """The piece's totals compiled; in an effective reading, its data masks kept apart to count per batch."""
        masks = None
        if self._effective:
            masks = DataMasks(piece, self._counting.table, self._counting.conventions)
            by_reason: dict[str, list[str]] = {}
            for module, reason in masks.skipped.items():
                by_reason.setdefault(reason, []).append(module)
            for reason, modules in by_reason.items():  # one line per reason, not one per layer
                named = ", ".join(modules[:3]) + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")
                self._warn(f"fxflops.FlopsMeter: the attention mask of {named}: {reason}; its pairs are not "
                           "counted from the batch, it counts dense", ("data mask", reason))
            masks = masks if masks.terms else None
        return _compiled_totals(piece, masks.names if masks is not None else frozenset()), masks


def _compiled_totals(piece: Any, apart: frozenset[str]) -> tuple[Callable[[Mapping[str, int]], int], ...]:
    """The piece's forward and backward FLOPs less the nodes `apart`, those nodes' dense forward and
    backward, and the dense forward and backward totals, each one expression compiled to a Python
    function: sums of the nodes' costs, as the Estimate's root totals are."""
    import sympy

    from fxflops.sweeps import compile_expression

    def compiled(terms: list[Any]) -> Callable[[Mapping[str, int]], int]:
        expr = sympy.Add(*terms) if terms else sympy.Integer(0)
        function = compile_expression(expr) if isinstance(expr, sympy.Basic) else None
        if function is not None:
            return function
        expr = sympy.sympify(expr)  # by name: sizes made from values (u0...) are not the user's symbols
        return lambda point: int(expr.xreplace({symbol: point[symbol.name] for symbol in expr.free_symbols}))

    def dense(c: Any) -> Any:
        return c.dense_flops if c.dense_flops is not None else c.flops

    costs = [c for c in piece.costs if c.flops != 0 or dense(c) != 0]
    return (compiled([c.flops for c in costs if not c.is_backward and c.name not in apart]),
            compiled([c.flops for c in costs if c.is_backward and c.name not in apart]),
            compiled([dense(c) for c in costs if not c.is_backward and c.name in apart]),
            compiled([dense(c) for c in costs if c.is_backward and c.name in apart]),
            compiled([dense(c) for c in costs if not c.is_backward]),
            compiled([dense(c) for c in costs if c.is_backward]))


def infer_dims(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The named axes of a common batch: token inputs (batch, seq), images (batch, height, width), else batch."""
    if isinstance(kwargs, dict):
        for key in TOKEN_KEYS:
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                return {"batch": 0, "seq": 1}
        for key in IMAGE_KEYS:
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor) and value.dim() == 4:
                return {"batch": 0, "height": 2, "width": 3}
    tensors = tensors_in((args, kwargs))
    if not tensors:
        raise ValueError("the batch holds no tensor")
    first = tensors[0]
    if first.dim() == 2 and not first.is_floating_point():
        return {"batch": 0, "seq": 1}
    if first.dim() == 4 and first.is_floating_point():
        return {"batch": 0, "height": 2, "width": 3}
    if first.dim() == 0:
        raise ValueError("the first input is a scalar: give dims= naming the batch axis")
    return {"batch": 0}


def output_loss(output: Any) -> Any:
    """The output's `loss`: what a transformers model given labels returns and the Trainer differentiates."""
    loss = own_loss(output)
    if loss is None:
        raise ValueError("the batch has labels but the model's output has no loss tensor: pass loss= to the meter")
    return loss


def call_inputs(batch: Any) -> tuple[tuple, dict]:
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], tuple) and isinstance(batch[1], dict):
        return batch  # (args, kwargs), as a forward hook sees a call
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, list | tuple):
        return tuple(batch), {}
    return (batch,), {}


def structure(args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> tuple:
    """What a family shares: the call's arguments, tensors' ranks, dtypes and requires_grad, plain values
    (the model's own state is keyed apart: `fxflops.timing.model_state`)."""
    plain = tuple((k, v) for k, v in kwargs.items() if isinstance(v, bool | int | float | str | type(None)))
    return (len(args), tuple(kwargs), plain, tuple((t.dim(), t.dtype, t.requires_grad) for t in tensors))


def first_line(error: BaseException) -> str:
    summary = getattr(error, "summary", None)
    text = summary() if callable(summary) else str(error)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
