"""flex_attention under a capture: each call recorded as one node, forward and backward.

Eager `torch.nn.attention.flex_attention.flex_attention` wraps its higher-order operator (HOP) in
`torch.compile(fullgraph=True)`, which cannot run under a capture's fake tensors and dispatch mode.
Under torch's own context-managed `torch.compiler.set_stance("force_eager")` that wrapper runs
eagerly, and the HOP reaches the capture as one call: `flex_attention(query, key, value, score_mod,
block_mask.as_tuple(), scale, kernel_options, ...)`, and in the backward `flex_attention_backward`.
`fxflops.capture.recorder` records each as one node: the forward where CompositeOps sees the call,
before autograd (what runs inside it, the HOP's autograd tracing its score_mod included, is flex's,
not the model's), the backward where autograd's call reaches the dispatch mode. `fxflops.rules.flex`
reads its BlockMask.

torch warns once per process that flex_attention ran without torch.compile: a capture is not a run,
so that warning is silenced while one runs. torch itself refuses flex_attention's backward on the CPU;
a training count of a flex model is captured where the model runs (CUDA).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator

import torch

# the HOPs recorded whole: torch._higher_order_ops.flex_attention registers them as torch imports
FLEX_HOPS = frozenset(getattr(torch.ops.higher_order, name) for name in ("flex_attention", "flex_attention_backward")
                      if hasattr(torch.ops.higher_order, name))

# modules whose presence says a forward may call flex_attention (or another torch.compile'd function)
_COMPILE_MODULES = ("torch._dynamo", "torch.nn.attention.flex_attention")


@contextlib.contextmanager
def flex_runs_eagerly() -> Iterator[None]:
    """torch.compile calls inside the body run eagerly (flex_attention's wrapper among them), without
    flex_attention's warning that it ran uncompiled. The stance is entered only where flex_attention's
    module or dynamo is loaded already: entering it imports dynamo (1.5 s), which a model that never
    calls torch.compile does not need."""
    if not any(name in sys.modules for name in _COMPILE_MODULES):
        yield
        return
    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings(), _warned_once_kept():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)
        yield


_UNCOMPILED_WARNING = "flex_attention_performance"  # the id torch's _warn_once files it under


@contextlib.contextmanager
def _warned_once_kept() -> Iterator[None]:
    """torch marks its once-per-process warning as shown even when a filter hid it: a capture's silenced
    one is unmarked again, so the user's own first uncompiled call still warns."""
    flex = sys.modules.get("torch.nn.attention.flex_attention")
    shown = getattr(flex, "_WARNINGS_SHOWN", None)
    already = not isinstance(shown, set) or _UNCOMPILED_WARNING in shown
    try:
        yield
    finally:
        if not already:
            shown.discard(_UNCOMPILED_WARNING)
