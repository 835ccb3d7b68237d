"""`--train --device GPU`: whether one training step fits in the device's memory, and the largest
micro-batch that does, in one line (fxflops.memory.fit: three captures, the answer checked by two more)."""

from __future__ import annotations

import argparse
import warnings
from typing import Any


def fit_line(model: Any, loaded: Any, args: argparse.Namespace) -> str | None:
    """The line, or None where the device has no memory size in the table (nothing to fit against)."""
    from fxflops.api import estimate
    from fxflops.memory import MemoryOptions
    from fxflops.memory.devices import device_capacity
    from fxflops.memory.fit import inputs_at_batch, largest_micro_batch
    from fxflops.report.memory_text import memory_to_string

    try:
        device, capacity = device_capacity(args.device)
    except ValueError:
        return None
    options = MemoryOptions(device=device, device_bytes=capacity)
    step = "forward + backward" + (f" + {args.optimizer}" if args.optimizer else "")

    def measure(batch: int | None = None) -> Any:
        inputs = (loaded.args, loaded.kwargs) if batch is None else inputs_at_batch(loaded.args, loaded.kwargs, batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the report's own estimate has said what there is to say
            return estimate(model, *inputs, method="eager", conventions=args.conventions, rules=args.rules,
                            backward=True, optimizer=args.optimizer, parallel=args.parallel, memory=options).memory

    try:
        memory = measure()
    except (ValueError, RuntimeError, NotImplementedError) as error:
        return f"training step ({step}) on {device}: memory not estimated ({str(error).splitlines()[0]})"
    verdict = (f"fits, {memory_to_string(memory.headroom)} headroom" if memory.fits else
               f"does not fit, {memory_to_string(-memory.headroom)} over")
    try:
        found = largest_micro_batch(measure, capacity)
        largest = f"largest micro-batch that fits: {found.largest:,}" if found.largest else \
            "not even a micro-batch of 1 fits"
    except (ValueError, RuntimeError, NotImplementedError) as error:
        largest = f"largest micro-batch not found ({str(error).splitlines()[0]})"
    return (f"training step ({step}) on {device} ({memory_to_string(capacity)}): {verdict} at the given micro-batch "
            f"({memory_to_string(memory.device_bytes)} with the allowance); {largest}")
