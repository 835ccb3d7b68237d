"""Progress on a terminal: which stage a long run is in (load, capture, count, report), on one line.

Shown only where someone watches — the stream is a terminal — and never in pipes, files or CI logs,
so machine-readable output and captured stderr stay clean.
"""

from __future__ import annotations

import time
from typing import TextIO

_CLEAR_LINE = "\r\033[K"


class StageProgress:
    """Call with a stage's name as it starts; `done()` clears the line. Silent unless `enabled`."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.started = time.perf_counter()
        self.shown = False

    @classmethod
    def on_terminal(cls, stream: TextIO, quiet: bool = False) -> StageProgress:
        """Enabled when `stream` is a terminal and the user did not ask for quiet."""
        is_terminal = getattr(stream, "isatty", lambda: False)()
        return cls(stream, enabled=is_terminal and not quiet)

    def __call__(self, stage: str) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.started
        self.stream.write(f"{_CLEAR_LINE}fxflops: {stage}... ({elapsed:.1f} s)")
        self.stream.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown:
            self.stream.write(_CLEAR_LINE)
            self.stream.flush()
            self.shown = False
