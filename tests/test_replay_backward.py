"""Replay of repeated blocks in a training capture (capture/block_backward.py): a copy's backward ops are
copied from its reference's. Every node (name, op, module, phase, the forward op it differentiates, source
line, values' shapes, strides and dtypes, inputs) and every cost row must equal a capture that runs every
call (replay=False); where a copy's backward cannot be placed as a full capture places it, the call runs,
or the capture runs again without replay."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import fxflops
from fxflops.api import Counting
from fxflops.capture.backward import BACKWARD, PHASE
from fxflops.capture.replay import REPLAY_OF, VERIFY_ENV, ReplayMismatch, node_rows

tf = pytest.importorskip("transformers")


def _capture(model: nn.Module, args: tuple, kwargs: dict, replay: bool, loss=None):
    counting = Counting.prepare("deepspeed", None, None, "dense")
    captured = counting.capture(model, args, kwargs, "eager", replay=replay, backward=True, loss=loss)
    rows = [(c.name, c.op, c.status, c.rule, c.module, c.module_type, c.macs, c.flops, c.bytes, c.source,
             c.input_shapes, c.output_shapes, c.phase, c.differentiates) for c in counting.count(captured)]
    graph = captured.graph_module.graph
    copied = sum(REPLAY_OF in node.meta and node.meta.get(PHASE) == BACKWARD for node in graph.nodes)
    return rows, node_rows(graph), dict(captured.module_calls), copied


def assert_same_as_full(model: nn.Module, args: tuple = (), kwargs: dict | None = None, loss=None) -> int:
    """Every node and cost row equal with and without replay; returns how many backward nodes were copied."""
    kwargs = kwargs or {}
    rows, nodes, calls, copied = _capture(model, args, kwargs, True, loss)
    full_rows, full_nodes, full_calls, none = _capture(model, args, kwargs, False, loss)
    assert none == 0
    assert len(nodes) == len(full_nodes)
    for node, full in zip(nodes, full_nodes):
        assert node == full
    assert rows == full_rows
    assert calls == full_calls
    return copied


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x)).relu()


def _stack(depth: int = 4, block=Block) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[block() for _ in range(depth)])


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def _decoder(cls, config, seq: int = 12, **inputs):
    with torch.device("meta"):
        model = cls(config)
    return model, {"input_ids": torch.zeros(2, seq, dtype=torch.long), **inputs}


@pytest.mark.parametrize("labels", [False, True])
def test_llama_layers_backward_is_copied_and_every_node_is_a_full_captures(labels):
    model, kwargs = _decoder(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=4, **SMALL), use_cache=False)
    if labels:
        kwargs["labels"] = torch.zeros(2, 12, dtype=torch.long)
    assert assert_same_as_full(model, (), kwargs) > 0


def test_llama_with_tied_embeddings():
    # the embedding and the head share one weight: its two gradients are summed outside the layers
    config = tf.LlamaConfig(num_hidden_layers=4, tie_word_embeddings=True, **SMALL)
    model, kwargs = _decoder(tf.LlamaForCausalLM, config, use_cache=False)
    assert assert_same_as_full(model, (), kwargs) > 0


def test_gpt2_blocks_backward_is_copied():
    config = tf.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0,
                           eos_token_id=0)
    model, kwargs = _decoder(tf.GPT2LMHeadModel, config, use_cache=False)
    assert assert_same_as_full(model, (), kwargs) > 0


def test_resnet_bottlenecks_backward_is_copied():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet50().eval()
    assert assert_same_as_full(model, (torch.zeros(1, 3, 64, 64),)) > 0


def test_a_plain_stack_and_its_leaves_accumulated_where_autograd_accumulates():
    # LayerNorm's backward gives its weight and bias at once: each AccumulateGrad's copy (new_empty_strided,
    # copy_) follows it in the order autograd runs them, the Linear's bias before its weight's transpose
    assert assert_same_as_full(_stack(5), (torch.randn(2, 8),)) > 0
    assert assert_same_as_full(_stack(4), (torch.randn(2, 8, requires_grad=True),)) > 0


def test_a_shared_layer_called_at_every_depth_sums_its_gradients_as_a_full_capture():
    # one module (ALBERT-style) called four times: its weights' gradients are summed before one accumulation
    layer = Block()
    model = nn.Sequential(layer, layer, layer, layer)
    assert assert_same_as_full(model, (torch.randn(2, 8),)) == 0


def test_weights_tied_across_blocks():
    model = _stack(4)
    model[2].proj.weight = model[1].proj.weight
    assert_same_as_full(model, (torch.randn(2, 8),))


class Parallel(nn.Module):
    """Every block reads the same input (a leaf that takes gradients): its gradients are summed."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = _stack(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(block(x) for block in self.blocks)


