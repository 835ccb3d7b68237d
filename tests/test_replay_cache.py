"""Blocks handed a cache object (fxflops/capture/block_calls.py): a decoder layer given a transformers Cache
is replayed, its calls on the cache made again for real at each copy. Every node and module call must be
those of a capture that runs every call (`assert_same_as_full`), the total FlopCounterMode's, and the cache
the forward leaves behind (the output graph's tensors) the same; a cache whose calls do not repeat makes the
capture run again without replay."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch

import fxflops
from fxflops.api import Counting
from fxflops.capture.replay import REPLAY_OF, ReplayMismatch
from tests.oracle import oracle_flops
from tests.test_replay import assert_same_as_full

tf = pytest.importorskip("transformers")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def _model(cls, config, training: bool = False):
    torch.manual_seed(0)
    model = cls(config)
    return model.train() if training else model.eval()


def _capture(model, kwargs: dict, replay: bool, backward: bool = False):
    counting = Counting.prepare("torch", None, None)
    return counting.capture(model, (), kwargs, "eager", replay=replay, backward=backward)


def _left_behind(captured) -> list[tuple]:
    """The shapes and dtypes of every tensor the forward returned (the cache's keys and values included)."""
    output = next(node for node in captured.graph_module.graph.nodes if node.op == "output")
    return [(tuple(used.meta["val"].shape), used.meta["val"].dtype) for used in output.args[0]]


def _copied(captured) -> int:
    return sum(REPLAY_OF in node.meta for node in captured.graph_module.graph.nodes)


def agrees(model, kwargs: dict, oracle_kwargs: dict | None = None, layers_copied: bool = True) -> None:
    """Node by node as replay=False, the same tensors left behind, FlopCounterMode's total; the layers copied."""
    copied = assert_same_as_full(model, (), kwargs)
    replayed, full = _capture(model, kwargs, True), _capture(model, kwargs, False)
    assert _left_behind(replayed) == _left_behind(full)
    estimate = fxflops.estimate(model, kwargs=kwargs, conventions="torch")
    assert estimate.total_flops == oracle_flops(model, kwargs=oracle_kwargs or kwargs)
    # the proof of a passed attribute reads CPython 3.11's call bytecode; elsewhere the layers run (sound, slower)
    if layers_copied and sys.version_info[:2] == (3, 11):  # the attention (its cache update) copied, not only MLPs
        assert any(REPLAY_OF in node.meta and "scaled_dot_product" in str(node.target)
                   for node in replayed.graph_module.graph.nodes)
        assert copied > 0


def _tokens(seq: int = 12) -> torch.Tensor:
    return torch.zeros(2, seq, dtype=torch.long)


def test_llama_layers_given_a_dynamic_cache_are_replayed():
    model = _model(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=4, **SMALL))
    agrees(model, {"input_ids": _tokens(), "use_cache": True})


def test_the_cache_left_behind_holds_each_layers_keys():
    model = _model(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=3, **SMALL))
    replayed = _capture(model, {"input_ids": _tokens(), "use_cache": True}, True)
    # logits, then each layer's keys and values: batch 2, 2 kv heads, 12 positions, head dim 8
    assert _left_behind(replayed) == [((2, 12, 64), torch.float32)] + [((2, 2, 12, 8), torch.float32)] * 6


def test_gpt2_layers_given_a_cache_are_replayed():
    config = tf.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=64, n_positions=64)
    agrees(_model(tf.GPT2LMHeadModel, config), {"input_ids": _tokens(), "use_cache": True})


def test_sliding_window_and_full_layers_each_replay_their_own_kind():
    config = tf.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=5, max_window_layers=2,
                            layer_types=["full_attention", "sliding_attention"] * 2, **SMALL)
    model = _model(tf.Qwen2ForCausalLM, config)
    agrees(model, {"input_ids": _tokens(), "use_cache": True})
    replayed = _capture(model, {"input_ids": _tokens(), "use_cache": True}, True)
    shapes = _left_behind(replayed)[1:]
    # a sliding layer keeps no more than its window (transformers' DynamicSlidingWindowLayer), as a full capture
    assert shapes == _left_behind(_capture(model, {"input_ids": _tokens(), "use_cache": True}, False))[1:]


def test_mistral_sliding_window_layers():
    model = _model(tf.MistralForCausalLM, tf.MistralConfig(num_hidden_layers=3, sliding_window=5, **SMALL))
    agrees(model, {"input_ids": _tokens(), "use_cache": True})


def test_an_encoder_decoder_cache_read_past_its_methods_runs_every_layer():
    # GPT-2 with cross-attention reads the EncoderDecoderCache's is_updated itself: its layers run
    config = tf.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=64, n_positions=64, add_cross_attention=True)
    model = _model(tf.GPT2LMHeadModel, config)
    kwargs = {"input_ids": _tokens(), "encoder_hidden_states": torch.zeros(2, 5, 32), "use_cache": True}
    agrees(model, kwargs, layers_copied=False)


