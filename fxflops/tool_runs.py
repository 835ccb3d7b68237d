"""Run the counters users already trust (FlopCounterMode, fvcore, ptflops, DeepSpeed) on the model, as
their users call them, and set each number beside the preset that reproduces that tool.

Each tool runs only where it is installed and can run (fvcore, ptflops and DeepSpeed run a real
forward: they need real weights and inputs). A tool whose number is not what its own convention
predicts is flagged, with the ops it counted differently (for FlopCounterMode and fvcore, per op:
typically kernels it has no formula for and silently counts 0).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fxflops.rules import PRESET_TABLE

__all__ = ["REAL_PARAMS_LIMIT", "ToolRun", "on_meta", "run_tools"]

# The largest model (parameters) the command line builds again with real, random weights on the CPU
# for the tools that run a real forward (--compare --run-tools): 200 M float32 parameters are 800 MB,
# and one forward of them takes seconds on a laptop's CPU. Larger models are refused, in one line.
REAL_PARAMS_LIMIT = 200_000_000


@dataclass(frozen=True)
class BlindSpot:
    """A module the tool counts differently from its own convention, and the ops that module ran."""

    module: str
    tool_flops: int
    convention_flops: Any
    ops: tuple[str, ...]  # the ops the module ran itself that the convention counts


@dataclass(frozen=True)
class ToolRun:
    """One tool's own number for the model, and what the preset reproducing it predicts."""

    tool: str
    preset: str
    status: str  # "ran", or why it did not run
    unit: str = "FLOPs"  # what `total` counts: FLOPs or MACs, as the tool prints it
    total: int | None = None
    predicted: Any = None  # the preset's total in the same unit
    # where its number is not what its convention predicts: the innermost modules that differ
    blind_spots: list[BlindSpot] = field(default_factory=list)

    @property
    def matches(self) -> bool | None:
        return None if self.total is None else self.total == self.predicted

    def to_dict(self) -> dict[str, Any]:
        return {"tool": self.tool, "preset": self.preset, "status": self.status, "unit": self.unit,
                "total": self.total, "predicted": self.predicted if isinstance(self.predicted, int | None) else str(self.predicted),
                "matches": self.matches,
                "blind_spots": [{"module": b.module, "tool": b.tool_flops, "ops": list(b.ops),
                                 "convention": b.convention_flops if isinstance(b.convention_flops, int)
                                 else str(b.convention_flops)} for b in self.blind_spots]}


def run_tools(comparison: Any, model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None,
              why_not_real: str = "") -> list[ToolRun]:
    """Run every tool a preset of the comparison reproduces, on `model(*args, **kwargs)`, and attach the
    results to `comparison.tools` (also returned). `why_not_real`: why the caller could not give a model
    with real weights, said by each tool that needs one when the model is on the meta device."""
    args, kwargs = _positional(model, tuple(args), dict(kwargs or {}))
    runs = []
    for name in comparison.presets:
        preset_name, attention = comparison.readings.get(name, (name, "dense"))
        runner = _runner_for(PRESET_TABLE.presets[preset_name].tool or "") if preset_name == name else None
        if runner is None:
            continue
        if attention != "dense":  # every tool counts attention over every (query, key) pair
            tool = (PRESET_TABLE.presets[name].tool or name).split(":")[0].split(" (")[0].split(".")[-1]
            runs.append(ToolRun(tool, name, "skipped: this comparison counts attention effective and the "
                                "tools count every (query, key) pair; compare an estimate counted with "
                                "attention='dense'"))
            continue
        with _left_as_found(model):
            runs.append(runner(name, _ForwardView(comparison), model, tuple(args), kwargs, why_not_real))
    comparison.tools = runs
    return runs


class _ForwardView:
    """The comparison as the tools see it: forward only (they run one forward, never the backward)."""

    def __init__(self, comparison: Any) -> None:
        self._comparison = comparison
        self.totals = comparison.forward or comparison.totals
        self.modules = ({module: {name: (0, flops) for name, flops in values.items()}
                         for module, values in comparison.forward_modules.items()}
                        if comparison.forward_modules else comparison.modules)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comparison, name)


