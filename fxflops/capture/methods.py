"""The capture methods, declared once: their names, what each one counts, and the automatic order.

Other modules name a method only through these constants, never by a string of their own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fxflops.results import Captured


@dataclass(frozen=True)
class Method:
    """A capture method: its name, what it counts, and where its capture function lives."""

    name: str
    counts: str  # what the report says was counted
    runs_model: bool  # True: real arithmetic on the user's weights; totals may depend on input values
    module: str  # where its `capture(request)` function lives (imported on first use)
    records_backward: bool = False  # it can also record the backward autograd runs
    symbolic_sizes: bool = False  # it can capture with named input sizes left symbolic
    runs_prepare: bool = False  # it runs Request.prepare on the fake-tensor model first (a parallel plan)

    def capture_function(self) -> Callable[[Any], Captured]:
        return importlib.import_module(self.module).capture


EAGER = Method("eager", "the model's own forward, run once on fake tensors (the eager code path; nothing computed)",
               False, "fxflops.capture.eager", records_backward=True, symbolic_sizes=True, runs_prepare=True)
EXPORT = Method("export", "the program torch.export (non-strict) traces, export-only branches included",
                False, "fxflops.capture.export")
SYMBOLIC = Method("symbolic", "the graph torch.fx symbolic tracing records, shapes propagated on the meta device",
                  False, "fxflops.capture.symbolic")
TRACE = Method("trace", "one real forward on the model's weights and inputs (it ran; totals may depend on input values)",
               True, "fxflops.capture.trace", records_backward=True)

METHODS: dict[str, Method] = {method.name: method for method in (EAGER, EXPORT, SYMBOLIC, TRACE)}
AUTO = "auto"
AUTO_ORDER = (EAGER, EXPORT, SYMBOLIC, TRACE)  # what "auto" tries, in turn
CHOICES = (AUTO, *METHODS)  # what a user may pass as method=


def describe(name: str) -> str:
    """What a captured estimate counted, for reports ("given" graphs and unknown names pass through)."""
    method = METHODS.get(name)
    return method.counts if method is not None else name


def runs_model(name: str) -> bool:
    """Whether the method ran the model for real (its totals may depend on the input values)."""
    method = METHODS.get(name)
    return method is not None and method.runs_model