def test_blocks_sharing_one_input_sum_its_gradient_as_a_full_capture():
    assert_same_as_full(Parallel(), (torch.randn(2, 8, requires_grad=True),))
    assert_same_as_full(Parallel(), (torch.randn(2, 8),))


class OutsideResidual(nn.Module):
    """The residual around each block is its parent's: the block's input gradient is summed with it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = _stack(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_residual_outside_the_block():
    assert_same_as_full(OutsideResidual(), (torch.randn(2, 8),))


class Hooked(Block):
    """A tensor hook registered in the forward: code that runs in the backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(self.norm(x))
        y.register_hook(lambda grad: grad * 2)
        return x + y.relu()


def test_a_block_whose_backward_runs_a_tensor_hook_runs_every_call():
    assert assert_same_as_full(_stack(4, Hooked), (torch.randn(2, 8),)) == 0


def test_a_block_with_a_full_backward_hook_runs_every_call():
    model = _stack(4)
    calls = []
    handles = [block.register_full_backward_hook(lambda m, gi, go: calls.append(m)) for block in model]
    try:
        assert assert_same_as_full(model, (torch.randn(2, 8),)) == 0
    finally:
        for handle in handles:
            handle.remove()
    assert len(calls) == 8  # every block's hook ran, in both captures


class Checkpointed(Block):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = lambda t: self.proj(self.norm(t)).relu()  # noqa: E731
        return x + torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_block_recomputes_as_a_full_capture(reentrant):
    model = _stack(4, lambda: Checkpointed(reentrant))
    assert_same_as_full(model, (torch.randn(2, 8, requires_grad=True),))


@pytest.mark.parametrize("reentrant", [False, True])
def test_llama_with_gradient_checkpointing(reentrant):
    # each layer runs under checkpoint: saved-tensor hooks (non-reentrant) or no grad (reentrant) around it,
    # and again in the backward: every node as a full capture's
    model, kwargs = _decoder(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=4, **SMALL), use_cache=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_same_as_full(model, (), kwargs)


def test_blocks_saving_different_tensors_are_not_confused():
    # the same ops forward, but half the layers frozen: their backward computes no weight gradient
    model = _stack(8)
    for block in model[::2]:
        block.proj.requires_grad_(False)
    assert assert_same_as_full(model, (torch.randn(2, 8, requires_grad=True),)) > 0


class Custom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x


class WithFunction(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + Custom.apply(self.proj(self.norm(x)))


def test_a_block_running_a_python_autograd_function_runs_every_call():
    assert assert_same_as_full(_stack(4, WithFunction), (torch.randn(2, 8),)) == 0


def test_a_training_estimate_with_replay_equals_flop_counter_mode():
    from torch.utils.flop_counter import FlopCounterMode

    model = _stack(4)
    x = torch.randn(2, 8)
    counter = FlopCounterMode(display=False)
    with counter:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    est = fxflops.estimate(model, (x,), backward=True, conventions="torch")
    assert est.total_flops == counter.get_total_flops() == 4 * 3 * 2 * 2 * 8 * 8


def test_verification_checks_a_training_capture_against_a_full_one(monkeypatch):
    model, kwargs = _decoder(tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=4, **SMALL), use_cache=False)
    monkeypatch.setenv(VERIFY_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayMismatch)
        rows, nodes, calls, copied = _capture(model, (), kwargs, True)
    assert copied == 0  # the full capture is the one returned
    monkeypatch.delenv(VERIFY_ENV)
    assert (rows, nodes) == _capture(model, (), kwargs, False)[:2]


def test_the_model_is_left_as_it_was_and_its_grads_untouched():
    model = _stack(4)
    marker = torch.ones(8, 8)
    model[1].proj.weight.grad = marker
    before = [(type(m), dict(m.__dict__)) for m in model.modules()]
    fxflops.estimate(model, (torch.randn(2, 8),), backward=True)
    assert [(type(m), dict(m.__dict__)) for m in model.modules()] == before
    assert model[1].proj.weight.grad is marker
    assert all(p.grad is None for name, p in model.named_parameters() if name != "1.proj.weight")


class InferenceThenTraining(nn.Module):
    """Every other block runs in inference mode: the next block's input is an inference tensor, which
    autograd refuses to save (a copy of the first block, given a plain tensor, would hide that)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = _stack(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            if index % 2:
                with torch.inference_mode():
                    x = block(x).clone()
            else:
                x = block(x)
        return x


def test_an_inference_tensor_argument_is_keyed_as_one():
    for replay in (True, False):
        with pytest.raises(Exception, match="Inference tensors cannot be saved for backward"):
            _capture(InferenceThenTraining(), (torch.randn(2, 8),), {}, replay)
