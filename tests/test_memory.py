"""Memory: the captured step's peak tensor bytes against torch's own tracker on a real CPU step, and
hand formulas (ZeRO model states, Korthikanti et al.'s GPT layer activations)."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import fxflops
from fxflops.memory import Allowance, MemoryOptions
from fxflops.memory.formulas import gpt_layer_activation_bytes, model_state_bytes
from fxflops.memory.records import ACTIVATIONS, GRADIENTS, OPTIMIZER, PARAMETERS


def tracked_peak(model: nn.Module, inputs: tuple, make_optimizer=None, output=lambda out: out,
                 keep_grads: bool = False) -> int:
    """MemTracker's peak bytes over one real step on the CPU: forward, backward of ones (fxflops' default
    loss), optimizer step and zero_grad; a step after the first (the optimizer's state exists). The
    caller holds the model's output until the step ends, as fxflops assumes. `keep_grads`: the
    gradients exist when the step starts and stay (zero_grad(set_to_none=False))."""
    optimizer = make_optimizer(model) if make_optimizer else None
    if optimizer is not None or keep_grads:
        out = output(model(*inputs))
        out.backward(torch.ones_like(out))
        if optimizer is not None:
            optimizer.step()
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter) if keep_grads else None
        del out
    tracker = MemTracker()
    tracker.track_external(model, *([optimizer] if optimizer else []), *inputs)
    with tracker:
        whole = model(*inputs)
        out = output(whole)
        seed = torch.ones_like(out)
        out.backward(seed)
        del seed
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=not keep_grads)
        del out, whole
    for parameter in model.parameters():
        parameter.grad = None
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


class LiveStorages(TorchDispatchMode):
    """An allocation hook for what MemTracker cannot follow (it registers a hook on every parameter, and a
    frozen one refuses it): the bytes of every storage alive, each op's outputs added as they appear and
    each storage dropped when it is freed (a weakref finalizer), the tensors given up front included."""

    def __init__(self, tensors) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.freed: dict[int, weakref.finalize] = {}
        for tensor in tensors:
            self._add(tensor)

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if key in self.freed or not nbytes:
            return
        self.live += nbytes
        self.peak = max(self.peak, self.live)

        def free() -> None:
            self.live -= nbytes
            self.freed.pop(key, None)

        self.freed[key] = weakref.finalize(storage, free)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._add(value)
        return out


def hooked_peak(model: nn.Module, inputs: tuple, make_optimizer) -> int:
    """The peak of `LiveStorages` over one real step, as tracked_peak runs it."""
    optimizer = make_optimizer(model)
    out = model(*inputs)
    out.backward(torch.ones_like(out))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del out
    states = [value for state in optimizer.state.values() for value in state.values()
              if isinstance(value, torch.Tensor)]
    held = [*model.parameters(), *model.buffers(), *inputs, *states]
    with LiveStorages(held) as hook:
        out = model(*inputs)
        seed = torch.ones_like(out)
        out.backward(seed)
        del seed
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del out
    return hook.peak


def counted(model: nn.Module, inputs: tuple, optimizer=None, memory=True, **options):
    return fxflops.estimate(model, inputs, backward=True, optimizer=optimizer, memory=memory, **options).memory


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))


ADAMW = lambda model: torch.optim.AdamW(model.parameters())  # noqa: E731
OPTIMIZERS = {
    "adamw": ADAMW,
    "adamw-foreach": lambda model: torch.optim.AdamW(model.parameters(), foreach=True),
    "adam-coupled-decay": lambda model: torch.optim.Adam(model.parameters(), weight_decay=0.1),
    "sgd-momentum": lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1),
    "adamw-fused": lambda model: torch.optim.AdamW(model.parameters(), fused=True),
    "adam-fused-amsgrad": lambda model: torch.optim.Adam(model.parameters(), fused=True, amsgrad=True),
    "adamw-foreach-amsgrad": lambda model: torch.optim.AdamW(model.parameters(), foreach=True, amsgrad=True),
    "sgd-fused": lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1, fused=True),
    "none": None,
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_mlp_step_peak_equals_mem_tracker(name):
    make = OPTIMIZERS[name]
    model, x = mlp(), torch.randn(32, 64)
    memory = counted(model, (x,), make(mlp()) if make else None)
    assert memory.peak_bytes == tracked_peak(model, (x,), make)


def test_the_allocation_hook_agrees_with_mem_tracker():
    model, x = mlp(), torch.randn(32, 64)
    assert hooked_peak(model, (x,), ADAMW) == tracked_peak(model, (x,), ADAMW)


def test_frozen_layers_hold_no_gradient_nor_optimizer_state():
    model, x = mlp(), torch.randn(32, 64)
    for parameter in model[0].parameters():
        parameter.requires_grad_(False)
    trainable = lambda m: torch.optim.AdamW(p for p in m.parameters() if p.requires_grad)  # noqa: E731
    memory = counted(model, (x,), trainable(model))
    assert memory.peak_bytes == hooked_peak(model, (x,), trainable)
    frozen = 64 * 128 + 128
    params = sum(p.numel() for p in model.parameters())
    assert memory.model_states[GRADIENTS] == 4 * (params - frozen)
    assert memory.model_states[OPTIMIZER] == 8 * (params - frozen) + 4 * 4  # four trainable tensors


def test_mlp_model_states_by_hand():
    model, x = mlp(), torch.randn(32, 64)
    params = sum(p.numel() for p in model.parameters())
    memory = counted(model, (x,), "adamw")
    # fp32: 4-byte weights and grads; AdamW's exp_avg and exp_avg_sq (4 + 4) and a 4-byte step per tensor
    assert memory.model_states[PARAMETERS] == 4 * params
    assert memory.model_states[GRADIENTS] == 4 * params
    assert memory.model_states[OPTIMIZER] == 8 * params + 4 * len(list(model.parameters()))
    # the peak is in the optimizer's loop at the largest weight (128 x 128): its sqrt and quotient, 2 x 64 KiB,
    # while the previous parameter's denom (the first bias, 128 floats) is still bound
    assert memory.peak_at.phase == "optimizer step"
    assert memory.by_kind["temporaries"] == 2 * 128 * 128 * 4 + 128 * 4


def test_resnet18_step_equals_mem_tracker():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model, x = torchvision.models.resnet18(num_classes=10), torch.randn(2, 3, 16, 16)
    assert counted(model, (x,), ADAMW(model)).peak_bytes == tracked_peak(model, (x,), ADAMW)


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).train()


def _llama(dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    return transformers.LlamaForCausalLM(config).to(dtype).train()


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama-gqa"])
@pytest.mark.parametrize("optimizer", ["none", "adamw"])
def test_transformers_step_equals_mem_tracker(build, optimizer):
    model, ids = build(), torch.randint(0, 128, (2, 16))
    make = OPTIMIZERS[optimizer]
    logits = lambda out: out.logits  # noqa: E731
    memory = counted(model, (ids,), make(model) if make else None, loss=logits)
    assert memory.peak_bytes == tracked_peak(model, (ids,), make, logits)


def test_mixture_of_experts_step_equals_mem_tracker():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        num_local_experts=4, num_experts_per_tok=2)
    model, ids = transformers.MixtralForCausalLM(config).train(), torch.randint(0, 128, (2, 16))
    logits = lambda out: out.logits  # noqa: E731
    assert counted(model, (ids,), loss=logits).peak_bytes == tracked_peak(model, (ids,), None, logits)


@pytest.mark.parametrize("build", [mlp, _gpt2], ids=["mlp", "gpt2"])
def test_gradients_kept_from_step_to_step_equal_mem_tracker(build):
    # a micro-batch after the first under gradient accumulation, or zero_grad(set_to_none=False): the
    # backward adds into .grad tensors that exist all step
    model = build()
    inputs = (torch.randn(32, 64),) if build is mlp else (torch.randint(0, 128, (2, 16)),)
    output = (lambda out: out) if build is mlp else (lambda out: out.logits)
    memory = counted(model, inputs, ADAMW(model), loss=output, memory=MemoryOptions(grads_at_start=True))
    assert memory.peak_bytes == tracked_peak(model, inputs, ADAMW, output, keep_grads=True)
    assert memory.timeline[0].by_kind[GRADIENTS] == sum(4 * p.numel() for p in model.parameters())


class Autocast(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(ids).logits


def test_bf16_autocast_llama_equals_mem_tracker():
    model, ids = Autocast(_llama()), torch.randint(0, 128, (2, 16))
    assert counted(model, (ids,), ADAMW(model)).peak_bytes == tracked_peak(model, (ids,), ADAMW)


def test_bf16_weights_llama_equals_mem_tracker():
    model, ids = _llama(torch.bfloat16), torch.randint(0, 128, (2, 16))
    logits = lambda out: out.logits  # noqa: E731
    assert counted(model, (ids,), ADAMW(model), loss=logits).peak_bytes == tracked_peak(model, (ids,), ADAMW, logits)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, checkpointing: str | None, d: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointing is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
        return x


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
def test_activation_checkpointing_equals_mem_tracker(checkpointing):
    torch.manual_seed(0)
    model = Stack(checkpointing)
    x = torch.randn(4, 16, 32, requires_grad=checkpointing == "reentrant")  # reentrant needs an input that does
    memory = counted(model, (x,))
    assert memory.peak_bytes == tracked_peak(model, (x,))
    if checkpointing:  # only the blocks' inputs are saved: the output, and each block's input x (8 KiB each)
        assert memory.saved_under("blocks") == 3 * 4 * 16 * 32 * 4


class Views(nn.Module):
    """A storage counted once through views, reshapes and in-place ops."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)  # 32 x 64 floats: 8 KiB
        z = y.view(32, 8, 8).transpose(1, 2).relu_()  # the same storage, changed in place
        return z.reshape(32, 64).sum(dim=0)


def test_views_and_in_place_share_one_storage():
    model, x = Views(), torch.randn(32, 64)
    memory = fxflops.estimate(model, (x,), memory=True).memory
    weights, inputs, y = 64 * 64 * 4, 32 * 64 * 4, 32 * 64 * 4
    # at the peak, y's storage once and the reshape's copy (a transposed view cannot be viewed as 32 x 64)
    assert memory.peak_bytes == weights + inputs + y + y
    # the one known difference: a real forward's locals (y, z) keep y's storage while sum() runs, past its
    # last use in the graph, which is all the record knows; the sum's 64 floats come on top of the peak
    assert tracked_forward_peak(model, x) == memory.peak_bytes + 64 * 4


def tracked_forward_peak(model: nn.Module, x: torch.Tensor) -> int:
    tracker = MemTracker()
    tracker.track_external(model, x)
    with tracker, torch.no_grad():
        out = model(x)
        del out
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_mixed_precision_adam_model_states_are_16_bytes_per_parameter():
    model = mlp().to(torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    params, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    memory = counted(model, (x,), "adamw", memory=MemoryOptions(master_weights=True))
    states = memory.model_states
    # bf16 weights and grads; fp32 master weights, momentum and variance (ZeRO §3.1: 2 + 2 + 12 bytes),
    # plus torch.optim's 4-byte step per parameter tensor, which the paper's K = 12 leaves out
    assert (states[PARAMETERS], states[GRADIENTS]) == (2 * params, 2 * params)
    assert states[OPTIMIZER] == 12 * params + 4 * tensors
    assert model_state_bytes(params) == {"parameters": 2 * params, "gradients": 2 * params, "optimizer": 12 * params}


def test_zero_stages_divide_by_dp_formula():
    n, dp = 1000, 8
    assert model_state_bytes(n, dp=dp, zero_stage=0) == {"parameters": 2000, "gradients": 2000, "optimizer": 12000}
    assert model_state_bytes(n, dp=dp, zero_stage=1) == {"parameters": 2000, "gradients": 2000, "optimizer": 1500}
    assert model_state_bytes(n, dp=dp, zero_stage=2) == {"parameters": 2000, "gradients": 250, "optimizer": 1500}
    assert model_state_bytes(n, dp=dp, zero_stage=3) == {"parameters": 250, "gradients": 250, "optimizer": 1500}
    # the ZeRO paper's example: 7.5B parameters on 64 GPUs, 120 GB -> 1.9 GB at stage 3 (Figure 1)
    per_rank = sum(model_state_bytes(7_500_000_000, dp=64, zero_stage=3).values())
    assert per_rank == 1_875_000_000
    with pytest.raises(ValueError, match="zero_stage"):
        model_state_bytes(n, zero_stage=4)


class PaperLayer(nn.Module):
    """A GPT layer as Korthikanti et al. (2022) count it: Megatron's (s, b, h) layout, attention as bmm,
    softmax and dropout, GeLU MLP, dropout after both blocks. `selective` recomputes the attention core."""

    def __init__(self, h: int, a: int, selective: bool = False) -> None:
        super().__init__()
        self.a, self.selective = a, selective
        self.ln1, self.qkv, self.proj = nn.LayerNorm(h), nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.drop_attn, self.drop1, self.drop2 = nn.Dropout(0.1), nn.Dropout(0.1), nn.Dropout(0.1)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = torch.bmm(q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2)) * q.shape[-1] ** -0.5
        return torch.bmm(self.drop_attn(torch.softmax(scores, dim=-1)), v.transpose(0, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b * self.a, 3 * h // self.a).split(h // self.a, dim=-1)
        context = checkpoint(self.core, q, k, v, use_reentrant=False) if self.selective else self.core(q, k, v)
        x = x + self.drop1(self.proj(context.transpose(0, 1).reshape(s, b, h)))
        return x + self.drop2(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_gpt_layer_activations_match_korthikanti(recompute):
    s, b, h, a = 16, 2, 32, 4
    model = nn.Sequential(*(PaperLayer(h, a, recompute == "selective") for _ in range(3))).half()
    memory = counted(model, (torch.randn(s, b, h, dtype=torch.float16),))
    paper = gpt_layer_activation_bytes(s, b, h, a, recompute=recompute)
    assert paper == s * b * h * (34 + (5 * a * s / h if recompute == "none" else 0))
    # departures, each by hand: a CPU dropout keeps its mask in the input's dtype (2 bytes, not the
    # paper's 1): +1 byte for each of the two s*b*h masks, and for the a*s*s*b one unless recomputed;
    # LayerNorm keeps its mean and rstd (2 x s*b halves each, two norms), which the paper leaves out
    masks = 2 * s * b * h + (a * s * s * b if recompute == "none" else 0)
    norms = 2 * 2 * s * b * 2
    # the middle layer: its own saved tensors plus its output, which the next layer's norm saves
    assert memory.saved_under("1") == paper + masks + norms


def test_korthikanti_formula_variants():
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B as in the paper's Table 3
    assert gpt_layer_activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert gpt_layer_activation_bytes(s, b, h, a, t=t) == s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert gpt_layer_activation_bytes(s, b, h, a, t=t, sequence_parallel=True) == s * b * h / t * (34 + 5 * a * s / h)
    assert gpt_layer_activation_bytes(s, b, h, a, t=t, sequence_parallel=True, recompute="selective") == \
        s * b * h * 34 / t
    assert gpt_layer_activation_bytes(s, b, h, a, recompute="full") == 2 * s * b * h


def test_allowance_is_apart_from_peak_bytes():
    model, x = mlp(), torch.randn(32, 64)
    plain = counted(model, (x,), "adamw")
    assert plain.allowance_bytes.context == 512 * 2**20
    assert plain.device_bytes == plain.peak_bytes + plain.allowance_bytes.total
    custom = counted(model, (x,), "adamw", memory=MemoryOptions(
        allowance=Allowance(block_bytes=1, context_bytes=0, collective_bytes=7, fragmentation=0.5)))
    assert custom.peak_bytes == plain.peak_bytes
    assert custom.allowance_bytes.rounding == 0
    assert custom.allowance_bytes.total == 7 + plain.peak_bytes // 2


def test_rounding_to_512_byte_blocks():
    assert Allowance().rounding([1, 512, 513, 1024]) == 511 + 0 + 511 + 0


def test_memory_needs_the_eager_capture():
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="eager capture"):
        fxflops.estimate(model, (torch.randn(2, 4),), method="symbolic", memory=True)


def test_text_summary_and_json_carry_the_memory_section():
    model, x = mlp(), torch.randn(32, 64)
    result = fxflops.estimate(model, (x,), backward=True, optimizer="adamw",
                              memory=MemoryOptions(device="H100 SXM"))
    memory = result.memory
    from fxflops.report.memory_text import memory_lines, memory_to_string

    lines = memory_lines(result)
    text = result.print(detailed=False, as_string=True)
    assert lines[0].split()[-5:] == [*memory_to_string(memory.peak_bytes).split(), "at", "optimizer", "step"]
    assert lines[-1].endswith(f"yes, {memory_to_string(80 * 2**30 - memory.device_bytes)} headroom")
    assert all(line in text for line in lines)
    record = json.loads(result.to_json())["memory"]
    assert record["peak_bytes"] == memory.peak_bytes
    assert record["by_kind"] == memory.by_kind
    assert record["capacity"] == 80 * 2**30 and record["fits"] is True
    assert record["allowance"]["total"] == record["device_bytes"] - record["peak_bytes"]


def test_memory_to_string_binary_units():
    from fxflops.report.memory_text import memory_to_string

    assert [memory_to_string(n) for n in (512, 1536, 3 * 2**30)] == ["512 B", "1.50 KiB", "3.00 GiB"]


def test_a_device_without_a_memory_size_is_one_line():
    with pytest.raises(ValueError, match=r"^device 'V100 PCIe' has no memory size in fxflops' table"):
        fxflops.estimate(nn.Linear(4, 4), (torch.randn(2, 4),), memory=MemoryOptions(device="V100 PCIe"))
    with pytest.raises(ValueError, match="not in the peaks table"):
        fxflops.estimate(nn.Linear(4, 4), (torch.randn(2, 4),), memory=MemoryOptions(device="Z9"))


def test_cli_memory_section_and_fit(capsys):
    from fxflops.cli import main as cli

    assert cli.main(["lenet5", "--train", "--backward", "--optimizer", "adamw", "--memory", "--device", "H100 SXM",
                     "--no-detailed"]) == 0
    out = capsys.readouterr().out
    assert "memory peak (tensor bytes, per rank):" in out
    assert "fits on H100 SXM (80.00 GiB):" in out and "headroom" in out
    assert cli.main(["lenet5", "--memory", "--device", "V100 PCIe"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "no memory size" in error


def test_an_inputs_gradient_is_kept_like_a_parameters():
    model, x = mlp(), torch.randn(256, 64, requires_grad=True)
    memory = counted(model, (x,), "sgd")
    params = sum(p.numel() for p in model.parameters())
    step = memory.timeline[-1]  # the optimizer step: every .grad made, none freed
    assert step.phase == "optimizer step"
    assert step.by_kind[GRADIENTS] == 4 * params + 4 * x.numel()


def test_optimizer_state_per_param_group() -> None:
    # torch keeps each group's state by its own options: SGD's momentum buffer only where the group's momentum is
    # set (a weight decayed with momentum, the rest without), Adam's max_exp_avg_sq only in an amsgrad group. The
    # oracle: the state a real step left in the instance
    from fxflops.memory.optimizer_state import optimizer_memory

    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    weight, rest = [model[0].weight], [model[0].bias, model[1].weight, model[1].bias]
    makers = (lambda: torch.optim.SGD([{"params": weight}, {"params": rest, "momentum": 0.0}], lr=0.1, momentum=0.9),
              lambda: torch.optim.Adam([{"params": weight, "amsgrad": True}, {"params": rest}], lr=1e-3))
    for make in makers:
        optimizer = make()
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        held = sum(v.nbytes for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))
        found = optimizer_memory(optimizer, list(model.parameters()))
        assert found.state_bytes == held and "2 param groups" in found.how, type(optimizer).__name__
