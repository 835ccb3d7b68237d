"""Profiling text generation with tiny GPT-2 and Llama models built from config classes (random
weights, CPU, nothing downloaded). Counts use the "torch" conventions, so FlopCounterMode around
the same generate() call is the oracle; the per-step GPT-2 numbers are also worked out by hand.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fxflops.compat import FlopsProfiler, get_model_profile
from fxflops.timing.generate import profile_generate

transformers = pytest.importorskip("transformers")

BATCH, PROMPT, NEW = 2, 5, 3


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"  # matmul attention, which FlopCounterMode counts on CPU
    return transformers.GPT2LMHeadModel(config).eval()


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                      max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config).eval()


def prompt() -> tuple[torch.Tensor, dict]:
    ids = torch.randint(1, 100, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    return ids, {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}


def oracle_flops(model: torch.nn.Module) -> int:
    ids, kwargs = prompt()
    with FlopCounterMode(display=False) as counter:
        model.generate(ids, **kwargs)
    return counter.get_total_flops()


def gpt2_step_flops(seq: int, keys: int, logits: int) -> int:
    """GPT-2 (2 layers, width 32, 2 heads of 16, MLP 128, vocab 100) FLOPs of one forward, by hand:
    per layer c_attn 2*B*S*32*96, q.k and attn.v 2 * 2*B*H*S*16*keys, c_proj 2*B*S*32*32,
    MLP 2 * 2*B*S*32*128; lm_head 2*B*logits*32*100 (generate keeps only the last position)."""
    layer = 2 * BATCH * seq * 32 * 96 + 2 * (2 * BATCH * 2 * seq * 16 * keys) + 2 * BATCH * seq * 32 * 32 \
        + 2 * (2 * BATCH * seq * 32 * 128)
    return 2 * layer + 2 * BATCH * logits * 32 * 100


def test_generation_profile_splits_prefill_and_decode() -> None:
    model = gpt2()
    ids, kwargs = prompt()
    result = profile_generate(model, (ids,), kwargs, conventions="torch", steps=1)
    info = result.measurements.extra["generate"]
    prefill = gpt2_step_flops(PROMPT, PROMPT, 1)
    expected = [prefill, gpt2_step_flops(1, PROMPT + 1, 1), gpt2_step_flops(1, PROMPT + 2, 1)]
    assert [row["flops"] for row in info["steps"]] == expected
    assert [row["phase"] for row in info["steps"]] == ["prefill", "decode", "decode"]
    assert info["prefill"]["flops"] == expected[0]
    assert info["decode"]["flops"] == expected[1] + expected[2]
    assert info["decode"]["calls"] == NEW - 1
    assert result.total_flops == sum(expected) == oracle_flops(model)
    assert all(row["latency"] > 0 for row in info["steps"])
    # the module tree sums all calls of the generation
    assert result.modules["transformer.h.0"].latency_calls == NEW
    assert result.root.latency == pytest.approx(sum(row["latency"] for row in info["steps"]))
    assert result.measurements.unmatched_measured == () and result.measurements.unmatched_graph == ()
    report = result.print(as_string=True)
    assert f"{'prefill calls:':<60}  1" in report and f"{'decode calls:':<60}  {NEW - 1}" in report


def test_profiler_around_generate_memoizes_equal_steps(capsys) -> None:
    model = llama()
    ids, kwargs = prompt()
    prof = FlopsProfiler(model, conventions="torch")
    prof.start_profile()
    model.generate(ids, **kwargs)
    model.generate(ids, **kwargs)  # the same signatures again: no new estimate
    prof.stop_profile()
    info = prof.profile.measurements.extra["generate"]
    assert info["estimated_signatures"] == NEW
    assert prof.profile.measurements.steps == 2  # two generations, averaged
    assert prof.get_total_flops() == oracle_flops(model)
    prof.print_model_profile(detailed=False)
    out = capsys.readouterr().out
    assert "prefill latency (summed / per step):" in out and "decode MACs (summed / per step):" in out
    prof.end_profile()
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0


def test_get_model_profile_generate_mode() -> None:
    model = gpt2()
    ids, kwargs = prompt()
    flops, macs, params = get_model_profile(model, args=[ids], kwargs=kwargs, mode="generate", print_profile=False,
                                            as_string=False, conventions="torch")
    assert flops == oracle_flops(model)
    assert macs * 2 == flops  # only matmuls count under the "torch" conventions
    assert params == sum(p.numel() for p in model.parameters())
    model.train()  # profiled in eval mode, as DeepSpeed does, and given back in training mode
    get_model_profile(model, args=[ids], kwargs=kwargs, func_name="generate", print_profile=False)
    assert all(m.training for m in model.modules())


@pytest.mark.parametrize("make", [gpt2, llama])
def test_decode_steps_are_points_of_one_sweep_not_captures_each(make) -> None:
    model = make()
    ids, kwargs = prompt()
    kwargs["max_new_tokens"] = 8
    result = profile_generate(model, (ids,), kwargs, conventions="torch", warm_up=0, steps=1)
    info = result.measurements.extra["generate"]
    assert info["calls"] == info["estimated_signatures"] == 8
    # the prefill, the first decode step, then one capture with the cache length symbolic
    assert info["captures"] == 3
    with FlopCounterMode(display=False) as counter:
        model.generate(ids, **kwargs)
    assert result.total_flops == counter.get_total_flops()
    if make is gpt2:
        expected = [gpt2_step_flops(PROMPT, PROMPT, 1)] + [gpt2_step_flops(1, PROMPT + k, 1) for k in range(1, 8)]
        assert [row["flops"] for row in info["steps"]] == expected
