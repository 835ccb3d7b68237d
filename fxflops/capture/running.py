"""Whether this thread is inside a capture: the model's forward then runs on fake tensors (or is traced,
or runs once for a trace) to be counted, not as a step of the user's program.

fxflops' own hooks (a FlopsProfiler's or profile()'s timers) read this and stay silent, so one profiler
does not time or count the forwards another one's estimate runs. A context variable, so each thread
(and asyncio task) has its own answer.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_CAPTURING: contextvars.ContextVar[bool] = contextvars.ContextVar("fxflops_capturing", default=False)


def capturing() -> bool:
    """True while a capture runs the model on this thread."""
    return _CAPTURING.get()


@contextlib.contextmanager
def capture_running() -> Iterator[None]:
    """Mark the body as a capture (for this thread / task only)."""
    token = _CAPTURING.set(True)
    try:
        yield
    finally:
        _CAPTURING.reset(token)
