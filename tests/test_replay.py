"""Repeated blocks (fxflops/capture/replay.py): a call that provably runs the program an earlier call
ran gets copies of its nodes instead of running; the estimate must equal a capture that runs every
call, node by node, on every architecture — alternating, hybrid and MoE layers included."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn

import fxflops
from fxflops.api import Counting
from fxflops.capture.replay import REPLAY_OF

tf = pytest.importorskip("transformers")


def _costs(model: nn.Module, args: tuple, kwargs: dict, replay: bool, attention: str = "dense"):
    counting = Counting.prepare("deepspeed", None, None, attention)
    captured = counting.capture(model, args, kwargs, "eager", replay=replay)
    copied = sum(REPLAY_OF in node.meta for node in captured.graph_module.graph.nodes)
    rows = [(c.name, c.op, c.status, c.rule, c.module, c.module_type, c.macs, c.flops, c.bytes, c.source,
             c.input_shapes, c.output_shapes, c.attention, c.kept_pairs, c.dense_macs, c.effective_macs)
            for c in counting.count(captured)]
    return rows, captured.module_calls, captured.cautions, copied


def assert_same_as_full(model: nn.Module, args: tuple = (), kwargs: dict | None = None, *,
                        attention: str = "dense") -> int:
    """Every node's cost equal with and without repeats; returns how many nodes were copied."""
    kwargs = kwargs or {}
    rows, calls, cautions, copied = _costs(model, args, kwargs, True, attention)
    full_rows, full_calls, full_cautions, none = _costs(model, args, kwargs, False, attention)
    assert none == 0
    assert len(rows) == len(full_rows)
    for row, full in zip(rows, full_rows):
        assert row == full
    assert calls == full_calls
    assert cautions == full_cautions
    return copied


def _decoder(cls, config, seq: int = 12, **inputs):
    with torch.device("meta"):
        model = cls(config).eval()
    return model, {"input_ids": torch.zeros(2, seq, dtype=torch.long), **inputs}


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("use_cache", [False, True])
def test_llama_layers_are_copied_and_cost_what_a_full_capture_gives(use_cache):
    model, kwargs = _decoder(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=4, **SMALL), use_cache=use_cache)
    copied = assert_same_as_full(model, (), kwargs)
    assert copied > 0  # three of the four layers are copies of the first


@pytest.mark.parametrize("seq", [3, 12])  # shorter and longer than the window
def test_alternating_sliding_and_full_layers_read_their_own_masks(seq):
    config = tf.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=4, max_window_layers=2,
                            **SMALL)
    model, kwargs = _decoder(tf.Qwen2ForCausalLM, config, seq)
    assert_same_as_full(model, (), kwargs, attention="effective")
    assert_same_as_full(model, (), kwargs)


def test_gemma3_alternating_layers():
    config = tf.Gemma3TextConfig(num_hidden_layers=4, sliding_window=4, head_dim=8,
                                 layer_types=["sliding_attention", "full_attention"] * 2, **SMALL)
    model, kwargs = _decoder(tf.Gemma3ForCausalLM, config)
    assert_same_as_full(model, (), kwargs, attention="effective")


def test_gemma2_eager_attention_layers():
    config = tf.Gemma2Config(num_hidden_layers=4, sliding_window=4, head_dim=8, attn_implementation="eager", **SMALL)
    model, kwargs = _decoder(tf.Gemma2ForCausalLM, config)
    assert_same_as_full(model, (), kwargs, attention="effective")


def test_moe_every_second_layer():
    config = tf.Qwen2MoeConfig(num_hidden_layers=4, decoder_sparse_step=2, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32, **SMALL)
    model, kwargs = _decoder(tf.Qwen2MoeForCausalLM, config)
    assert_same_as_full(model, (), kwargs)


def test_mixtral_experts():
    config = tf.MixtralConfig(num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2, **SMALL)
    model, kwargs = _decoder(tf.MixtralForCausalLM, config)
    assert_same_as_full(model, (), kwargs)


def test_hybrid_linear_and_full_attention():
    if not hasattr(tf, "Qwen3NextConfig"):
        pytest.skip("this transformers has no Qwen3-Next (hybrid linear / full attention)")
    config = tf.Qwen3NextConfig(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                                head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
                                linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32, **SMALL)
    model, kwargs = _decoder(tf.Qwen3NextForCausalLM, config)
    assert_same_as_full(model, (), kwargs)


