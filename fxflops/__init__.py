"""fxflops: MACs, FLOPs and parameters per module from a traced graph and a rule table."""

from fxflops.api import UnknownOpsWarning, annotate, estimate
from fxflops.capture import CaptureError
from fxflops.count import RuleEvaluationError
from fxflops.formula import FormulaError
from fxflops.generate import profile_generate
from fxflops.profiling import profile
from fxflops.results import Estimate, Measurements, ModuleStats, NodeCost, Profile, UnknownOp
from fxflops.rules import OpCall, RuleFileError

__version__ = "0.1.0"

__all__ = [
    "CaptureError", "Estimate", "FormulaError", "Measurements", "ModuleStats", "NodeCost", "OpCall", "Profile",
    "RuleEvaluationError", "RuleFileError", "UnknownOp", "UnknownOpsWarning", "annotate", "estimate", "profile",
    "profile_generate",
]
