"""Forwards that use torch.func transforms (vmap, jvp, grad, jacrev, jacfwd, per-sample gradients):
the batched and tangent work is counted, as FlopCounterMode counts it, not one unbatched call."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, jacfwd, jacrev, jvp, vmap

import fxflops
from tests.oracle import oracle_flops


class MatVec(nn.Module):
    """The issue's example: a 30x40 weight times each of the input's vectors, under vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(30, 40))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vmap(lambda v: self.w @ v)(x)


class TwoLayer(nn.Module):
    """Inside the transforms only functional ops on the parameters (FlopCounterMode's module tracker
    cannot follow a submodule called under torch.func.grad)."""

    def __init__(self, transform: str) -> None:
        super().__init__()
        self.transform = transform
        self.w1, self.b1 = nn.Parameter(torch.randn(30, 40)), nn.Parameter(torch.randn(30))
        self.w2, self.b2 = nn.Parameter(torch.randn(5, 30)), nn.Parameter(torch.randn(5))

    def f(self, v: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(F.linear(v, self.w1, self.b1)), self.w2, self.b2)

    def loss(self, params: tuple, v: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2 = params
        return F.linear(torch.tanh(F.linear(v, w1, b1)), w2, b2).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transform == "jvp":
            return jvp(self.f, (x,), (torch.ones_like(x),))[1]
        if self.transform == "grad":
            return grad(lambda v: self.f(v).sum())(x)
        if self.transform == "jacrev":
            return jacrev(self.f)(x)
        if self.transform == "jacfwd":
            return jacfwd(self.f)(x)
        if self.transform == "per_sample_grad":
            params = (self.w1, self.b1, self.w2, self.b2)
            return vmap(grad(self.loss), in_dims=(None, 0))(params, x)[0]
        if self.transform == "hvp":
            return jvp(grad(lambda v: self.f(v).sum()), (x,), (torch.ones_like(x),))[1]
        raise AssertionError(self.transform)


class VmappedSubmodules(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(40, 30)
        self.out = nn.Linear(30, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vmap(lambda row: self.out(torch.relu(self.lin(row))), in_dims=1)(x)


def _estimate(model: nn.Module, x: torch.Tensor, **options) -> fxflops.Estimate:
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxflops.UnknownOpsWarning)  # nothing may go unknown
        return fxflops.estimate(model, (x,), **options)


def test_vmapped_matvec_counts_every_vector_by_hand() -> None:
    # 8 vectors x (30 x 40) multiply-accumulates; FlopCounterMode: 19,200 FLOPs
    model, x = MatVec(), torch.randn(8, 40)
    assert oracle_flops(model, (x,)) == 19_200
    for method in ("eager", "trace"):
        assert _estimate(model, x, method=method).total_macs == 8 * 30 * 40
        assert _estimate(model, x, method=method, conventions="torch").total_flops == 19_200


@pytest.mark.parametrize("transform", ["jvp", "grad", "jacrev", "jacfwd", "per_sample_grad", "hvp"])
@pytest.mark.parametrize("method", ["eager", "trace"])
def test_function_transforms_count_as_flop_counter_mode(transform: str, method: str) -> None:
    model, x = TwoLayer(transform), torch.randn(6, 40)
    expected = oracle_flops(model, (x,))
    assert _estimate(model, x, method=method, conventions="torch").total_flops == expected


def test_vmap_over_submodules_counts_as_flop_counter_mode() -> None:
    model, x = VmappedSubmodules(), torch.randn(16, 7)
    model.lin = nn.Linear(16, 30)
    expected = oracle_flops(model, (x,))
    # per vmapped column: (16 x 30 + 30 x 5) MACs, 7 columns, as one addmm each
    assert expected == 2 * 7 * (16 * 30 + 30 * 5)
    estimate = _estimate(model, x, conventions="torch")
    assert estimate.total_flops == expected
    assert estimate.modules["lin"].macs == 7 * 16 * 30