@pytest.mark.parametrize("kind", ["gpt2", "bert", "t5"])
def test_encoder_decoder_and_classic_transformers(kind):
    if kind == "gpt2":
        model, kwargs = _decoder(tf.GPT2LMHeadModel, tf.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=64))
    elif kind == "bert":
        model, kwargs = _decoder(tf.BertModel, tf.BertConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=4,
                                                              intermediate_size=64, vocab_size=64))
    else:
        model, kwargs = _decoder(tf.T5Model, tf.T5Config(num_layers=4, d_model=32, d_kv=8, num_heads=4, d_ff=64,
                                                         vocab_size=64))
        kwargs["decoder_input_ids"] = torch.zeros(2, 5, dtype=torch.long)
    assert assert_same_as_full(model, (), kwargs) > 0


def test_resnet_blocks():
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        model = torchvision.models.resnet50().eval()
    assert assert_same_as_full(model, (torch.zeros(1, 3, 64, 64),)) > 0


class _ByIndex(nn.Module):
    """Siblings alike in class and weights whose forward differs by an attribute: odd ones scale."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        return x * 2 if self.index % 2 else x


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _replayed_modules(model: nn.Module, args: tuple) -> set[str]:
    counting = Counting.prepare("deepspeed", None, None)
    captured = counting.capture(model, args, {}, "eager")
    return {node.meta["fxflops_module"][0] for node in captured.graph_module.graph.nodes if REPLAY_OF in node.meta}


def test_a_block_whose_code_reads_an_attribute_that_differs_runs():
    model = _Stack([_ByIndex(i) for i in range(4)])
    assert_same_as_full(model, (torch.zeros(3, 8),))
    # each block reads its own index: none stands for another. Their Linear layers read no attribute that
    # differs: block 0 is recorded at once (its parts wait), block 1 differs and is recorded in turn, its
    # Linear with it (its second call of that kind): that Linear's program stands for blocks 2 and 3's
    assert _replayed_modules(model, (torch.zeros(3, 8),)) == {"blocks.2.proj", "blocks.3.proj"}
    counting = Counting.prepare("deepspeed", None, None)
    costs = counting.count(counting.capture(model, (torch.zeros(3, 8),), {}, "eager"))
    assert sum(c.flops for c in costs if c.op.startswith("aten.mul")) == 2 * 3 * 8  # two scaling layers


class _SameOpsOtherLine(nn.Module):
    """Siblings whose ops are the same but come from different source lines (one per index)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.index == 0:
            return torch.relu(self.proj(x))
        return torch.relu(self.proj(x))


def test_an_op_of_library_code_keeps_the_line_that_called_it():
    model = _Stack([_SameOpsOtherLine(i) for i in range(4)])
    rows, _, _, copied = _costs(model, (torch.zeros(3, 8),), {}, True)
    full_rows = _costs(model, (torch.zeros(3, 8),), {}, False)[0]
    assert rows == full_rows  # each linear keeps the line of the block that called it
    # block 0 is recorded at once, block 1 differs and is recorded with its Linear (that Linear's second
    # call of its kind): blocks 2 and 3's Linear layers are copies of it
    assert copied == 2


def test_a_shared_block_called_twice_and_hooks_still_run():
    shared = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    model = _Stack([shared, nn.Sequential(nn.Linear(8, 8), nn.ReLU()), shared])
    seen = []
    handle = model.blocks[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        assert_same_as_full(model, (torch.zeros(3, 8),))
    finally:
        handle.remove()
    assert seen == [torch.Size([3, 8])] * 2  # ran in both captures, copied or not


# --- what makes a call run rather than replay ------------------------------------------------------


class _WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)  # into the caller's tensor
        return self.proj(x)


class _CountsItsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.proj(x)


