"""The built-in example models: their shapes, parameter counts worked out by hand, and MACs
checked against torch's FlopCounterMode."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fxflops
from fxflops.cli import examples

TINY = {
    "lenet5": {},
    "gpt2-small": dict(vocab_size=50, n_positions=16, d_model=32, n_layer=2, n_head=4),
    "bert-base": dict(vocab_size=50, max_positions=16, hidden=32, n_layer=2, n_head=4, intermediate=64),
}


def gpt2_params(vocab=50257, positions=1024, d=768, layers=12):
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return vocab * d + positions * d + layers * block + 2 * d  # lm_head is tied to wte


def bert_params(vocab=30522, positions=512, types=2, d=768, layers=12, inner=3072):
    embeddings = vocab * d + positions * d + types * d + 2 * d
    layer = 4 * (d * d + d) + 2 * d + (d * inner + inner) + (inner * d + d) + 2 * d
    return embeddings + layers * layer + (d * d + d)


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_registry_lists_three_examples():
    assert list(examples.EXAMPLES) == ["lenet5", "gpt2-small", "bert-base"]
    assert examples.get_example("LeNet5").name == "lenet5"
    assert examples.get_example("gpt2_small").name == "gpt2-small"
    with pytest.raises(KeyError, match="known: lenet5"):
        examples.get_example("resnet")


def test_default_sizes_match_the_originals():
    with torch.device("meta"):
        lenet, gpt2, bert = examples.lenet5(), examples.gpt2_small(), examples.bert_base()
    assert count_params(lenet) == 156 + 2416 + 48120 + 10164 + 850  # 61.71 k as in DeepSpeed's sample
    assert count_params(gpt2) == gpt2_params() == 124_439_808
    assert count_params(bert) == bert_params() == 109_482_240
    assert all(p.device.type == "meta" for p in gpt2.parameters())
    assert gpt2.lm_head.weight is gpt2.wte.weight
    assert not gpt2.training and not bert.training


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_examples_run_for_real(name):
    example = examples.get_example(name)
    torch.manual_seed(0)
    model = example.build(**TINY[name])
    inputs = example.inputs(batch=2, seq_len=8, device="cpu")
    with torch.no_grad():
        output = model(*inputs)
    if name == "lenet5":
        logits, probs = output
        assert logits.shape == (2, 10)
        assert torch.allclose(probs.sum(dim=1), torch.ones(2))
    elif name == "gpt2-small":
        assert output.shape == (2, 8, 50)
    else:
        sequence, pooled = output
        assert sequence.shape == (2, 8, 32) and pooled.shape == (2, 32)


@pytest.mark.parametrize("name", list(TINY))
def test_estimated_macs_agree_with_flop_counter(name):
    # FlopCounterMode counts only mm/bmm/addmm/conv/SDPA, at 2 FLOPs per MAC: exactly our MACs.
    example = examples.get_example(name)
    with torch.device("meta"):
        model = example.build(**TINY[name])
    inputs = example.inputs(batch=2, seq_len=8, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(*inputs)
    estimate = fxflops.estimate(model, inputs)
    assert 2 * estimate.total_macs == counter.get_total_flops()
    assert estimate.total_params == count_params(model)
    assert not estimate.unknown


def test_lenet5_inputs_follow_batch():
    (images,) = examples.lenet5_inputs(batch=1024)
    assert images.shape == (1024, 1, 32, 32) and images.device.type == "meta"
    (tokens,) = examples.token_inputs(batch=3, seq_len=5)
    assert tokens.shape == (3, 5) and tokens.dtype == torch.long
