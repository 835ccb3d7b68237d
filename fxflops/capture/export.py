"""The export method: the program torch.export (non-strict) traces, export-only branches included.

The model's own modules are exported with their tensors swapped for meta twins in place (no copy);
`isolation` puts them back. Any output type works: a wrapper returns the output's tensors flat, and
inputs export cannot take (cache objects) are held by the wrapper as constants.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch

from fxflops.capture.attribution import ModuleTracker, label_modules, module_infos, tag_names
from fxflops.capture.diagnosis import DataDependentSizes
from fxflops.capture.inputs import is_plain, refuse_lazy_output
from fxflops.capture.isolation import isolated
from fxflops.capture.methods import EXPORT
from fxflops.capture.reach import with_twins
from fxflops.capture.request import Request
from fxflops.capture.tensor_walk import tensors_in
from fxflops.capture.twins import meta_twin, swap_tensors, to_meta
from fxflops.results import Captured

WRAPPED = "model"  # attribute name of the user's model inside the output-flattening wrapper


class FlatOutputs(torch.nn.Module):
    """Returns the model's output tensors as a flat tuple, so any output type can be exported.

    Inputs export cannot take (cache objects and other custom classes) are held here as constants
    and put back in their places on each call.
    """

    def __init__(self, model: torch.nn.Module, held_args: dict[int, Any], held_kwargs: dict[str, Any]) -> None:
        super().__init__()
        setattr(self, WRAPPED, model)
        self._held_args = held_args
        self._held_kwargs = held_kwargs

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        merged = list(args)
        for index in sorted(self._held_args):
            merged.insert(index, self._held_args[index])
        output = refuse_lazy_output(getattr(self, WRAPPED)(*merged, **kwargs, **self._held_kwargs))
        return tuple(tensors_in(output))


def capture(request: Request) -> Captured:
    import torch.export  # noqa: F401 - imported on first use: it costs a second at start-up

    model = request.model
    args, kwargs = request.args, request.kwargs
    held_args = {i: with_twins(a, meta_twin) for i, a in enumerate(args) if not is_plain(a)}
    held_kwargs = {k: with_twins(v, meta_twin) for k, v in kwargs.items() if not is_plain(v)}
    plain_args = to_meta(tuple(a for i, a in enumerate(args) if i not in held_args))
    plain_kwargs = to_meta({k: v for k, v in kwargs.items() if k not in held_kwargs})
    with isolated(model, (args, kwargs)) as modules:
        swap_tensors(modules, meta_twin)
        tag_names(model)  # export copies aliased modules: identity cannot name them
        wrapper = FlatOutputs(model, held_args, held_kwargs)
        # torch.export prints its partial graph to stderr when it fails; we report the failure
        # ourselves, and pass on whatever else was written there
        stderr = io.StringIO()
        tracker = ModuleTracker(wrapper, prefix=WRAPPED, is_whole=request.is_whole, keep=to_meta)
        with tracker, contextlib.redirect_stderr(stderr), _quiet_torch_logs():
            program = torch.export.export(wrapper, plain_args, plain_kwargs, strict=False)
        sys.stderr.write(stderr.getvalue())
        infos, aliases = module_infos(model)
    graph_module = program.graph_module
    _refuse_data_dependent_sizes(graph_module)
    label_modules(graph_module, prefix=WRAPPED, root_type=type(model).__name__)
    return Captured(graph_module, EXPORT.name, infos, aliases, tracker.calls, request.whole_paths(),
                    tracker.whole_calls)


def _refuse_data_dependent_sizes(graph_module: torch.fx.GraphModule) -> None:
    """Export succeeds where sizes depend on tensor values (.item(), nonzero); costs need real sizes."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "placeholder" and free_unbacked_symbols(node.meta.get("val")):
                where = (node.meta.get("stack_trace") or "").strip().splitlines()[-2:]
                raise DataDependentSizes(
                    f"the output size of {node.target} depends on tensor values (data-dependent: "
                    f"{node.meta['val'].shape if hasattr(node.meta['val'], 'shape') else node.meta['val']}); "
                    f"costs need concrete sizes. {' '.join(line.strip() for line in where)}"
                )


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Silence torch's loggers while export runs; its failures reach the user in our error."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name == "torch" or name.startswith("torch.")]
    levels = [(logger, logger.level) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in levels:
            logger.setLevel(level)
