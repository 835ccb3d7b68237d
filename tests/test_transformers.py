"""Hugging Face models: cache objects in outputs and inputs must not break capture."""

from __future__ import annotations

import copy

import torch

import fxflops
from tests.models import tiny_transformers_model
from tests.oracle import oracle_flops


def test_cache_objects_in_outputs_do_not_stop_export():
    model, inputs = tiny_transformers_model("gpt2")
    with torch.no_grad():
        assert model(**inputs, use_cache=True).past_key_values is not None
    result = fxflops.estimate(model, kwargs={**inputs, "use_cache": True}, method="export")
    assert result.method == "export" and result.unknown == []


def test_decode_step_with_a_cache_input_is_counted_and_the_cache_left_alone():
    model, inputs = tiny_transformers_model("llama")
    with torch.no_grad():
        cache = model(**inputs, use_cache=True).past_key_values
    length = cache.get_seq_length()
    step = {"input_ids": torch.randint(0, 1000, (2, 1)), "past_key_values": cache, "use_cache": True}
    result = fxflops.estimate(model, kwargs=step, conventions="torch")
    assert result.method == "eager"
    assert cache.get_seq_length() == length
    exported = fxflops.estimate(model, kwargs=step, conventions="torch", method="export")
    assert exported.total_flops == result.total_flops
    assert cache.get_seq_length() == length
    assert result.total_flops == oracle_flops(model, kwargs={**step, "past_key_values": copy.deepcopy(cache)})
    traced = fxflops.estimate(model, kwargs=step, conventions="torch", method="trace")
    assert traced.total_flops == result.total_flops
    assert cache.get_seq_length() == length


def test_llama_attention_is_grouped_query_and_counted_per_query_head():
    model, inputs = tiny_transformers_model("llama", device="meta")
    result = fxflops.estimate(model, kwargs=inputs)
    # 2 layers x SDPA with B=2, Hq=4, L=16, head dim 16: B*Hq*L*L*(16+16) MACs each
    assert result.by_rule["sdpa"].macs == 2 * (2 * 4 * 16 * 16 * (16 + 16))
    # q,o: 64x64; k,v: 64x32 (2 kv heads); gate/up/down: 64x128; lm_head 64x1000; tokens = 32
    per_layer = 32 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3)
    assert result.by_rule["linear"].macs == 2 * per_layer + 32 * 64 * 1000


def test_mixture_of_experts_counts_every_expert_matmul():
    # transformers' default grouped-mm experts hide their matmuls from FlopCounterMode: compare with the
    # same weights running the eager experts (plain matmuls, which it sees), and with the hand count
    import transformers as tf

    torch.manual_seed(0)
    config = tf.MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=128, vocab_size=1000, num_local_experts=4, num_experts_per_tok=2)
    model = tf.MixtralForCausalLM(config).eval()
    inputs = {"input_ids": torch.randint(0, 1000, (2, 16))}
    result = fxflops.estimate(model, kwargs=inputs, conventions="torch")
    assert result.unknown == []
    # 32 tokens x 2 experts each x (gate, up, down: 3 x 64 x 128) per layer
    assert result.by_rule["grouped_mm"].macs == 2 * (32 * 2 * 3 * 64 * 128)
    eager = copy.deepcopy(model)
    eager.set_experts_implementation("eager")
    assert result.total_flops == oracle_flops(eager, kwargs=inputs)
    assert oracle_flops(model, kwargs=inputs) < result.total_flops  # the oracle's blind spot, not ours


def test_sizes_that_depend_on_input_values_are_computed_without_a_real_run():
    import transformers as tf

    config = tf.ReformerConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, attention_head_size=32,
                               feed_forward_size=128, vocab_size=320, axial_pos_shape=(4, 4),
                               axial_pos_embds_dim=(32, 32), attn_layers=["local", "lsh"], is_decoder=False,
                               max_position_embeddings=16, local_attn_chunk_length=4, lsh_attn_chunk_length=4,
                               num_buckets=8)
    model = tf.ReformerModel(config).eval()
    inputs = {"input_ids": torch.randint(0, 320, (2, 16))}
    result = fxflops.estimate(model, kwargs=inputs, conventions="torch")
    # the values Reformer reads derive from the input ids: computed from them (capture.input_values),
    # where this used to fall back to a real run
    assert result.method == "eager" and not result.attempts and not result.cautions
    assert result.total_flops == oracle_flops(model, kwargs=inputs)
