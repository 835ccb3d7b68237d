"""Python's cyclic garbage collector paused while fxflops allocates in bulk (a capture, its own first import).

Once torch (and torchvision or transformers) is loaded, a full collection walks their whole heap: 0.2-0.3 s
on a 2-core machine. Which allocation triggers one is chance; a capture (tens of thousands of objects) or
fxflops' first import (~75 modules, ~10,000 objects) made one likely, and a first estimate() took up to
twice as long as the next. Paused, the objects still count towards the next collection, which runs after,
as usual; nothing is left changed. Imports nothing heavy: `fxflops/__init__.py` uses it on first use of a name.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration, then as it was."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