@contextlib.contextmanager
def _left_as_found(model: torch.nn.Module) -> Iterator[None]:
    """The model as it was after a tool's real forward: hooks a tool leaves (ptflops' aten backend does),
    buffers a forward updates (batch norm's running statistics in training mode), RNG states."""
    from fxflops.capture.isolation import isolated

    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()
               if not buffer.is_meta and buffer.layout == torch.strided]
    with isolated(model):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)


def _runner_for(tool: str) -> Any:
    if tool.startswith("torch.utils.flop_counter"):
        return _flop_counter_mode
    if tool.startswith("fvcore"):
        return _fvcore
    if tool.startswith("ptflops"):
        return _ptflops
    if tool.startswith("DeepSpeed"):
        return _deepspeed
    return None


# --- the tools ------------------------------------------------------------------------------------


def _flop_counter_mode(name: str, comparison: Any, model: torch.nn.Module, args: tuple, kwargs: dict,
                       why_not_real: str = "") -> ToolRun:
    from torch.utils.flop_counter import FlopCounterMode

    tool = "FlopCounterMode"
    try:
        with _quiet(), torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the tool's failure is its result
        return ToolRun(tool, name, f"failed: {type(error).__name__}: {str(error)[:120]}")
    root = type(model).__name__
    per_module = {}
    for key, ops in counter.get_flop_counts().items():
        if key == root or key.startswith(root + "."):
            per_module[key[len(root) + 1:]] = sum(ops.values())
    total = counter.get_total_flops()
    return ToolRun(tool, name, "ran", "FLOPs", total, comparison.totals[name][1],
                   blind_spots(comparison, name, per_module, total))


def _fvcore(name: str, comparison: Any, model: torch.nn.Module, args: tuple, kwargs: dict,
            why_not_real: str = "") -> ToolRun:
    tool = "fvcore"
    why = _cannot_run_real("fvcore", model, args, kwargs, keywords=False, why_not_real=why_not_real)
    if why:
        return ToolRun(tool, name, why)
    from fvcore.nn import FlopCountAnalysis

    try:
        with _quiet():
            analysis = FlopCountAnalysis(model, args).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
            total = int(analysis.total())
            per_module = analysis.by_module()
    except Exception as error:  # noqa: BLE001
        return ToolRun(tool, name, f"failed: {type(error).__name__}: {str(error)[:120]}")
    return ToolRun(tool, name, "ran", "FLOPs", total, comparison.totals[name][1],
                   blind_spots(comparison, name, dict(per_module), total))


def _ptflops(name: str, comparison: Any, model: torch.nn.Module, args: tuple, kwargs: dict,
             why_not_real: str = "") -> ToolRun:
    tool_text = PRESET_TABLE.presets[name].tool or ""
    backend = "aten" if "backend='aten'" in tool_text or 'backend="aten"' in tool_text else "pytorch"
    tool = f"ptflops ({backend} backend)"
    why = _cannot_run_real("ptflops", model, args, kwargs, keywords=True, why_not_real=why_not_real)
    if why:
        return ToolRun(tool, name, why, "MACs")
    if len(args) > 1 or (args and kwargs):
        return ToolRun(tool, name, "skipped: ptflops feeds one input tensor or one dict of keyword inputs", "MACs")
    from ptflops import get_model_complexity_info

    def construct(_resolution: Any) -> Any:
        return dict(kwargs) if kwargs else args[0]

    shape = tuple(args[0].shape) if args else (1,)
    try:
        with _quiet():
            macs, _params = get_model_complexity_info(model, shape, input_constructor=construct, as_strings=False,
                                                      print_per_layer_stat=False, verbose=False, backend=backend)
    except Exception as error:  # noqa: BLE001
        return ToolRun(tool, name, f"failed: {type(error).__name__}: {str(error)[:120]}", "MACs")
    if macs is None:
        return ToolRun(tool, name, "failed: ptflops returned no count", "MACs")
    return ToolRun(tool, name, "ran", "MACs", int(macs), comparison.totals[name][0])