class _TakesABox(nn.Module):
    """A block given an object it appends to (as a KV cache is updated)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, box: list) -> torch.Tensor:
        box.append(x)
        return self.proj(x)


class _BoxStack(_Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        box: list = []
        for block in self.blocks:
            x = block(x, box)
        return x + sum(t.sum() for t in box)


class _ReturnsAnObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Any:
        return types.SimpleNamespace(out=self.proj(x))


class _ObjectStack(_Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x).out
        return x


@pytest.mark.parametrize(("stack", "block", "runs"), [
    (_Stack, _WritesItsInput, "a write into the caller's tensor"),
    (_Stack, _CountsItsCalls, "a change of its own attribute"),
    (_BoxStack, _TakesABox, "an object argument"),
    (_ObjectStack, _ReturnsAnObject, "an object output"),
])
def test_a_block_with_effects_outside_its_output_runs_every_call(stack, block, runs):
    model = stack([block() for _ in range(4)])
    assert_same_as_full(model, (torch.zeros(3, 8),))
    replayed = _replayed_modules(model, (torch.zeros(3, 8),))
    assert not any(name.count(".") == 1 for name in replayed), runs  # no block replayed, only Linear layers


class _TiedInLater(nn.Module):
    """Two weights read together; a later block is given one tensor for both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(8, 8))
        self.b = nn.Parameter(torch.zeros(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.a + self.b)


def test_a_copy_reading_one_tensor_where_its_reference_read_two_counts_its_own_bytes():
    """The count hands a reference's cost on to its copies; where a copy reads one tensor in two places
    of the reference's two, its add reads 256 bytes, not 512, and is costed on its own."""
    blocks = [_TiedInLater() for _ in range(4)]
    blocks[3].b = blocks[3].a
    model = _Stack(blocks)
    assert_same_as_full(model, (torch.zeros(3, 8),))
    counting = Counting.prepare("deepspeed", None, None)
    costs = counting.count(counting.capture(model, (torch.zeros(3, 8),), {}, "eager"))
    adds = [c.bytes for c in costs if c.op.startswith("aten.add")]
    assert adds == [3 * 8 * 8 * 4] * 3 + [2 * 8 * 8 * 4]  # by hand: read a and b (or a once), write 8x8 fp32


def test_a_block_returning_its_input_and_a_shared_tensor_replays():
    class PassThrough(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.register_buffer("scale", torch.ones(8))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self.proj(x) * self.scale, x, self.scale

    class Pairs(_Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                y, same, scale = block(x)
                x = y + same + scale
            return x

    model = Pairs([PassThrough() for _ in range(4)])
    assert_same_as_full(model, (torch.zeros(3, 8),))
    assert {"blocks.2", "blocks.3"} <= _replayed_modules(model, (torch.zeros(3, 8),))


def test_a_users_global_hook_sees_every_call_and_nothing_is_replayed():
    model = _Stack([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)])
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    try:
        assert _replayed_modules(model, (torch.zeros(3, 8),)) == set()
    finally:
        handle.remove()
    assert seen.count("Linear") == 4


def test_a_training_count_copies_layers_backward_too():
    # (every node equal to replay=False: tests/test_replay_backward.py)
    model, kwargs = _decoder(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=4, **SMALL), use_cache=False)
    counting = Counting.prepare("deepspeed", None, None)
    captured = counting.capture(model, (), kwargs, "eager", backward=True)
    assert any(REPLAY_OF in node.meta and node.meta.get("fxflops_phase") == "backward"
               for node in captured.graph_module.graph.nodes)


def test_a_memory_estimate_runs_every_call_and_its_peak_is_that_of_no_replay():
    # copies share their reference's fake storages: the timeline read them as one long life (953,088 vs 846,336 B)
    model, kwargs = _decoder(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=4, **SMALL), use_cache=False)

    def peak(replay: bool) -> int:
        return fxflops.estimate(model, kwargs=kwargs, memory=True, replay=replay).memory.peak_bytes

    assert peak(True) == peak(False)


def test_the_model_is_left_as_it_was():
    model, kwargs = _decoder(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=4, **SMALL), use_cache=False)
    before = [(type(m), dict(m.__dict__)) for m in model.modules()]
    assert_same_as_full(model, (), kwargs)
    after = [(type(m), dict(m.__dict__)) for m in model.modules()]
    assert [cls for cls, _ in before] == [cls for cls, _ in after]  # no watching subclass left behind
    assert all(a.keys() == b.keys() and all(a[k] is b[k] for k in a) for (_, a), (_, b) in zip(before, after))


def test_a_sweep_replays_and_each_point_equals_a_fresh_estimate():
    import fxflops

    model, _ = _decoder(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=4, **SMALL))
    tokens = lambda batch, seq: torch.zeros(batch, seq, dtype=torch.long)  # noqa: E731
    swept = fxflops.sweep(model, (tokens(2, 33),), {"use_cache": False}, dims={"batch": 0, "seq": 1})
    for batch, seq in [(2, 33), (3, 17), (1, 64), (5, 999)]:
        fresh = fxflops.estimate(model, (tokens(batch, seq),), {"use_cache": False})
        point = swept.at(batch=batch, seq=seq)
        assert (point.total_macs, point.total_flops) == (fresh.total_macs, fresh.total_flops)


def test_the_calls_of_blocks_replayed_inside_a_reference_are_counted_in_its_replays():
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
            self.second = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(self.first(x))

    class Lead(Outer):  # a class of its own: its call runs, and its parts are the first of their kind
        pass

    model = _Stack([Lead(), Outer(), Outer(), Outer()])
    assert_same_as_full(model, (torch.zeros(3, 8),))  # module calls included
    # blocks.0.first is a reference, blocks.0.second its copy; blocks.1 is the reference of Outer, in which
    # blocks.1.first and .second replay blocks.0.first's program; blocks.2 and .3 copy blocks.1, calls and all
    replayed = _replayed_modules(model, (torch.zeros(3, 8),))
    for block in ("blocks.0.second.", "blocks.2.", "blocks.3.", "blocks.1.first.", "blocks.1.second."):
        assert any(name.startswith(block) for name in replayed), block


