"""Real computation fxflops runs beside a capture, on one CPU thread.

A capture computes a few small tensors for real (capture.input_values: masks, positions, lengths from the
example inputs; rules.mask_values: an attention mask's kept pairs). Each is far too small for torch's
intra-op thread pool to pay: with two threads on a busy machine, an op on 4,096 elements took 8 ms of
CPU spinning on the pool's barrier, against 0.05 ms on one thread. `one_thread()` runs them on the
calling thread and puts torch's thread count back as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 for the duration, then as they were."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
