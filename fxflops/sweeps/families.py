"""Size families: estimates of a stream of calls that differ only in their tensors' sizes.

`SizeFamilies` groups calls (decode steps, a training loop's batches) by their structure and counts
each family from one capture: the first call plainly, the second as a sweep over the axes that
changed, every later call as a point of that sweep. `fxflops.timing.profiling` counts the calls it
times with it (decode steps with a growing cache share one sweep's capture).
"""

from __future__ import annotations

from typing import Any

import torch

from fxflops.api import Counting, estimate
from fxflops.capture.dynamic import SizePlan
from fxflops.capture.inputs import signature
from fxflops.capture.methods import AUTO
from fxflops.capture.tensor_walk import tensors_in
from fxflops.capture.twins import to_meta
from fxflops.results import Estimate
from fxflops.sweeps.core import Sweep


class SizeFamilies:
    """Estimates of a stream of calls (decode steps, a training loop's batches) that differ only in
    their tensors' sizes, from one capture per family instead of one per call.

    Calls of the same structure (the same tensors, ranks and dtypes, the same other arguments) are a
    family. Its first call is estimated plainly. The second names the axes that changed (axes whose
    sizes changed alike share a name, as a KV cache's layers do) and captures a sweep over them;
    every later call is a point of that sweep, as exact as estimate() there. A call that also changes
    another axis, or a sweep that cannot be captured, is estimated plainly.
    """

    def __init__(self, model: torch.nn.Module, **estimate_options: Any) -> None:
        self.model = model
        self.options = estimate_options
        self.captures = 0  # captures made: plain estimates plus sweep pieces
        self._families: dict[Any, _Family] = {}
        self._sweeps_possible = estimate_options.get("method", AUTO) in (AUTO, "eager")

    def estimate(self, args: tuple, kwargs: dict, backward: bool = False) -> Estimate:
        shapes = [tuple(t.shape) for t in tensors_in((args, kwargs))]
        family = self._families.setdefault((_structure((args, kwargs)), backward), _Family(shapes))
        if self._sweeps_possible and family.sweep is None and not family.failed and shapes != family.shapes:
            plan = _changed_axes(family.shapes, shapes)
            if plan is not None:
                try:
                    family.sweep = self._sweep(to_meta((tuple(args), dict(kwargs))), plan, backward)
                    self.captures += len(family.sweep.pieces)
                except Exception:  # noqa: BLE001 - this family is estimated call by call instead
                    family.failed = True
                    self.captures += 1
        point = family.point(shapes) if family.sweep is not None else None
        if point is not None:
            before = len(family.sweep.pieces)
            try:
                return family.sweep.at(**point)
            except Exception:  # noqa: BLE001 - a point the sweep cannot serve: estimate() tries every method
                pass
            finally:
                self.captures += len(family.sweep.pieces) - before
        self.captures += 1
        return estimate(self.model, tuple(args), dict(kwargs), backward=backward, **self.options)

    def _sweep(self, inputs: tuple[tuple, dict], plan: SizePlan, backward: bool) -> Sweep:
        options = {key: self.options.get(key) for key in ("conventions", "rules", "leaf_modules", "attention")}
        counting = Counting.prepare(options["conventions"] or "deepspeed", options["rules"], options["leaf_modules"],
                                    options["attention"] or "dense")
        args, kwargs = inputs
        return Sweep(self.model, args, kwargs, plan, counting,
                     {"method": self.options.get("method", AUTO), "backward": backward, "loss": None,
                      "optimizer": None})


class _Family:
    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        self.shapes = shapes  # the first call's input shapes
        self.sweep: Sweep | None = None
        self.failed = False

    def point(self, shapes: list[tuple[int, ...]]) -> dict[str, int] | None:
        """The sweep's point for these input shapes, or None if they differ from it elsewhere too."""
        plan = self.sweep.plan
        point: dict[str, int] = {}
        for index, (shape, first) in enumerate(zip(shapes, self.shapes)):
            named = plan.axes.get(index, {})
            for axis, (size, was) in enumerate(zip(shape, first)):
                name = named.get(axis)
                if name is None:
                    if size != was:
                        return None
                elif point.setdefault(name, size) != size:
                    return None
        return point


def _structure(value: Any) -> Any:
    """What a family shares: everything of a call's signature but its tensors' sizes."""
    def erase(leaf: Any) -> Any:
        if isinstance(leaf, tuple) and len(leaf) == 3 and isinstance(leaf[1], torch.dtype):
            return len(leaf[0]), leaf[1], leaf[2]  # a tensor: rank, dtype, device type
        if isinstance(leaf, tuple) and len(leaf) == 2 and isinstance(leaf[1], tuple):
            return leaf[0], tuple((len(shape), dtype) for shape, dtype in leaf[1])  # an object of tensors
        return leaf

    spec, leaves = signature(value)
    return spec, tuple(erase(leaf) for leaf in leaves)


def _changed_axes(first: list[tuple[int, ...]], now: list[tuple[int, ...]]) -> SizePlan | None:
    """A plan naming the axes whose sizes differ between two calls' input shapes (`size0`, `size1`, ...);
    axes that changed from the same size to the same size share a name. None if ranks differ."""
    if len(first) != len(now) or any(len(a) != len(b) for a, b in zip(first, now)):
        return None
    names: dict[tuple[int, int], str] = {}
    axes: dict[int, dict[int, str]] = {}
    for index, (before, after) in enumerate(zip(first, now)):
        for axis, change in enumerate(zip(before, after)):
            if change[0] != change[1]:
                name = names.setdefault(change, f"size{len(names)}")
                axes.setdefault(index, {})[axis] = name
    if not names:
        return None
    return SizePlan(axes, {name: after for (_, after), name in names.items()})
