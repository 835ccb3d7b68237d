"""fxflops: MACs, FLOPs and parameters per module from a traced graph and a rule table."""

from fxflops.api import CautionWarning, UnknownOpsWarning, annotate, estimate
from fxflops.capture import CaptureError
from fxflops.count import RuleEvaluationError
from fxflops.formula import FormulaError
from fxflops.generate import profile_generate
from fxflops.meter import FlopsMeter, FlopsMeterWarning
from fxflops.profiling import profile
from fxflops.results import Estimate, Measurements, ModuleStats, NodeCost, Profile, UnknownOp
from fxflops.rules import CONVENTIONS, OpCall, RuleFileError, RuleFileWarning

__version__ = "0.1.0"

__all__ = [
    "CONVENTIONS", "CaptureError", "CautionWarning", "Estimate", "FlopsMeter", "FlopsMeterWarning", "FormulaError", "Measurements", "ModuleStats", "NodeCost", "OpCall", "Profile",
    "RuleEvaluationError", "RuleFileError", "RuleFileWarning", "Sweep", "SweepCaptureError", "UnknownOp", "UnknownOpsWarning", "annotate",
    "estimate", "profile", "profile_generate", "sweep",
]


def __getattr__(name: str):
    # sweeps need sympy, whose import costs half a second: loaded on first use, not with fxflops
    if name in ("sweep", "Sweep", "SweepCaptureError"):
        from fxflops import sweeps

        return getattr(sweeps, name)
    raise AttributeError(f"module 'fxflops' has no attribute {name!r}")