def test_once_a_block_handed_an_object_is_refused_no_other_block_handed_it_is_traced(monkeypatch):
    # T5's decoder blocks, their layers and attentions, each a kind of its own, are all handed the
    # EncoderDecoderCache and refused alike; tracing each as a reference cost more than running them
    # (a first call 0.28 -> 0.46 s): after the first refusal the others run without a reference
    from fxflops.capture.replay import Replays

    recorded = []
    record = Replays._record

    def counted(self, module, original, path, call, state, templates, args, kwargs):
        out = record(self, module, original, path, call, state, templates, args, kwargs)
        recorded.append((path, bool(call.handed), templates[-1].refused is not None))
        return out

    monkeypatch.setattr(Replays, "_record", counted)
    config = tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=4, num_heads=4)
    model = _model(tf.T5ForConditionalGeneration, config)
    kwargs = {"input_ids": _tokens(), "decoder_input_ids": _tokens(5)}
    captured = _capture(model, kwargs, True)
    handed = [(path, refused) for path, was_handed, refused in recorded if was_handed]
    assert len(handed) == 1 and handed[0][1]  # one reference handed the cache, refused; no other traced
    assert len(list(captured.graph_module.graph.nodes)) == len(list(_capture(model, kwargs, False)
                                                                     .graph_module.graph.nodes))
    monkeypatch.undo()
    agrees(model, kwargs, layers_copied=False)


def test_two_layers_writing_one_slot_make_the_capture_run_every_call():
    model = _model(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=4, **SMALL))
    model.model.layers[2].self_attn.layer_idx = 1  # layer 2 appends to layer 1's keys: twice as long there
    kwargs = {"input_ids": _tokens(), "use_cache": True}
    agrees(model, kwargs, layers_copied=False)
    assert _copied(_capture(model, kwargs, True)) == 0  # the capture ran again without replay


def test_a_second_decoding_step_reads_each_layers_filled_cache():
    model = _model(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=4, **SMALL))
    with torch.no_grad():
        cache = model(input_ids=_tokens(7), use_cache=True).past_key_values
    step = {"input_ids": _tokens(1), "past_key_values": cache, "use_cache": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        agrees(model, step, {**step, "past_key_values": copy.deepcopy(cache)})
        replayed = _capture(model, step, True)
    # each layer's keys: the 7 cached positions and the new one
    assert _left_behind(replayed)[1:] == [((2, 2, 8, 8), torch.float32)] * 8
    assert cache.get_seq_length() == 7  # the user's cache as it was


def test_a_static_cache_is_written_in_place_at_each_copy():
    config = tf.LlamaConfig(num_hidden_layers=3, **SMALL)
    model = _model(tf.LlamaForCausalLM, config)
    make = lambda: tf.StaticCache(config=config, max_cache_len=16)  # noqa: E731
    kwargs = {"input_ids": _tokens(), "past_key_values": make(), "use_cache": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        agrees(model, kwargs, {**kwargs, "past_key_values": make()})


def test_training_mode_with_a_cache():
    model = _model(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=3, **SMALL), training=True)
    with torch.random.fork_rng():
        agrees(model, {"input_ids": _tokens(), "use_cache": True})


def test_a_backward_with_a_cache_runs_its_layers_and_equals_a_full_capture():
    model = _model(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=3, **SMALL))
    kwargs = {"input_ids": _tokens(), "use_cache": True}
    replayed = fxflops.estimate(model, kwargs=kwargs, conventions="torch", backward=True)
    full = fxflops.estimate(model, kwargs=kwargs, conventions="torch", backward=True, replay=False)
    assert {n: (m.macs, m.flops, m.calls) for n, m in replayed.modules.items()} == \
        {n: (m.macs, m.flops, m.calls) for n, m in full.modules.items()}
    assert replayed.total_flops == full.total_flops


def test_verification_finds_no_difference(monkeypatch):
    monkeypatch.setenv("FXFLOPS_VERIFY_REPLAY", "1")
    model = _model(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=3, **SMALL))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayMismatch)
        fxflops.estimate(model, kwargs={"input_ids": _tokens(), "use_cache": True})


# --- caches that do not repeat -------------------------------------------------------------------------------

class _PeekingCache(tf.DynamicCache):
    """Joins the previous layer's keys to each layer's (legal Python, not what a layer's slot holds)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx > 0 and self.layers[layer_idx - 1].is_initialized:
            keys = torch.cat([self.layers[layer_idx - 1].keys, keys], dim=-2)
            values = torch.cat([self.layers[layer_idx - 1].values, values], dim=-2)
        return keys, values


_CALLS = []  # (test only) what the counting cache below counts


class _CountingCache(tf.DynamicCache):
    """Every third update returns its keys twice over: a count kept outside the cache."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        _CALLS.append(layer_idx)
        if len(_CALLS) % 3 == 0:
            return torch.cat([keys, keys], dim=-2), torch.cat([values, values], dim=-2)
        return keys, values


