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


def test_decode_step_with_a_cache_input_is_exported_and_the_cache_left_alone():
    model, inputs = tiny_transformers_model("llama")
    with torch.no_grad():
        cache = model(**inputs, use_cache=True).past_key_values
    length = cache.get_seq_length()
    step = {"input_ids": torch.randint(0, 1000, (2, 1)), "past_key_values": cache, "use_cache": True}
    result = fxflops.estimate(model, kwargs=step, conventions="torch")
    assert result.method == "export"
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
