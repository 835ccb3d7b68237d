"""Why a capture method failed: the error's first lines, the module and op where it broke, the user's line."""

from __future__ import annotations

import traceback
from collections.abc import Sequence

import torch

from fxflops.capture.attribution import NAME_TAG
from fxflops.capture.module_walk import walk_modules
from fxflops.capture.recorder import LIBRARY_DIRS
from fxflops.results import ROOT_LABEL, Attempt



class CaptureError(RuntimeError):
    """Every capture method failed; lists each attempt, where it broke and what to try."""

    def __init__(self, model_type: str, attempts: Sequence[Attempt]) -> None:
        self.model_type = model_type
        self.attempts = list(attempts)
        self.advice: str | None = None  # what the caller knows to try, appended to summary()
        lines = [f"fxflops could not capture {model_type}: every method failed."]
        for attempt in attempts:
            lines.append(f"  - {attempt.method}: {attempt.reason}")
            if attempt.module is not None:
                lines.append(f"      in module '{attempt.module or ROOT_LABEL}'" + (f", op {attempt.op}" if attempt.op else ""))
            if attempt.source:
                lines.append(f"      at {attempt.source}")
        lines.append(
            "What to try: check the input shapes against the model; for control flow that depends on tensor "
            "values pass real weights and inputs with method='trace'; mark custom blocks with "
            "leaf_modules=[...] and give them a rule."
        )
        super().__init__("\n".join(lines))


    def summary(self) -> str:
        """One line: the decisive reason (the first method that ran), where, and how the others ended."""
        ran = [a for a in self.attempts if not a.reason.startswith("skipped")]
        if not ran:
            return f"could not capture {self.model_type}: " + "; ".join(f"{a.method} {a.reason}" for a in self.attempts)
        decisive = ran[0]
        where = f" in module '{decisive.module or ROOT_LABEL}'" if decisive.module is not None else ""
        at = f" at {decisive.source}" if decisive.source else ""
        others = [f"{a.method} {'skipped' if a.reason.startswith('skipped') else 'failed'}"
                  for a in self.attempts if a is not decisive]
        return (f"could not capture {self.model_type}: {decisive.method}: {decisive.reason}{where}{at}"
                + (f" ({', '.join(others)})" if others else "") + (f"; {self.advice}" if self.advice else ""))


def describe_failure(method: str, error: BaseException, model: torch.nn.Module) -> Attempt:
    """The error's first lines, the innermost module whose forward was running, and the user's line."""
    frames = traceback.extract_tb(error.__traceback__)
    user_frames = [f for f in frames if not f.filename.startswith(LIBRARY_DIRS) and "<frozen" not in f.filename]
    source = None
    if user_frames:
        frame = user_frames[-1]
        source = f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return Attempt(method, _first_lines(error), _failing_module(error, model), source, _failing_op(error),
                   reads_values(error))


def _failing_op(error: BaseException) -> str | None:
    """The aten op whose shape function raised (fake and meta kernels run it as `func`)."""
    op = None
    tb = error.__traceback__
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("func")
        if isinstance(candidate, torch._ops.OpOverload):
            op = str(candidate)
        tb = tb.tb_next
    return op


def _first_lines(error: BaseException, limit: int = 3) -> str:
    if _torch_value_error(error):  # torch's words say little; ours (ValueReadError, export's) say it already
        first = (str(error).strip().splitlines() or [""])[0][:200]
        return (f"{type(error).__name__}: the forward reads a tensor's value ({first}: .item(), "
                "bool(), or a size taken from data), so its control flow or sizes depend on tensor values, "
                "which fake tensors do not have")
    text = str(error).strip() or type(error).__name__
    lines = [line for line in text.splitlines() if line.strip()][:limit]
    return f"{type(error).__name__}: " + " | ".join(line.strip() for line in lines)


class DataDependentSizes(RuntimeError):
    """A captured graph whose sizes depend on tensor values (export succeeded; costs need real sizes)."""


def reads_values(error: BaseException) -> bool:
    """Whether the failure came from a tensor's value (control flow or a size read from data), here or in
    the error it wraps (export and dynamo re-raise torch's own): the one kind a run on real inputs can fix."""
    from fxflops.capture.input_values import ValueReadError

    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (ValueReadError, DataDependentSizes)) or _torch_value_error(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _torch_value_error(error: BaseException) -> bool:
    """torch's own exceptions for a value or a data-dependent size that fake tensors do not have."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return isinstance(error, (DataDependentOutputException, DynamicOutputShapeException)) \
        or type(error).__name__ == "GuardOnDataDependentSymNode"


def _failing_module(error: BaseException, model: torch.nn.Module) -> str | None:
    """Qualified name of the innermost module whose forward() is on the failing stack."""
    names = {id(module): name for name, module, alias_of in walk_modules(model) if alias_of is None}
    innermost = None
    tb = error.__traceback__
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if tb.tb_frame.f_code.co_name == "forward" and isinstance(candidate, torch.nn.Module):
            tagged = candidate.__dict__.get(NAME_TAG)
            innermost = (tagged if tagged is not None else names.get(id(candidate))) or innermost
        tb = tb.tb_next
    return innermost
