"""What capture hands to count: the captured graph and its modules, and the attempts that failed.

`Captured` is a graph whose op nodes carry fake values and the module that ran them, with the
model's modules (`ModuleInfo`), the modules a rule counts whole and their calls (`WholeCall`), and
the capture methods that failed before (`Attempt`). `CountSource` keeps a capture with the rule
table that counted it, so explain() and compare() can count it again. The phase constants name
which pass (forward, backward, recompute) ran an op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# which pass ran an op
FORWARD = "forward"
BACKWARD = "backward"
RECOMPUTE = "recompute"  # a forward run again inside the backward (activation checkpointing): backward work
PHASE = "fxflops_phase"  # node.meta key holding the phase, in graphs captured with the backward


@dataclass(frozen=True)
class Attempt:
    """One capture method that failed: why, and where (module, op, the user's source line)."""

    method: str
    reason: str
    module: str | None = None  # qualified name of the module whose forward raised, when known
    source: str | None = None  # "file:line: code" of the user's line where capture broke
    op: str | None = None  # the op being run when it broke, when known
    # it broke on a tensor's value (.item(), bool(), a data-dependent size): a run on real inputs may succeed
    reads_values: bool = False


@dataclass(frozen=True)
class WholeCall:
    """One call of a module that a rule counts as a whole: the module, its inputs and its output."""

    module: str  # qualified name
    target: Any  # the nn.Module itself, whose attributes the rule's formula reads
    args: tuple
    kwargs: dict
    out: Any
    phase: str = FORWARD  # RECOMPUTE when activation checkpointing ran it again in the backward


@dataclass(frozen=True)
class ModuleInfo:
    """One module of the model as the captured forward saw it (lazy modules materialized)."""

    type: str  # class name
    extra_repr: str
    children: tuple[str, ...]  # qualified names, definition order
    params: int  # parameters of this module and its submodules, each counted once at its first owner
    # parameters under this module counted elsewhere (tied weights): (name relative to this module,
    # qualified name of the first owner's parameter)
    shared: tuple[tuple[str, str], ...] = ()


@dataclass
class Captured:
    """A captured graph plus what the later stages need to attribute it.

    Every op node of `graph_module` carries meta["val"] (fake or meta values: shapes, no data) and
    meta["fxflops_module"] = (qualified name, class name) of the innermost module that ran it.
    """

    graph_module: torch.fx.GraphModule
    method: str  # a name from fxflops.capture.methods.METHODS
    modules: dict[str, ModuleInfo]  # qualified name -> module, pre-order, each module by its first name
    aliases: dict[str, str]  # second and later names of a module registered twice -> its first name
    module_calls: dict[str, int]  # qualified name -> forward calls seen while capturing
    whole_paths: frozenset[str] = frozenset()  # modules a rule counts as a whole
    whole_calls: list[WholeCall] = field(default_factory=list)  # their calls, inputs and outputs
    input_shapes: Any = ()  # (args, kwargs) with every tensor replaced by its shape
    attempts: list[Attempt] = field(default_factory=list)  # failed attempts before this one
    dtype: str | None = None  # the model's floating dtype as captured ("float32", "bfloat16")
    training: bool | None = None  # the model's training flag as captured (dropout, batch norm count differently)
    cautions: list[str] = field(default_factory=list)  # what a real forward would do differently (lookups)
    backward: bool = False  # the graph holds the backward too (nodes carry meta["fxflops_phase"])
    sizes: Any = None  # capture.dynamic.SizeSymbols when named sizes were symbolic, else None
    # a module with pre-hooks of its own -> the tensors its forward received after them (eager capture)
    forward_inputs: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class CountSource:
    """What an Estimate was counted from: its capture and the rule table (ours plus the user's)."""

    captured: Captured
    table: Any  # fxflops.rules.RuleTable
