"""torch's own logging kept quiet while a capture runs, and restored after.

Capturing on fake tensors makes torch log what a real run never would: a Mixtral-style MoE in float32
logs a traceback per `_grouped_mm` call (its meta kernel takes bf16 only; the count falls back and
succeeds), and a failed capture logs one before fxflops' own message says what failed. Those lines
are noise to the user: every failure fxflops cannot get past it reports itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

_SILENT = logging.CRITICAL + 1  # above every level torch logs at

# torch's structured trace (TORCH_TRACE) is left as it is while it writes nothing: it does not propagate, and its
# one handler writes files only where TORCH_TRACE names a directory; without one the handler takes itself off at its
# first record. Raised, it writes nothing, yet torch goes on building every record it would write while that
# handler stays (a symbolic capture's new symbols and guards, each with its Python and C++ stacks: ~1 ms apiece).
# Where a handler of it writes (TORCH_TRACE names a directory, or a handler of the user's), it is raised with the
# rest: the user's trace files hold their own runs, not a capture's fake-tensor records (torch builds those
# records either way there, so raising it costs nothing)
STRUCTURED_TRACE = "torch.__trace"


@contextmanager
def torch_logging_quiet() -> Iterator[None]:
    """Raise torch's loggers (those with a level of their own; the rest inherit it, and the structured trace
    stays as it is while it writes nothing) above CRITICAL for the duration, then restore each one's level."""
    loggers = [logging.getLogger("torch")] + [
        logger for name, logger in list(logging.Logger.manager.loggerDict.items())
        if name.startswith("torch.") and isinstance(logger, logging.Logger) and logger.level != logging.NOTSET
        and (name != STRUCTURED_TRACE or _writes(logger))]
    levels = [logger.level for logger in loggers]
    _set_levels(loggers, [_SILENT] * len(loggers))
    try:
        yield
    finally:
        _set_levels(loggers, levels)


def _writes(trace: logging.Logger) -> bool:
    """Whether a handler of the structured trace writes its records: any but torch's own without a directory
    (TORCH_TRACE unset: it writes nothing and takes itself off at its first record)."""
    return any(getattr(handler, "root_dir", True) is not None for handler in trace.handlers)


def _set_levels(loggers: list[logging.Logger], levels: list[int]) -> None:
    """Each logger's level set (ints, as read from loggers). setLevel also empties every logger's level
    cache, ~20 us a call with transformers' loggers: the first logger's setLevel, last, empties them once for all."""
    for logger, level in zip(loggers[1:], levels[1:], strict=True):
        logger.level = level
    loggers[0].setLevel(levels[0])
