"""More values a forward reads (issue 39), each found in diffusers' or torchtitan's models: a weight-derived tensor
indexed by an input's mask, a size lifted in with torch.tensor(shape) and read back, histc over int64 router picks,
and repeated MoE blocks, which replay must run rather than copy. Exact numbers by hand or FlopCounterMode."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxflops
from tests.oracle import oracle_flops


def quietly(model, *args, **kwargs) -> fxflops.Estimate:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(model, *args, **kwargs)


class MaskedProjection(nn.Module):
    """GLM-Image's `prior_embedding[prior_token_drop] *= 0.0` and HunyuanVideo 1.5's `image[image_mask]`: the
    indexed tensor comes from the weights, the mask (which makes the size) from an input."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        features = self.embed(x)
        features[~keep] *= 0.0  # index_put_ with a mask
        return self.head(features[keep])  # only the kept rows


def test_a_weight_derived_tensor_indexed_by_an_input_mask_is_shaped_by_the_mask():
    model = MaskedProjection()
    x, keep = torch.randn(2, 5, 8), torch.tensor([[True, False, True, True, False], [False] * 4 + [True]])
    result = quietly(model, (x, keep), conventions="torch", method="eager")
    assert result.total_flops == oracle_flops(model, (x, keep))
    assert result.total_flops == 2 * 10 * 8 * 16 + 2 * 4 * 16 * 4  # 10 rows embedded, the 4 kept rows projected


class GridFromShape(nn.Module):
    """WanAnimate2's `torch.stack([torch.tensor(u.shape[2:]) for u in hidden_states])` read back with .tolist()."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = torch.stack([torch.tensor(x.shape[1:], dtype=torch.long)])
        rows, cols = grid[0].tolist()
        return self.proj(x.reshape(-1, rows * cols // 4, 4))


def test_a_size_lifted_in_with_torch_tensor_is_read_back_as_a_constant():
    with torch.device("meta"):
        model = GridFromShape()
    result = quietly(model, input_shape=(3, 6, 8), conventions="torch", method="eager")
    assert result.total_flops == 2 * 3 * 12 * 4 * 4  # 3 x 12 rows of 4 -> 4


class HistcRouter(nn.Module):
    """torchtitan's router: tokens per expert by histc over the int64 picks, read with .tolist()."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.experts = experts
        self.gate = nn.Linear(8, experts, bias=False)
        self.w = nn.Parameter(torch.randn(experts, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, picks = torch.topk(self.gate(x), k=1, dim=-1)
        counts = torch.histc(picks.view(-1), bins=self.experts, min=0, max=self.experts)
        order = torch.argsort(picks.view(-1), stable=True)
        parts = torch.split(x[order], counts.long().tolist())
        return torch.cat([part @ self.w[e] for e, part in enumerate(parts)])


def test_histc_over_int64_router_picks_runs_widened_under_the_routing_assumption():
    with torch.device("meta"):
        model = HistcRouter()
    result = quietly(model, input_shape=(6, 8), conventions="torch", method="eager")
    assert result.total_flops == 2 * 6 * 8 * 4 + 2 * 6 * 8 * 8  # gate + every token through one expert
    worst = quietly(model, input_shape=(6, 8), conventions="torch", method="eager", routing=[0, 6, 0, 0])
    assert worst.total_flops == result.total_flops and any("[0, 6, 0, 0]" in c for c in worst.cautions)
    # the int64 histc is still refused where no routing assumption is involved and the CPU kernel lacks it
    with pytest.raises(RuntimeError, match="not implemented"):
        torch.histc(torch.zeros(3, dtype=torch.long), bins=2)


class Stack(nn.Module):
    """Repeated MoE blocks: the routing assumption gives each block's picks values, which a replayed copy of
    the first block would not carry (the read in the experts then failed)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(HistcRouter() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_repeated_moe_blocks_under_a_routing_assumption_are_run_not_replayed():
    with torch.device("meta"):
        model = Stack()
    replayed = quietly(model, input_shape=(6, 8), conventions="torch", method="eager")
    assert replayed.total_flops == 4 * (2 * 6 * 8 * 4 + 2 * 6 * 8 * 8)
    assert quietly(model, input_shape=(6, 8), conventions="torch", method="eager", replay=False).total_flops \
        == replayed.total_flops


class NumpyCounts(nn.Module):
    """HiDream's MoE: routed token counts read with `.bincount().cpu().numpy().cumsum(0)`; and a length read
    from an input mask the same way."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(nn.Linear(8, 8 * (e + 1), bias=False) for e in range(4))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> list[torch.Tensor]:
        x = x[: int(keep.sum().cpu().numpy())]
        picks = self.gate(x).argmax(dim=-1)
        ends = picks.bincount(minlength=4).cpu().numpy().cumsum(0)
        order = picks.argsort()
        return [expert(x[order[(ends[e - 1] if e else 0):ends[e]]]) for e, expert in enumerate(self.experts)]


def test_values_read_with_numpy_come_from_the_inputs_or_the_routing_assumption():
    with torch.device("meta"):
        model = NumpyCounts()
    keep = torch.tensor([True] * 6 + [False] * 2)
    result = quietly(model, (torch.empty(8, 8, device="meta"), keep), conventions="torch", method="eager")
    # 6 kept rows; balanced over 4 experts: 2, 2, 1, 1 rows; expert e is 8 -> 8(e + 1)
    assert result.total_flops == 2 * 6 * 8 * 4 + sum(2 * rows * 8 * 8 * (e + 1) for e, rows in enumerate((2, 2, 1, 1)))
    assert any("balanced routing" in caution for caution in result.cautions)


def test_the_values_run_writes_no_real_tensor_the_forward_writes_in_place():
    seen = torch.zeros(3, dtype=torch.long)  # a real tensor outside the model (a global, a closure's)

    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.add_(1)
            return self.proj(x) * seen.sum()

    result = quietly(Counter(), input_shape=(5, 4), conventions="torch", method="eager")
    assert result.total_flops == 2 * 5 * 4 * 4
    # FakeTensorMode itself runs an op whose tensors are all real constants for real (torch's own behaviour,
    # once, as eager execution would); the values' run works on a copy and adds no second write
    assert seen.tolist() == [1, 1, 1]


class PromptLength(nn.Module):
    """Projects as many tokens as the prompt mask keeps: a length read from an input's values."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)

    def forward(self, x, mask):
        return self.proj(x[:, : int(mask.sum())])  # the line the sweep's error names


def test_input_values_count_in_a_shapes_only_estimate_and_a_sweep_refuses_them_in_one_line():
    model, mask = PromptLength(), torch.tensor([[1] * 4 + [0] * 6])
    # a shapes-only call given the one small input whose values are read: 4 of 10 tokens projected
    assert quietly(model, input_shape=[(1, 10, 8), mask], conventions="torch").total_flops == 2 * 4 * 8 * 8
    with pytest.raises(fxflops.SweepCaptureError) as caught:
        fxflops.sweep(model, (torch.randn(1, 10, 8), mask), dims={"seq": 1})
    message = str(caught.value)
    assert "\n" not in message and "int(mask.sum())" in message
    assert message.endswith("a sweep counts from shapes only and cannot take the inputs' values the forward reads: "
                            "estimate() each point with its real inputs")
