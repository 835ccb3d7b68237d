"""Forwards that read tensor values, captured on fake tensors (capture.input_values): values the inputs
determine are computed from them, routing the weights decide is assumed and said, sizes nothing
determines are counted at their bound and said, and a read nothing determines fails naming op, module
and line."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import fxflops


def oracle(model: nn.Module, *args: torch.Tensor) -> int:
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(*args)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    return counter.get_total_flops()


def quietly(*args, **kwargs) -> fxflops.Estimate:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(*args, **kwargs)


class JointAttention(nn.Module):
    """Mochi-style joint attention: each sample's valid prompt tokens found with nonzero on its mask,
    the prompt length read with .item(), visual and prompt tokens attended together."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.qkv_prompt = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, prompt: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        outputs = []
        for i in range(x.shape[0]):
            valid = torch.nonzero(prompt_mask[i], as_tuple=False).flatten()
            length = int(prompt_mask[i].sum().item())
            tokens = torch.cat([x[i], prompt[i].index_select(0, valid)[:length]])
            q, k, v = self.qkv(tokens[: x.shape[1]]).chunk(3, -1)
            pq, pk, pv = self.qkv_prompt(tokens[x.shape[1]:]).chunk(3, -1)
            q, k, v = (torch.cat(pair).unflatten(-1, (self.heads, -1)).transpose(0, 1)
                       for pair in ((q, pq), (k, pk), (v, pv)))
            attended = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).flatten(1)
            outputs.append(self.out(attended[: x.shape[1]]))
        return torch.stack(outputs)


def mochi_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    mask = torch.zeros(2, 7, dtype=torch.long)
    mask[0, :5] = 1
    mask[1, [0, 2]] = 1
    return torch.randn(2, 6, 16), torch.randn(2, 7, 16), mask


def test_values_read_from_an_input_mask_are_computed_and_equal_the_oracle():
    model, inputs = JointAttention(), mochi_inputs()
    estimate = quietly(model, inputs, conventions="torch")
    assert estimate.method == "eager"  # no real run: the fallback to trace is not taken
    assert estimate.total_flops == oracle(model, *inputs)
    # by hand: sample 0 keeps 5 prompt tokens, sample 1 keeps 2; 6 visual tokens, dim 16, 2 heads of 8
    by_hand = sum(2 * 6 * 16 * 48 + 2 * p * 16 * 48 + 2 * 2 * (6 + p) ** 2 * 16 + 2 * 6 * 16 * 16 for p in (5, 2))
    assert estimate.total_flops == by_hand


def test_the_backward_of_a_forward_reading_input_values_equals_the_oracle():
    from tests.oracle import oracle_training_flops

    model, inputs = JointAttention(), mochi_inputs()
    with sdpa_kernel(SDPBackend.MATH):
        estimate = quietly(model, inputs, conventions="torch", backward=True)
    assert estimate.method == "eager"
    assert (estimate.fwd_flops, estimate.bwd_flops) == oracle_training_flops(model, inputs)


def test_a_meta_model_with_real_small_inputs_counts_the_same_without_running():
    real, inputs = JointAttention(), mochi_inputs()
    with torch.device("meta"):
        model = JointAttention()
    estimate = quietly(model, inputs, conventions="torch")
    assert estimate.method == "eager" and estimate.total_flops == oracle(real, *inputs)
    # shapes-only call: the one small input whose values are read is given as a tensor in input_shape's list
    shaped = quietly(model, input_shape=[(2, 6, 16), (2, 7, 16), inputs[2]], conventions="torch")
    assert shaped.total_flops == estimate.total_flops


def test_the_users_inputs_are_not_changed_by_an_in_place_op_the_capture_computes():
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x, lengths):
            lengths.add_(1)
            return self.proj(x[: int(lengths.sum())])

    lengths = torch.tensor([1, 2])
    estimate = quietly(InPlace(), (torch.randn(8, 4), lengths), conventions="torch")
    assert lengths.tolist() == [1, 2]
    assert estimate.total_flops == 2 * 5 * 4 * 4  # 1+1 + 2+1 = 5 rows


def test_a_write_the_weights_decide_drops_the_values_of_the_tensor_and_its_views():
    class Overwrite(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x, counts):
            view = counts[:1]
            counts.copy_(self.proj(x).sum(-1)[:2].long())  # the weights decide the counts now
            return self.proj(x[: int(view.sum())])

    with torch.device("meta"):
        model = Overwrite()
    with pytest.raises(fxflops.CaptureError, match="_local_scalar_dense.*int.view.sum"):
        quietly(model, (torch.randn(8, 4), torch.tensor([1, 2])))


class ValueShapedOps(nn.Module):
    """tolist, repeat_interleave with tensor repeats, bincount, masked_select and unique on inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, repeats, ids):
        rows = torch.repeat_interleave(torch.arange(repeats.numel()), repeats)  # sum(repeats) rows
        picked = x.index_select(0, rows)
        bins = torch.bincount(ids)  # max(ids) + 1 bins
        kept = torch.masked_select(ids, ids > 1)
        distinct = torch.unique(ids)
        widths = repeats.tolist()
        y = self.proj(picked)
        z = self.proj(x[: bins.numel() + kept.numel() + distinct.numel()])
        return y.sum() + z.sum() + sum(widths)


def test_value_shaped_ops_on_inputs_equal_the_oracle():
    model = ValueShapedOps()
    inputs = (torch.randn(20, 8), torch.tensor([2, 0, 3]), torch.tensor([0, 4, 4, 1, 2]))
    estimate = quietly(model, inputs, conventions="torch")
    assert estimate.method == "eager"
    assert estimate.total_flops == oracle(model, *inputs)
    # by hand: 5 picked rows; 5 bins + 3 kept (4, 4, 2) + 4 distinct = 12 rows; 2*8*8 FLOPs a row
    assert estimate.total_flops == (5 + 12) * 2 * 8 * 8


class RoutedExperts(nn.Module):
    """torchtitan-style MoE: router topk, routed counts by histc, tokens sorted by expert, the counts read
    with .tolist() to split them: a for-loop of experts, or grouped mm over rows padded to ALIGN."""

    ALIGN = 8

    def __init__(self, grouped: bool, dim: int = 16, hidden: int = 32, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.grouped, self.top_k, self.experts = grouped, top_k, experts
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, x.shape[-1])
        scores = torch.sigmoid(self.router(x))
        top, chosen = torch.topk(scores, self.top_k, dim=1)
        counts = torch.histc(chosen.view(-1).float(), bins=self.experts, min=0, max=self.experts)
        order = torch.argsort(chosen.view(-1), stable=True)
        routed = x[order // self.top_k] * top.view(-1)[order, None]
        sizes = counts.long().tolist()
        if not self.grouped:
            return torch.cat([(F.silu(part @ self.w1[e].T) * (part @ self.w3[e].T)) @ self.w2[e].T
                              for e, part in enumerate(torch.split(routed, sizes))])
        padded = [-(-size // self.ALIGN) * self.ALIGN for size in sizes]
        rows = torch.cat([F.pad(part, (0, 0, 0, wanted - size))
                          for part, size, wanted in zip(torch.split(routed, sizes), sizes, padded)])
        offs = torch.tensor(padded).cumsum(0).to(torch.int32)
        hidden = F.silu(torch._grouped_mm(rows, self.w1.transpose(-2, -1), offs=offs)) * torch._grouped_mm(
            rows, self.w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(hidden, self.w2.transpose(-2, -1), offs=offs)


ROUTER = 2 * 6 * 16 * 4  # 6 tokens x dim 16 x 4 experts


def expert_flops(rows: int) -> int:
    return 3 * 2 * rows * 16 * 32  # w1, w3, w2: dim 16 <-> hidden 32 per routed row


@pytest.mark.parametrize("grouped", [False, True])
def test_moe_on_the_meta_device_counts_balanced_routing_by_hand_and_says_so(grouped):
    with torch.device("meta"):
        model = RoutedExperts(grouped)
    estimate = quietly(model, input_shape=(1, 6, 16), conventions="torch")
    assert estimate.method == "eager"
    # balanced: 6 tokens x top 2 / 4 experts = 3 rows each; grouped mm pads each expert's to 8
    assert estimate.total_flops == ROUTER + expert_flops(4 * 8 if grouped else 12)
    assert any("balanced routing" in caution and "aten.topk.default in module '(root)' (RoutedExperts)" in caution
               for caution in estimate.cautions)
    # beside it, what worst-case routing would count: experts 0 and 1 take all 12 rows
    worst = ROUTER + expert_flops(2 * 8 if grouped else 12)
    spread = "worst-case routing counts the same FLOPs as balanced routing" if not grouped else (
        f"worst-case routing (every token to the same top-k experts) counts {worst:,} FLOPs, "
        f"{(worst - estimate.total_flops) / estimate.total_flops:+.1%} against balanced routing's {estimate.total_flops:,}")
    assert any(caution.startswith(spread) for caution in estimate.cautions)
    # and every report says it
    reports = estimate.print(as_string=True), json.dumps(estimate.to_dict(), ensure_ascii=False), estimate.to_html()
    assert all("balanced routing (tokens" in report for report in reports)


def test_moe_routing_worst_case_and_given_counts_change_the_count_and_say_so():
    with torch.device("meta"):
        model = RoutedExperts(grouped=True)
    worst = quietly(model, input_shape=(1, 6, 16), conventions="torch", routing="worst")
    assert worst.total_flops == ROUTER + expert_flops(2 * 8)  # experts 0 and 1 take 6 rows each
    assert any("worst-case routing" in caution for caution in worst.cautions)
    given = quietly(model, input_shape=(1, 6, 16), conventions="torch", routing=[6, 6, 0, 0])
    assert given.total_flops == worst.total_flops
    assert any("[6, 6, 0, 0]" in caution for caution in given.cautions)
    skewed = quietly(model, input_shape=(1, 6, 16), conventions="torch", routing=[6, 4, 1, 1])
    assert skewed.total_flops == ROUTER + expert_flops(8 + 8 + 8 + 8)
    with pytest.raises(fxflops.CaptureError, match="summing to tokens·top_k = 12"):
        quietly(model, input_shape=(1, 6, 16), routing=[6, 6, 6, 0], method="eager")
    with pytest.raises(ValueError, match="routing must be"):
        quietly(model, input_shape=(1, 6, 16), routing="even")


def test_a_top_one_router_by_argmax_counted_by_bincount_is_assumed_balanced():
    class Switch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(8, 4, bias=False)
            self.experts = nn.ModuleList(nn.Linear(8, 8 * (e + 1), bias=False) for e in range(4))

        def forward(self, x):
            picks = self.router(x).argmax(dim=-1)
            counts = torch.bincount(picks, minlength=4).tolist()
            order = torch.argsort(picks, stable=True)
            return [expert(part) for expert, part in zip(self.experts, torch.split(x[order], counts))]

    with torch.device("meta"):
        model = Switch()
    estimate = quietly(model, input_shape=(6, 8), conventions="torch")
    # balanced: 6 tokens round robin over 4 experts = 2, 2, 1, 1 rows; expert e is 8 -> 8(e + 1)
    assert estimate.total_flops == 2 * 6 * 8 * 4 + sum(2 * rows * 8 * 8 * (e + 1) for e, rows in enumerate((2, 2, 1, 1)))
    worst = quietly(model, input_shape=(6, 8), conventions="torch", routing="worst")
    assert worst.total_flops == 2 * 6 * 8 * 4 + 2 * 6 * 8 * 8  # every token to expert 0
    assert any("worst-case routing" in caution for caution in worst.cautions)


def test_a_size_the_weights_decide_is_counted_at_its_bound_and_says_so():
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 1)
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            keep = torch.nonzero(self.gate(x).squeeze(-1) > 0).squeeze(-1)
            return self.proj(x.index_select(0, keep))

    with torch.device("meta"):
        model = Gate()
    estimate = quietly(model, input_shape=(10, 8), conventions="torch")
    assert estimate.method == "eager"
    # the gate (10 rows x 8 -> 1), then the projection of at most every one of the 10 rows
    assert estimate.total_flops == 2 * 10 * 8 * 1 + 2 * 10 * 8 * 8
    assert any("counted at its bound" in c and "aten.nonzero" in c and "10" in c for c in estimate.cautions)


def test_a_value_the_weights_decide_on_a_meta_model_fails_naming_op_module_and_line():
    class Halting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            steps = int(self.proj(x).abs().sum())  # the line the error names
            return x * steps

    with torch.device("meta"):
        model = Halting()
    with pytest.raises(fxflops.CaptureError) as caught:
        quietly(model, input_shape=(2, 4))
    eager = caught.value.attempts[0]
    assert eager.method == "eager" and "aten._local_scalar_dense" in eager.reason
    assert "module '(root)' (Halting)" in eager.reason and "steps = int(self.proj(x).abs().sum())" in eager.reason
    trace = caught.value.attempts[-1]
    assert trace.method == "trace" and trace.reason.startswith("skipped") and "meta device" in trace.reason


def test_repeated_blocks_reading_different_values_are_each_run_not_replayed():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x, length):
            return x + self.proj(x[: int(length.sum())]).sum()

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x, *lengths):
            for block, length in zip(self.blocks, lengths):
                x = block(x, length)
            return x

    model = Stack()
    inputs = (torch.randn(10, 8), torch.tensor([1]), torch.tensor([5]), torch.tensor([10]))
    estimate = quietly(model, inputs, conventions="torch")
    # three blocks of the same shapes, each reading its own length: 1 + 5 + 10 rows (a replay of the
    # first block would count 1 + 1 + 1)
    assert estimate.total_flops == 2 * 8 * 8 * 16 == oracle(model, *inputs)


def test_an_out_argument_the_weights_write_drops_its_values_and_uninitialized_memory_has_none():
    class OutWrite(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Parameter(torch.ones(10))
            self.proj = nn.Linear(8, 8, bias=False)

        def forward(self, x, keep):
            kept = keep.clone()  # input values: 2 of 10 rows kept
            torch.mul(self.gate, 1.0, out=kept)  # now the weights decide them (an out= keyword argument)
            buffer = torch.empty(10)  # uninitialized: no value, whatever its memory holds
            return self.proj(x[torch.nonzero(kept).flatten()]), self.proj(x[torch.nonzero(buffer).flatten()])

    with torch.device("meta"):
        model = OutWrite()
    keep = torch.tensor([1.0, 1.0] + [0.0] * 8)
    estimate = quietly(model, (torch.randn(10, 8), keep), conventions="torch")
    # neither the stale input values (2 rows) nor garbage: both nonzero counted at their bound, 10 rows
    assert estimate.total_flops == 2 * (2 * 10 * 8 * 8)
    # (said once: the same op in the same module on the same line, as a .tolist() of n values reads n times)
    assert sum("counted at its bound 10" in caution for caution in estimate.cautions) == 1
