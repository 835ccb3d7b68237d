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

# torch's structured trace (TORCH_TRACE) is left as it is: it prints nothing (it does not propagate, and its one
# handler writes files only where TORCH_TRACE names a directory; without one the handler takes itself off at its
# first record). Raised, it writes nothing, yet torch goes on building every record it would write while that
# handler stays (a symbolic capture's new symbols and guards, each with its Python and C++ stacks: ~1 ms apiece)
STRUCTURED_TRACE = "torch.__trace"


@contextmanager
def torch_logging_quiet() -> Iterator[None]:
    """Raise torch's loggers (those with a level of their own; the rest inherit it, and the structured trace
    stays as it is) above CRITICAL for the duration, then restore each one's level."""
    loggers = [logging.getLogger("torch")] + [
        logger for name, logger in list(logging.Logger.manager.loggerDict.items())
        if name.startswith("torch.") and name != STRUCTURED_TRACE and isinstance(logger, logging.Logger)
        and logger.level != logging.NOTSET]
    levels = [logger.level for logger in loggers]
    _set_levels(loggers, [_SILENT] * len(loggers))
    try:
        yield
    finally:
        _set_levels(loggers, levels)


def _set_levels(loggers: list[logging.Logger], levels: list[int]) -> None:
    """Each logger's level set (ints, as read from loggers). setLevel also empties every logger's level
    cache, ~20 us a call with transformers' loggers: the first logger's setLevel, last, empties them once for all."""
    for logger, level in zip(loggers[1:], levels[1:], strict=True):
        logger.level = level
    loggers[0].setLevel(levels[0])
