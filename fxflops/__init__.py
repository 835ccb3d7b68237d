"""fxflops: MACs, FLOPs and parameters per module from a traced graph and a rule table.

Every public name is imported on first use: `import fxflops` itself loads nothing heavy, so the
`fxflops` command can take Ctrl-C quietly while torch is still loading (fxflops.cli.console), and sweeps
need sympy only when used.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = MappingProxyType({
    **dict.fromkeys(("CautionWarning", "UnknownOpsError", "UnknownOpsWarning", "annotate", "estimate"), "fxflops.api"),
    "CaptureError": "fxflops.capture",
    "capturing": "fxflops.capture.running",
    "RuleEvaluationError": "fxflops.count",
    "FormulaError": "fxflops.rules.formula",
    "profile_generate": "fxflops.timing.generate",
    **dict.fromkeys(("FlopsMeter", "FlopsMeterWarning"), "fxflops.timing.meter"),
    "profile": "fxflops.timing.profiling",
    "Parallel": "fxflops.parallel.plan",
    "predict_step": "fxflops.predict.step",
    "plan": "fxflops.predict.search",
    **dict.fromkeys(("Estimate", "Measurements", "ModuleStats", "NodeCost", "Profile", "UnknownOp"), "fxflops.results"),
    **dict.fromkeys(("CONVENTIONS", "OpCall", "RuleFileError", "RuleFileWarning"), "fxflops.rules"),
    **dict.fromkeys(("sweep", "Sweep", "SweepCaptureError"), "fxflops.sweeps"),
})

__all__ = sorted(_EXPORTS, key=lambda name: (name[0].islower(), name))

if TYPE_CHECKING:
    from fxflops.api import CautionWarning, UnknownOpsError, UnknownOpsWarning, annotate, estimate
    from fxflops.capture import CaptureError
    from fxflops.capture.running import capturing
    from fxflops.count import RuleEvaluationError
    from fxflops.rules.formula import FormulaError
    from fxflops.timing.generate import profile_generate
    from fxflops.timing.meter import FlopsMeter, FlopsMeterWarning
    from fxflops.timing.profiling import profile
    from fxflops.parallel.plan import Parallel
    from fxflops.predict.search import plan
    from fxflops.predict.step import predict_step
    from fxflops.results import Estimate, Measurements, ModuleStats, NodeCost, Profile, UnknownOp
    from fxflops.rules import CONVENTIONS, OpCall, RuleFileError, RuleFileWarning
    from fxflops.sweeps import Sweep, SweepCaptureError, sweep


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(_imported(_EXPORTS[name]), name)
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return _imported(f"{__name__}.{name}")  # `import fxflops; fxflops.rules...`
    raise AttributeError(f"module 'fxflops' has no attribute {name!r}")


def _imported(module: str) -> Any:
    """`module`, imported with the garbage collector paused: the first use of estimate imports ~75 modules,
    whose objects made a full collection of torch's heap (0.2-0.3 s) likely inside a user's first call."""
    from fxflops.collector import collector_paused

    with collector_paused():
        return importlib.import_module(module)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