@pytest.mark.parametrize("cache", [_PeekingCache, _CountingCache])
def test_a_cache_whose_calls_do_not_repeat_makes_the_capture_run_every_call(cache):
    config = tf.LlamaConfig(num_hidden_layers=4, **SMALL)
    model = _model(tf.LlamaForCausalLM, config)
    kwargs = lambda: {"input_ids": _tokens(), "past_key_values": cache(config=config), "use_cache": True}  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        _CALLS.clear()
        replayed = _capture(model, kwargs(), True)
        _CALLS.clear()
        full = _capture(model, kwargs(), False)
        _CALLS.clear()
        estimate = fxflops.estimate(model, kwargs=kwargs(), conventions="torch")
        _CALLS.clear()
        assert estimate.total_flops == oracle_flops(model, kwargs=kwargs())
    assert [row[:3] for row in _rows(replayed)] == [row[:3] for row in _rows(full)]
    assert _left_behind(replayed) == _left_behind(full)


def _rows(captured) -> list[tuple]:
    return [(node.op, str(node.target), node.meta.get("fxflops_module"), _shape(node.meta.get("val")))
            for node in captured.graph_module.graph.nodes if node.op == "call_function"]


def _shape(value):
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


class _ReadingLayer(torch.nn.Module):
    """Reads another layer's slot of the cache itself, past its methods."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, cache):
        keys, _ = cache.update(self.proj(x)[:, None], x[:, None], self.index)
        if self.index and cache.layers[self.index - 1].is_initialized:
            keys = torch.cat([cache.layers[self.index - 1].keys, keys], dim=-2)
        return self.proj(x) + keys.sum(-2)


class _Reading(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_ReadingLayer(index) for index in range(4))

    def forward(self, x):
        cache = tf.DynamicCache()
        for layer in self.layers:
            x = layer(x, cache)
        return x, cache


def test_a_layer_reading_the_cache_past_its_methods_runs():
    model = _Reading().eval()
    args = (torch.zeros(3, 8),)
    assert_same_as_full(model, args)
    replayed = Counting.prepare("torch", None, None).capture(model, args, {}, "eager", replay=True)
    assert not any(REPLAY_OF in node.meta and node.meta["fxflops_module"][0].startswith("layers.") and
                   node.meta["fxflops_module"][0].count(".") == 1 for node in replayed.graph_module.graph.nodes)
    assert fxflops.estimate(model, args, conventions="torch").total_flops == oracle_flops(model, args)


class _PassingLayer(_ReadingLayer):
    """Passes its index through arithmetic: not the attribute as it is."""

    def forward(self, x, cache):
        keys, _ = cache.update(self.proj(x)[:, None], x[:, None], (self.index + 1) % 4)
        return self.proj(x) + keys.sum(-2)


class _Passing(_Reading):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_PassingLayer(index) for index in range(4))


def test_an_index_computed_before_the_call_keeps_the_layers_apart():
    model = _Passing().eval()
    args = (torch.zeros(3, 8),)
    assert_same_as_full(model, args)
    replayed = Counting.prepare("torch", None, None).capture(model, args, {}, "eager", replay=True)
    full = Counting.prepare("torch", None, None).capture(model, args, {}, "eager", replay=False)
    assert _left_behind(replayed) == _left_behind(full)


def test_a_llama_sweep_with_a_cache_equals_fresh_estimates():
    from tests.test_sweep import assert_same, llama, tokens

    model = llama()
    swept = fxflops.sweep(model, (tokens(2, 33),), {"use_cache": True}, dims={"batch": 0, "seq": 1})
    for batch, seq in [(1, 1), (3, 17), (2, 100), (5, 7)]:
        assert_same(swept.at(batch=batch, seq=seq), fxflops.estimate(model, (tokens(batch, seq),), {"use_cache": True}))


_TABLE = {"scale": 2.0}  # (test only) a mutable global the blocks below read


def _writes_into_a_dict_it_built(x):
    options = {}
    options["scale"] = _TABLE["scale"]
    options.update(bias=1.0)
    return x * options["scale"] + options["bias"]


def _writes_into_the_global(x):
    options = _TABLE
    options["scale"] = options["scale"] + 1.0  # each call scales by one more
    return x * options["scale"]


def test_a_write_into_a_dict_the_frame_built_is_not_a_write_into_what_it_read():
    from fxflops.capture.block_reads import line_reads

    built = line_reads(_writes_into_a_dict_it_built.__code__)
    assert not any(reads.mutates for reads in built.values())
    aliased = line_reads(_writes_into_the_global.__code__)
    assert any(reads.mutates for reads in aliased.values())


@pytest.mark.parametrize("function, replayed", [(_writes_into_a_dict_it_built, True), (_writes_into_the_global, False)])
def test_a_block_reading_a_mutable_global_replays_only_where_it_writes_into_its_own_dict(function, replayed):
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return function(self.proj(x))

    model = torch.nn.Sequential(*(Layer() for _ in range(3))).eval()
    args = (torch.zeros(3, 8),)
    before = dict(_TABLE)
    try:
        captured = Counting.prepare("torch", None, None).capture(model, args, {}, "eager", replay=True)
        _TABLE.update(before)
        assert_same_as_full(model, args)
    finally:
        _TABLE.clear()
        _TABLE.update(before)
    assert any(REPLAY_OF in node.meta and node.meta["fxflops_module"][0] == "2"
               for node in captured.graph_module.graph.nodes) == replayed