class _HalfWeights(nn.Module):
    """A bfloat16 layer given float32 activations: real kernels refuse the mixed dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).float()


def test_replayed_copies_keep_the_kernel_problems_of_their_reference():
    """A copy's kernel check is its reference's (same op, dtypes and meta): the caution still names each call."""
    model = _Stack([_HalfWeights() for _ in range(4)])
    assert_same_as_full(model, (torch.zeros(3, 8),))  # cautions included
    assert _replayed_modules(model, (torch.zeros(3, 8),)) >= {"blocks.1.proj", "blocks.3.proj"}
    counting = Counting.prepare("deepspeed", None, None)
    cautions = counting.capture(model, (torch.zeros(3, 8),), {}, "eager").cautions
    assert any("(4 calls)" in caution and "operands of different dtypes" in caution for caution in cautions), cautions


def test_a_copys_fresh_output_has_its_references_strides_as_expressions():
    """A reference output contiguous as expressions whose size may be 0 (`s - 3`): torch.empty would stride it
    `Max(1, s - 3)`, not the mode's `s - 3` (found by review): it is made with the reference's strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxflops.capture.replay import Replays
    from tests.test_symbolic_elementwise import _env, _sizes

    env = _env()
    b, s = _sizes(env)
    mode = FakeTensorMode(shape_env=env, static_shapes=True)
    with mode:
        likes = [torch.empty(b * (s - 3)).view(b, s - 3), torch.empty(b, s, 8)]
    for like in likes:
        made = Replays._made_like(types.SimpleNamespace(_mode=mode), like)
        assert [str(step) for step in made.stride()] == [str(step) for step in like.stride()]
        assert (made.shape, made.dtype, made.storage_offset()) == (like.shape, like.dtype, 0)


def test_a_fresh_output_is_made_unseen_by_a_recording_references_trace():
    """A copy's fresh output is made by torch's constructors alone: a reference recording meanwhile (a leaf replayed
    inside it) is not shown their Python calls (under named sizes each size's arithmetic is torch's Python, and the
    trace function on every call of it was a fifth of a fresh tensor's cost), and it traces on afterwards."""
    import sys

    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxflops.capture.block_reads import Tracer
    from fxflops.capture.replay import Replays
    from tests.test_symbolic_elementwise import _env, _sizes

    env = _env()
    b, s = _sizes(env)
    mode = FakeTensorMode(shape_env=env, static_shapes=True)
    with mode:
        likes = [torch.empty(b, s, 8), torch.empty(b, s, 8).transpose(1, 2)]
    tracer = Tracer()
    tracer.start()
    try:
        made = [Replays._made_like(types.SimpleNamespace(_mode=mode), like) for like in likes]
        tracing = sys.gettrace()
    finally:
        tracer.stop()
    assert tracing is not None  # tracing again after each
    seen = {code.co_filename for code in tracer._traced}
    assert not any(name.endswith(("sym_node.py", "symbolic_shapes.py")) for name in seen), sorted(seen)
    for fresh, like in zip(made, likes):
        assert (fresh.shape, fresh.stride(), fresh.dtype) == (like.shape, like.stride(), like.dtype)


def test_a_copys_fresh_output_of_another_layout_is_its_references_layout_in_a_storage_of_its_size():
    """A reference output that is not contiguous as expressions (transposed heads, a slice at an offset) is made
    in a new storage of the reference output's own size, the same expression, at its sizes, strides and offset:
    nothing asked of the sizes, no storage shared."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxflops.capture.replay import Replays
    from tests.test_symbolic_elementwise import _env, _sizes

    env = _env()
    b, s = _sizes(env)
    mode = FakeTensorMode(shape_env=env, static_shapes=True)
    with mode:
        likes = [torch.empty(b, s, 8, 16).transpose(1, 2), torch.empty(b, s + 2, 8)[:, 2:],
                 torch.empty_strided((b, 8, s, 16), (128 * s, 16, 128, 1))]
    for like in likes:
        made = Replays._made_like(types.SimpleNamespace(_mode=mode), like)
        assert [str(x) for x in (*made.shape, *made.stride(), made.storage_offset())] == \
            [str(x) for x in (*like.shape, *like.stride(), like.storage_offset())]
        assert str(made.untyped_storage().nbytes()) == str(like.untyped_storage().nbytes())
        assert made.untyped_storage()._cdata != like.untyped_storage()._cdata
        assert (type(made), made.fake_mode, made.dtype, made.device) == (type(like), mode, like.dtype, like.device)
        assert not made._is_view()
    assert (env.guards, env.deferred_runtime_asserts) == ([], {})
