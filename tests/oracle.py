"""The independent oracle: torch.utils.flop_counter.FlopCounterMode, run so it sees every op."""

from __future__ import annotations

import contextlib
import math
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


def _solve_triangular_flops(a_shape, b_shape, *, upper, left=True, unitriangular=False, out_shape=None):
    # from the definition: each RHS (a column of X, or a row when left=False) takes n(n+1)/2
    # multiplications/divisions and n(n-1)/2 additions against the n x n triangle; n(n-1) without
    # the divisions when the diagonal is 1
    n = a_shape[-1]
    rhs = math.prod(out_shape) // n
    return rhs * (n * (n - 1) if unitriangular else n * n)


def _triangular_solve_flops(b_shape, a_shape, upper=True, transpose=False, unitriangular=False, out_shape=None):
    n = a_shape[-1]
    rhs = math.prod(out_shape[0]) // n
    return rhs * (n * (n - 1) if unitriangular else n * n)


# FlopCounterMode has no formula for triangular solves; the tests give it this one where they need it
TRSM_COUNTS = {
    torch.ops.aten.linalg_solve_triangular: _solve_triangular_flops,
    torch.ops.aten.triangular_solve: _triangular_solve_flops,
}


def oracle_flops(model: torch.nn.Module, args: tuple = (), kwargs: dict[str, Any] | None = None,
                 custom_mapping: dict | None = None) -> int:
    """FlopCounterMode's total for one real forward of `model` (plus `custom_mapping`'s formulas)."""
    with torch.no_grad(), _no_fused_attention(), FlopCounterMode(display=False, custom_mapping=custom_mapping) as counter:
        model(*args, **(kwargs or {}))
    return counter.get_total_flops()


def oracle_training_flops(model: torch.nn.Module, args: tuple = (), kwargs: dict[str, Any] | None = None,
                          loss=None) -> tuple[int, int]:
    """(forward, backward) FLOPs FlopCounterMode counts for one real forward and `loss(output).backward()`.

    The default loss is the sum of the output's floating tensors that require grad; gradients the
    model's parameters get are cleared again."""
    with _no_fused_attention(), FlopCounterMode(display=False) as counter:
        output = model(*args, **(kwargs or {}))
        forward = counter.get_total_flops()
        if loss is None:
            from fxflops.capture.tensor_walk import tensors_in

            value = sum(t.sum() for t in tensors_in(output) if t.is_floating_point() and t.requires_grad)
        else:
            value = loss(output)
        if isinstance(value, torch.Tensor) and value.requires_grad:
            value.backward()
        total = counter.get_total_flops()
    model.zero_grad(set_to_none=True)
    return forward, total - forward


class _FlexFormulas(torch.utils._python_dispatch.TorchDispatchMode):
    """FlopCounterMode's own flex_attention / flex_attention_backward formulas (flop_counter.flop_registry)
    applied to the flex operator calls, which FlopCounterMode's mode cannot run eagerly in torch 2.14 (it
    answers NotImplemented for them); each call then runs with every mode off."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator) and func in flop_registry:
            self.flops += flop_registry[func](*args, **kwargs, out_val=None)
            with torch.utils._python_dispatch._disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def oracle_flex_flops(model: torch.nn.Module, args: tuple = (), backward: bool = False) -> tuple[int, int]:
    """(forward, backward) FLOPs of one real run of a model calling flex_attention: FlopCounterMode for
    every aten op plus its own flex formulas (_FlexFormulas); flex_attention's torch.compile runs eagerly."""
    grad = torch.enable_grad() if backward else torch.no_grad()  # (torch has no flex backward on the CPU)
    with grad, torch.compiler.set_stance("force_eager"), FlopCounterMode(display=False) as counter, _FlexFormulas() as flex:
        try:
            output = model(*args)
        except TypeError as error:
            if "TransformGetItemToIndex" not in str(error):
                raise
            # torch 2.11's eager flex_attention re-enters its own HOP under its TransformGetItemToIndex
            # function mode, which does not handle it, once any dispatch mode is active: torch's own, no oracle
            import pytest

            pytest.skip(f"torch {torch.__version__}: FlopCounterMode cannot run higher_order.flex_attention "
                        "eagerly (TypeError in TransformGetItemToIndex); the oracle needs torch >= 2.14")
        forward = counter.get_total_flops() + flex.flops
        if backward:
            output.sum().backward()
        total = counter.get_total_flops() + flex.flops
    model.zero_grad(set_to_none=True)
    return forward, total - forward
