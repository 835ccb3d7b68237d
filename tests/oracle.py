"""The independent oracle: torch.utils.flop_counter.FlopCounterMode, run so it sees every op."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode


@contextlib.contextmanager
def _no_fused_attention():
    # on CPU the MHA fast path and fused SDPA kernels are invisible to FlopCounterMode
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


def oracle_flops(model: torch.nn.Module, args: tuple = (), kwargs: dict[str, Any] | None = None) -> int:
    """FlopCounterMode's total for one real forward of `model`."""
    with torch.no_grad(), _no_fused_attention(), FlopCounterMode(display=False) as counter:
        model(*args, **(kwargs or {}))
    return counter.get_total_flops()
