"""The predicted peak of a step is the highest moment of its timeline: a chain of two bias-free linears whose every
moment is derived by hand, the gradients counted only from the op that makes them (torch's .grad under
zero_grad(set_to_none=True)), or all step where the engine keeps a buffer."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxflops

N, B, FP32 = 8, 64, 4
W = N * N * FP32  # one weight, its gradient: 256 bytes
H = B * N * FP32  # an activation (B x N): 2,048 bytes
SEED = FP32  # the backward's seed, a scalar 1 the loss's sum expands (a view: no more bytes)


class Chain(nn.Module):
    """x -> layers.0 -> layers.1; the loss is the output's sum."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(N, N, bias=False) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def predict(**options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.predict_step(Chain(), (torch.ones(B, N),), cluster="DGX A100 80GB", dtype=torch.float32,
                                    optimizer_state_bytes=8, loss=lambda out: out.sum(), **options).memory[0]


# By hand, torch's own step (the input x is the caller's, not counted; Adam's 8 bytes a parameter all step):
# forward: h0 = x W0^T (layers.1 saves it), h1 = h0 W1^T, loss = h1.sum() (sum's backward saves nothing: h1 freed;
# the loop keeps the loss, not h1). Backward: layers.1's node makes gW1 = g^T h0 (AccumulateGrad keeps it as .grad)
# and g0 = g W1 while it holds h0; then layers.0's node, holding g0, makes gW0 = g0^T x. The moments:
#   layers.1's backward: h0 + g0 + seed + gW1            = 2,048 + 2,048 + 4 + 256 = 4,356   <- the peak
#   layers.0's backward: g0 + seed + gW1 + gW0           = 2,048 + 4 + 512         = 2,564
#   the optimizer step (fused, no temporaries): gW1 + gW0 = 512
STATIC = 2 * W + 2 * W * 2  # parameters 512, Adam's state 1,024


def test_one_micro_batch_counts_only_the_gradients_that_exist() -> None:
    memory = predict()
    assert memory.gradients_kept == "eager" and memory.moment == "backward of a layer (the last of the chunk)"
    assert memory.by_kind == {"parameters": 2 * W, "gradients": W, "optimizer": 4 * W, "activations": H,
                              "temporaries": H + SEED}
    assert memory.tensor_bytes == STATIC + 2 * H + SEED + W  # 5,892: not the old 2 x 256 + h0 + the capture's peak


def test_a_later_micro_batch_finds_the_first_ones_gradients() -> None:
    # global batch 2 x 64: the second micro-batch's forward runs with both gradients there (AccumulateGrad adds into
    # them in place): h0 + h1 + the loss + gW1 + gW0 = 2,048 + 2,048 + 4 + 512, as high as its layers.1 backward
    # (h0 + g0 + seed + both gradients, its gW1 in flight before the add: 4,612 at most)
    memory = predict(global_batch=2 * B)
    assert memory.by_kind["gradients"] == 2 * W
    assert memory.tensor_bytes == STATIC + 2 * H + SEED + 2 * W


@pytest.mark.parametrize("parallel, extra, kept", [
    # torch DDP (gradient_as_bucket_view=False): its flat buckets, 512 bytes all step, beside the .grad of the moment
    ({"dp": 2, "fsdp": False}, {}, "ddp"),
    # Megatron-LM's DDP: one persistent buffer, each .grad added into it and freed
    ({"dp": 2, "fsdp": False}, {"grad_buckets": "megatron"}, "buffer"),
])
def test_engines_that_keep_a_gradient_buffer(parallel, extra, kept) -> None:
    memory = predict(parallel=parallel, **extra)
    assert memory.gradients_kept == kept
    if kept == "ddp":  # buckets + gW1 at layers.1's backward
        assert memory.by_kind["gradients"] == 2 * W + W
        assert memory.tensor_bytes == STATIC + 2 * H + SEED + 3 * W
    else:  # the buffer whole from the start: at layers.1's backward h0 + g0 + seed + 512 (gW1 in flight earlier,
        # when only h0 and the seed were alive: lower)
        assert memory.by_kind["gradients"] == 2 * W
        assert memory.tensor_bytes == STATIC + 2 * H + SEED + 2 * W
