"""diffusers' MochiTransformer3DModel, whose attention keeps each prompt's valid tokens (`nonzero` on the
encoder attention mask): counted on fake tensors from the mask's values, never by running it (issue 39).

A small real config equals FlopCounterMode; the 10B model at the pipeline's 480p preset, built on the meta
device, is counted in seconds, and its attention follows the mask as the hand count says."""

from __future__ import annotations

import warnings

import pytest
import torch

import fxflops
from tests.oracle import oracle_flops

diffusers = pytest.importorskip("diffusers")


def _latent_sizes(height: int, width: int, frames: int) -> tuple[int, int, int]:
    """(latent frames, height, width) as diffusers' MochiPipeline.prepare_latents computes them (its VAE
    scales space by 8 and time by 6)."""
    return (frames - 1) // 6 + 1, height // 8, width // 8


def _mask(valid: list[int], length: int) -> torch.Tensor:
    """An encoder attention mask with `valid[i]` leading True tokens in row i (a tokenizer's padding)."""
    return torch.arange(length)[None, :] < torch.tensor(valid)[:, None]


def _estimate(model: torch.nn.Module, **kwargs) -> fxflops.Estimate:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Mochi's float32 autocast on the CPU warns)
        return fxflops.estimate(model, kwargs=kwargs, conventions="torch", method="eager")


def test_a_small_mochi_with_prompts_of_different_lengths_equals_flop_counter_mode():
    torch.manual_seed(0)
    model = diffusers.MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
        in_channels=4, qk_norm="rms_norm", text_embed_dim=16, time_embed_dim=4, activation_fn="swiglu",
        max_sequence_length=16).eval()
    inputs = dict(hidden_states=torch.randn(2, 4, 2, 16, 16), encoder_hidden_states=torch.randn(2, 16, 16),
                  timestep=torch.tensor([3, 999]), encoder_attention_mask=_mask([5, 13], 16))
    result = _estimate(model, **inputs)
    assert result.method == "eager" and not result.cautions
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert result.total_flops == oracle_flops(model, (), inputs)


def test_the_full_size_mochi_on_the_meta_device_at_480p_31_frames_is_counted_from_the_mask():
    with torch.device("meta"):
        model = diffusers.MochiTransformer3DModel()  # the released config: 48 layers, 24 heads of 128
    config = model.config
    frames, height, width = _latent_sizes(480, 848, 31)  # the pipeline's default 480 x 848
    assert (frames, height, width) == (6, 60, 106)
    tokens = frames * (height // config.patch_size) * (width // config.patch_size)
    assert tokens == 9540
    latents = torch.empty(2, config.in_channels, frames, height, width, device="meta")  # shapes only
    text = torch.empty(2, config.max_sequence_length, config.text_embed_dim, device="meta")
    timestep = torch.tensor([500, 500])

    def count(valid: list[int]) -> int:
        result = _estimate(model, hidden_states=latents, encoder_hidden_states=text, timestep=timestep,
                           encoder_attention_mask=_mask(valid, config.max_sequence_length))
        assert result.method == "eager" and not result.cautions
        lengths = sorted({node.input_shapes[1][2] for node in result.nodes
                          if node.rule == "sdpa" and node.module.startswith("transformer_blocks.")})
        assert lengths == sorted({tokens + v for v in valid})  # each prompt's valid tokens join the video's
        return result.total_flops

    # classifier-free guidance's batch: a 77-token prompt and an empty negative prompt (T5's EOS only)
    guided, longer = count([77, 1]), count([256, 1])
    # by hand: only the blocks' joint attention depends on the mask (the prompt's attention pooling masks it by
    # value, not by size): per layer, per batch row, FlopCounterMode's SDPA
    # counts 2 products of L x L x head_dim MACs (QK^T and PV), 2 FLOPs each, over the heads, L = 9540 + valid
    per_length = 4 * config.num_attention_heads * config.attention_head_dim * config.num_layers
    assert longer - guided == per_length * ((tokens + 256) ** 2 - (tokens + 77) ** 2)
    assert model.proj_out.weight.is_meta  # nothing was run: the model has no weights