def _deepspeed(name: str, comparison: Any, model: torch.nn.Module, args: tuple, kwargs: dict,
               why_not_real: str = "") -> ToolRun:
    tool = "DeepSpeed"
    why = _cannot_run_real("deepspeed", model, args, kwargs, keywords=True, why_not_real=why_not_real)
    if why:
        return ToolRun(tool, name, why)
    try:
        with _quiet():
            from deepspeed.profiling.flops_profiler import FlopsProfiler, get_module_flops

            profiler = FlopsProfiler(model)
            profiler.start_profile()
            try:
                with torch.no_grad():
                    model(*args, **kwargs)
                total = int(profiler.get_total_flops())
                per_module = {path: int(get_module_flops(module)) for path, module in model.named_modules()}
            finally:
                profiler.end_profile()
    except Exception as error:  # noqa: BLE001
        return ToolRun(tool, name, f"failed: {type(error).__name__}: {str(error)[:120]}")
    return ToolRun(tool, name, "ran", "FLOPs", total, comparison.totals[name][1],
                   blind_spots(comparison, name, per_module, total))


# --- helpers --------------------------------------------------------------------------------------


def _positional(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Keyword inputs that are the forward's leading parameters passed by position, as users of
    positional-only tools (fvcore) pass them; otherwise as given."""
    import inspect

    try:
        parameters = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return args, kwargs
    leading = parameters[len(args):len(args) + len(kwargs)]
    if kwargs and set(leading) == set(kwargs):
        return (*args, *(kwargs[key] for key in leading)), {}
    return args, kwargs


def on_meta(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether any weight, buffer or input is on the meta device (or fake): no real forward can run."""
    tensors = [*model.parameters(), *model.buffers(),
               *(t for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor))]
    return any(t.is_meta or isinstance(t, torch._subclasses.FakeTensor) for t in tensors)


def real_tools_installed() -> list[str]:
    """The installed tools that run a real forward (and so need real weights)."""
    return [package for package in ("fvcore", "ptflops", "deepspeed") if importlib.util.find_spec(package)]


def _cannot_run_real(package: str, model: torch.nn.Module, args: tuple, kwargs: dict, keywords: bool,
                     why_not_real: str = "") -> str:
    """Why the tool cannot run here ('' when it can): not installed, or no real weights and inputs."""
    if importlib.util.find_spec(package) is None:
        return f"not installed (pip install {package})"
    if on_meta(model, args, kwargs):
        return f"skipped: it runs a real forward, and {why_not_real or 'the weights or inputs are on the meta device'}"
    if kwargs and not keywords:
        return "skipped: it takes positional inputs only"
    return ""


def blind_spots(comparison: Any, name: str, tool_modules: dict[str, int], total: int) -> list[BlindSpot]:
    """The innermost modules whose count by the tool is not what preset `name` gives them (the tool's
    per-module numbers, "" for the model), each with the ops it ran itself that the preset counts."""
    if total == comparison.totals[name][1]:
        return []
    differs = {module for module, values in comparison.modules.items()
               if tool_modules.get(module, 0) != values[name][1]}
    spots = []
    for module in differs:
        prefix = module + "." if module else ""
        if any(other != module and other.startswith(prefix) for other in differs):
            continue  # a submodule differs: the cause is further in
        ops = tuple(op for op, flops in comparison.module_ops.get(module, {}).items() if flops[name])
        spots.append(BlindSpot(module, tool_modules.get(module, 0), comparison.modules[module][name][1], ops))
    return sorted(spots, key=lambda spot: spot.module)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The tools print tables and warnings of their own: keep them out of our report."""
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield
