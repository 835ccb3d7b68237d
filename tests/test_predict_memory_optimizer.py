"""The optimizer step's own temporaries in a planned step's peak, against a real CPU step: torch.optim's for-loop
Adam / AdamW (`_single_tensor_adam`, torch/optim/adam.py) builds `denom = (exp_avg_sq.sqrt() / ...).add_(eps)` for one
parameter at a time, the sqrt and the quotient alive together, while the previous parameter's `denom` is still bound
(it is freed only when the name is rebound): at most twice the largest parameter tensor and the second largest."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxflops
from tests.test_memory import LiveStorages

FP32 = 4
VOCAB, H, SEQ = 2048, 16, 8  # the head's weight (VOCAB x H) the largest tensor by far, the embedding's the next


class Lm(nn.Module):
    """An embedding, two small layers and a bias-free head: the largest moment is the optimizer step's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(nn.Linear(H, H) for _ in range(2))
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss(out: torch.Tensor) -> torch.Tensor:
    return out.logsumexp(-1).mean()


def measured_peak(model: nn.Module, ids: torch.Tensor, optimizer: torch.optim.Optimizer) -> int:
    """Live tensor bytes at the peak of a step after the first (the optimizer's state exists): the loop keeps the
    loss, not the output; zero_grad(set_to_none=True). Adam's step counters (4 B a tensor) are among them."""
    def step() -> None:
        value = loss(model(ids))
        value.backward()
        del value
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    with LiveStorages([*model.parameters(), *model.buffers(), *states]) as hook:
        step()
    return hook.peak


@pytest.mark.parametrize("make, copies", [
    (lambda params: torch.optim.Adam(params, foreach=False), 2),
    (lambda params: torch.optim.AdamW(params, foreach=False), 2),  # decoupled weight decay: in place on the weight
    # Adam's coupled weight decay: `grad = grad.add(param, alpha=weight_decay)`, a copy of the head's gradient too
    (lambda params: torch.optim.Adam(params, foreach=False, weight_decay=0.1), 3),
])
def test_for_loop_adam_step_temporaries_are_not_under_counted(make, copies) -> None:
    torch.manual_seed(0)
    model, ids = Lm(), torch.randint(0, VOCAB, (1, SEQ))
    optimizer = make(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        memory = fxflops.predict_step(model, (ids,), cluster="DGX A100 80GB", dtype=torch.float32, loss=loss,
                                      optimizer=optimizer).peak_memory
    measured = measured_peak(model, ids, optimizer)
    counters = 4 * len(list(model.parameters()))  # Adam's step counters, which the prediction leaves out
    assert memory.moment == "optimizer step"
    # by hand: parameters, gradients and Adam's two moments (4 x the parameters), the step's temporaries at the
    # head's quotient: the embedding's denom (the previous parameter's in the loop is a bias; bounded by the second
    # largest tensor, the embedding's) and the head's sqrt and quotient (and its gradient's copy). Measured: the
    # bias's denom, not the embedding's, so the prediction is over by the embedding's less a bias (+9.9%; before,
    # without the loop's temporaries, -19.8%: 1,057,796 predicted against 1,319,512 measured for AdamW)
    params = sum(p.numel() for p in model.parameters()) * FP32
    assert memory.by_kind["temporaries"] == (copies * VOCAB * H + VOCAB * H) * FP32
    assert memory.tensor_bytes == 4 * params + (copies + 1) * VOCAB * H * FP32
    assert 0 <= memory.tensor_bytes - (measured - counters) <= (VOCAB * H + H) * FP32


@pytest.mark.parametrize("foreach", [True, False])
def test_sgd_weight_decay_copies_the_gradients(foreach) -> None:
    # torch's SGD with weight decay: `_multi_tensor_sgd` makes `device_grads = torch._foreach_add(device_grads,
    # device_params, alpha=weight_decay)`, a copy of every gradient alive through the step; `_single_tensor_sgd`
    # `grad = grad.add(param, alpha=weight_decay)`, one parameter's at a time (the previous one's freed when `grad` is
    # rebound to the next .grad). Before: 0 temporaries, under by 20.6% (foreach) and 3.2% (for-loop) on a GPT step
    torch.manual_seed(0)
    model, ids = Lm(), torch.randint(0, VOCAB, (1, SEQ))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1, foreach=foreach)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        memory = fxflops.predict_step(model, (ids,), cluster="DGX A100 80GB", dtype=torch.float32, loss=loss,
                                      optimizer=optimizer).peak_memory
    params = sum(p.numel() for p in model.parameters()) * FP32
    assert memory.moment == "optimizer step"
    assert memory.by_kind["temporaries"] == (params if foreach else VOCAB * H * FP32)
    # parameters, gradients, the momentum buffers and the copies: the real step's live bytes exactly
    assert memory.tensor_bytes == 3 * params + memory.by_kind["temporaries"] == measured_peak(model, ids, optimizer)
