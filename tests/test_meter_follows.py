"""Issue 35: the numbers a training log gets follow the model and the loop, not only the batch's shapes.

The meter and FlopsProfiler count the model as it is at each step (frozen layers, a replaced head,
checkpointing, eval submodules), a forward under no_grad is a forward only, effective attention reduces
the math backward SDPA takes under dropout, estimate()'s default loss is a model output's own `loss`,
Lightning finds the submodule a training_step calls, uncounted batches leave their rates out and say so
at every log, bad step times are refused, and the reduction sums integers exactly. Oracles:
FlopCounterMode on the real step (conventions="torch"), estimate(backward=True), or hand counts."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxflops
from fxflops import FlopsMeter
from fxflops.timing.meter import FlopsMeterWarning
from fxflops.timing.model_state import model_state
from fxflops.timing.steps import StepStats, WindowStats, summed
from tests.oracle import oracle_training_flops
from tests.torchrun import torchrun


def quiet_estimate(model: nn.Module, *args, **kwargs) -> fxflops.Estimate:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(model, *args, **kwargs)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


# ------------------------------------------------------------------------------ 1. the count follows the model


def test_freezing_a_layer_and_replacing_the_head_change_the_count_as_flop_counter_mode_counts_them():
    model = mlp()
    x = torch.randn(5, 8)
    meter = FlopsMeter(model, torch.randn(2, 8), conventions="torch", peak_flops=1e12)
    assert (meter.step(x, time=1.0).fwd_flops, meter.steps[-1].bwd_flops) == oracle_training_flops(model, (x,))
    model[0].requires_grad_(False)  # layer 0 frozen: no weight gradient there (and none below it)
    frozen = meter.step(x, time=1.0)
    # by hand: forward 2.5.8.16 + 2.5.16.4; backward: layer 2's weight gradient alone (nothing below it
    # needs a gradient now: no input gradient for layer 2, no ReLU gradient)
    assert (frozen.fwd_flops, frozen.bwd_flops) == (2 * 5 * 8 * 16 + 2 * 5 * 16 * 4, 2 * 5 * 16 * 4)
    assert (frozen.fwd_flops, frozen.bwd_flops) == oracle_training_flops(model, (x,))
    model[2] = nn.Linear(16, 100)  # a new head
    head = meter.step(x, time=1.0)
    assert (head.fwd_flops, head.bwd_flops) == oracle_training_flops(model, (x,))
    assert head.bwd_flops == 2 * 5 * 16 * 100
    assert meter.captures == 3
    model[0].requires_grad_(True)
    assert meter.step(x, time=1.0).flops == sum(oracle_training_flops(model, (x,)))
    assert meter.captures == 4
    model[0].requires_grad_(False)  # back to a state seen before: its family is still there, no capture
    assert meter.step(x, time=1.0).flops == head.flops
    assert meter.captures == 4


def test_a_submodule_switched_to_eval_changes_the_count_as_estimate_counts_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.1), nn.Linear(16, 4)).train()
    x = torch.randn(6, 8)
    meter = FlopsMeter(model, torch.randn(2, 8), peak_flops=1e12)
    trained = meter.step(x, time=1.0).flops
    assert trained == quiet_estimate(model, (x,), backward=True).total_flops
    model[1].eval()  # batch norm on running statistics: 2 FLOPs an element forward instead of 5
    model[2].eval()  # dropout off: no mask multiply, forward or backward
    evaluated = meter.step(x, time=1.0).flops
    assert evaluated == quiet_estimate(model, (x,), backward=True).total_flops
    assert evaluated < trained


def tiny_llama(layers: int = 4):
    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).train()


def lm_batch(batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (batch, seq))
    return {"input_ids": ids, "labels": ids}


def test_a_llama_with_three_of_four_layers_frozen_then_checkpointed_counts_as_flop_counter_mode():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # as the oracle runs SDPA
        _llama_frozen_then_checkpointed()


def _llama_frozen_then_checkpointed():
    model = tiny_llama()
    loss = lambda output: output.loss  # noqa: E731
    meter = FlopsMeter(model, lm_batch(2, 8), conventions="torch", peak_flops=1e12)
    batch = lm_batch(2, 12)
    whole = meter.step(batch, time=1.0)
    assert (whole.fwd_flops, whole.bwd_flops) == oracle_training_flops(model, kwargs=batch, loss=loss)
    for layer in model.model.layers[:3]:
        layer.requires_grad_(False)
    model.model.embed_tokens.requires_grad_(False)
    frozen = meter.step(batch, time=1.0)
    assert (frozen.fwd_flops, frozen.bwd_flops) == oracle_training_flops(model, kwargs=batch, loss=loss)
    assert frozen.bwd_flops < whole.bwd_flops
    for layer in model.model.layers[:3]:
        layer.requires_grad_(True)
    model.model.embed_tokens.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation notes
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = meter.step(batch, time=1.0)
    # the recomputed forward is backward work: more than the plain step, exactly what FlopCounterMode sees
    assert (checkpointed.fwd_flops, checkpointed.bwd_flops) == oracle_training_flops(model, kwargs=batch, loss=loss)
    assert checkpointed.bwd_flops > whole.bwd_flops
    assert meter.captures == 3


def test_model_state_changes_with_what_changes_a_count_and_not_with_weights():
    model = mlp()
    state = model_state(model)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # an optimizer step: the same model
    assert model_state(model) == state
    changes = [lambda m: m[0].requires_grad_(False), lambda m: m[1].eval(), lambda m: m.to(torch.float64),
               lambda m: setattr(m[0], "gradient_checkpointing", True),
               lambda m: m.__setitem__(2, nn.Linear(16, 4))]
    for change in changes:
        model = mlp()
        state = model_state(model)
        change(model)
        assert model_state(model) != state, change
    model = mlp()
    state = model_state(model)
    model[0]._cache = torch.zeros(3)  # a private tensor cache (rotary tables...): not a new model
    model[0].cos_cached = torch.zeros(3)
    assert model_state(model) == state


def test_the_profiler_counts_a_layer_frozen_inside_its_window_as_it_now_is():
    from fxflops.integrations.deepspeed_profiler import FlopsProfiler

    model = mlp()
    x = torch.randn(4, 8)
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    model(x).sum().backward()
    model[0].requires_grad_(False)
    model(x).sum().backward()
    profiler.stop_profile()
    with pytest.warns(UserWarning, match=r"model changed inside the profiling window .* covers the 1 of 2 forwards"):
        profile = profiler.profile
    # by hand: layer 2's weight gradient and its bias gradient (a sum); nothing below it needs a gradient
    assert profile.bwd_flops == 2 * 4 * 16 * 4 + 4 * 4
    assert profile.bwd_flops == quiet_estimate(model, (x,), backward=True).bwd_flops
    profiler.end_profile()
    assert not model._forward_pre_hooks and not model._forward_hooks


# ------------------------------------------------------------------------------------ 2. forwards under no_grad


def test_a_forward_under_no_grad_is_counted_as_a_forward_only():
    model = mlp()
    x = torch.randn(5, 8)
    meter = FlopsMeter(model, x, peak_flops=1e12)
    full = quiet_estimate(model, (x,), backward=True)
    meter.micro_batch(x)
    meter.micro_batch(x, backward=False)  # a reference pass: its forward, no sample trained
    stats = meter.step(time=1.0)
    assert (stats.fwd_flops, stats.bwd_flops) == (2 * full.fwd_flops, full.bwd_flops)
    assert stats.samples == 5


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


def _lightning_module(children: dict[str, nn.Module], step, forward=None):
    """A LightningModule holding `children`, whose training_step is `step(self, batch)` (and forward `forward`)."""
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            for name, child in children.items():
                self.add_module(name, child)

        def training_step(self, batch, batch_idx):
            return step(self, batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    if forward is not None:
        Module.forward = forward
    return Module()


def _lightning_fit(module, batches, **monitor_options):
    L = pytest.importorskip("lightning")
    from fxflops.integrations.lightning import FlopsMonitor
    from tests.distributed_meter import memory_logger

    logger, monitor = memory_logger(), FlopsMonitor(peak_flops=1e12, **monitor_options)
    trainer = L.Trainer(max_steps=len(batches), accelerator="cpu", logger=logger, log_every_n_steps=1,
                        callbacks=[monitor], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return [row for row in logger.rows if "train/device/step_time" in row], monitor


def test_lightning_counts_a_teacher_pass_under_no_grad_as_a_forward():
    def step(self, batch):
        with torch.no_grad():
            reference = self(batch)  # a reference pass of the same module, in training mode
        return (self(batch) - reference).pow(2).sum()

    batches = [torch.randn(n, 6) for n in (4, 7)]
    module = _lightning_module({"student": _Net()}, step, forward=lambda self, x: self.student(x))
    rows, _ = _lightning_fit(module, batches)
    for row, x in zip(rows, batches):
        full = quiet_estimate(module, (x,), backward=True)
        assert row["train/device/flops"] == full.total_flops + full.fwd_flops
        assert row["train/device/samples_per_sec"] == pytest.approx(len(x) / row["train/device/step_time"])


def test_a_trainer_subclass_with_a_no_grad_pass_counts_it_as_a_forward(tmp_path):
    tf = pytest.importorskip("transformers")
    from fxflops.integrations.transformers import FlopsCallback

    class WithReference(tf.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            with torch.no_grad():
                model(**inputs)  # a reference forward inside the step
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    config = tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0,
                           eos_token_id=0)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(config)
    fed: list[dict] = []

    def collate(features):
        ids = torch.tensor([f["input_ids"] for f in features])
        fed.append({"input_ids": ids, "labels": ids.clone()})
        return fed[-1]

    data = [{"input_ids": list(range(1, 7))} for _ in range(4)]
    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, logging_steps=1,
                                report_to=[], use_cpu=True, save_strategy="no", dataloader_num_workers=0,
                                disable_tqdm=True)
    trainer = WithReference(model=model, args=args, train_dataset=data, data_collator=collate,
                            callbacks=[FlopsCallback(peak_flops=1e12)])
    trainer.train()
    logged = [entry["flops"] for entry in trainer.state.log_history if "mfu" in entry]
    expected = []
    for batch in fed[:2]:
        inputs = {**batch, "num_items_in_batch": torch.tensor(10)}
        full = quiet_estimate(model, kwargs=inputs, backward=True, loss=lambda output: output.loss)
        plain = quiet_estimate(model, kwargs=batch, backward=True, loss=lambda output: output.loss)
        expected.append(full.total_flops + plain.fwd_flops)
    assert logged == expected


# ------------------------------------------------------------------ 3. effective attention under dropout


class _Causal(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p)


def test_effective_attention_reduces_the_math_backward_sdpa_takes_under_dropout():
    B, H, L, E = 1, 2, 16, 8
    qkv = [torch.randn(B, H, L, E, requires_grad=True) for _ in range(3)]
    dense = quiet_estimate(_Causal(0.1).train(), tuple(qkv), backward=True, conventions="torch")
    effective = quiet_estimate(_Causal(0.1).train(), tuple(qkv), backward=True, conventions="torch",
                               attention="effective")
    # dense: the math backward's four products, each B.H.L.L.E MACs (FlopCounterMode's count of the real step)
    assert dense.bwd_flops == 4 * 2 * B * H * L * L * E
    assert (dense.fwd_flops, dense.bwd_flops) == oracle_training_flops(_Causal(0.1).train(), tuple(qkv))
    kept = B * H * L * (L + 1) // 2
    masked = B * H * L * L - kept
    assert effective.fwd_flops == dense.fwd_flops - masked * 2 * (E + E)
    # each masked pair: grad of probs (E), of v (E), of q (E), of k (E) MACs, 2 FLOPs each: 4 x 2E = 64
    assert effective.bwd_flops == dense.bwd_flops - masked * 4 * 2 * E
    # the deepspeed preset also counts the elementwise gradients over the L x L scores: those stay dense
    deepspeed = quiet_estimate(_Causal(0.1).train(), tuple(qkv), backward=True, attention="effective")
    deepspeed_dense = quiet_estimate(_Causal(0.1).train(), tuple(qkv), backward=True)
    assert deepspeed_dense.bwd_flops - deepspeed.bwd_flops == masked * 4 * 2 * E


class _PaddedAttention(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(16, 48)
        self.p = p

    def forward(self, x, attention_mask):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 8).permute(2, 0, 3, 1, 4)
        keep = attention_mask[:, None, None, :].bool()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=self.p)


def test_the_meter_reduces_the_math_backward_under_a_data_mask_and_dropout():
    model = _PaddedAttention(0.1).train()
    batch = (torch.randn(2, 8, 16), torch.tensor([[1] * 8, [1] * 5 + [0] * 3]))
    options = dict(dims={"batch": 0, "seq": 1}, peak_flops=1e12, conventions="torch")
    dense = FlopsMeter(model, batch, **options).step(batch, time=1.0)
    assert (dense.fwd_flops, dense.bwd_flops) == oracle_training_flops(model, batch)
    stats = FlopsMeter(model, batch, attention="effective", **options).step(batch, time=1.0)
    # 3 padded keys x 8 queries x 2 heads = 48 pairs dropped: 2(E + Ev) = 32 FLOPs forward, 4 x 2E = 64 backward
    assert (stats.fwd_flops, stats.bwd_flops) == (dense.fwd_flops - 48 * 32, dense.bwd_flops - 48 * 64)
    assert stats.dense_flops == dense.flops


# ------------------------------------------------------------------ 4. a model output's loss is the loss


def test_estimates_default_loss_is_the_outputs_own_loss_as_the_meter_counts_it():
    tf = pytest.importorskip("transformers")
    config = tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0,
                           eos_token_id=0)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(config).train()
    batch = lm_batch(2, 8)
    default = quiet_estimate(model, kwargs=batch, backward=True)
    own = quiet_estimate(model, kwargs=batch, backward=True, loss=lambda output: output.loss)
    both = quiet_estimate(model, kwargs=batch, backward=True, loss=lambda output: output.loss + output.logits.sum())
    assert default.total_flops == own.total_flops != both.total_flops
    meter = FlopsMeter(model, batch, peak_flops=1e12)
    assert meter.step(batch, time=1.0).flops == default.total_flops
    assert (own.fwd_flops, own.bwd_flops) == (default.fwd_flops, default.bwd_flops)


# ------------------------------------------------------------ 5. Lightning: training_step calls self.model


def test_lightning_counts_the_submodule_a_training_step_calls():
    # a wrapped model, as with a Hugging Face one, called with keywords
    module = _lightning_module({"model": _Net()}, lambda self, batch: self.model(x=batch).sum())
    batches = [torch.randn(n, 6) for n in (4, 7, 5)]
    with pytest.warns(FlopsMeterWarning, match=r"training_step calls self.model\(...\), not self\(...\)"):
        rows, _ = _lightning_fit(module, batches)
    assert [row["train/device/flops"] for row in rows] == [
        quiet_estimate(module.model, (x,), backward=True).total_flops for x in batches]
    assert not module._forward_pre_hooks and not module.model._forward_pre_hooks


def test_lightning_says_what_to_pass_when_several_submodules_ran():
    module = _lightning_module({"encoder": nn.Linear(6, 8), "head": nn.Linear(8, 2)},
                               lambda self, batch: self.head(self.encoder(batch)).sum())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows, _ = _lightning_fit(module, [torch.randn(4, 6), torch.randn(4, 6)])
    said = [str(w.message) for w in caught if issubclass(w.category, FlopsMeterWarning)]
    assert any("its submodules encoder, head ran" in m and "pass FlopsMonitor(module=" in m for m in said)
    assert all("train/device/flops" not in row for row in rows)
    assert sum("were not counted" in m for m in said) == len(rows)  # said at every log, not once


# --------------------------------------------------------------- 6. uncounted batches: rates left out, said


class _Uncapturable(nn.Module):
    """Runs on real tensors; refuses the fake ones a capture runs it on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)

    def forward(self, x):
        if type(x) is not torch.Tensor and not isinstance(x, nn.Parameter):
            raise RuntimeError("this forward runs on real tensors only")
        return self.linear(x)


def test_a_callback_whose_capture_failed_leaves_samples_out_and_says_so_at_every_log():
    module = _lightning_module({"net": _Uncapturable()}, lambda self, batch: self(batch).sum(),
                               forward=lambda self, x: self.net(x))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows, _ = _lightning_fit(module, [torch.randn(4, 6) for _ in range(3)])
    assert len(rows) == 3
    for row in rows:
        assert "train/device/samples_per_sec" not in row and "train/device/flops" not in row  # not 0
        assert row["train/device/step_time"] > 0
    logged = [str(w.message) for w in caught if "were not counted" in str(w.message)]
    assert len(logged) == 3 and "(step 1)" in logged[0] and "(step 3)" in logged[2]
    assert all("real tensors only" in message for message in logged)  # why, each time


# ------------------------------------------------------------------------------------ 7. bad step times


@pytest.mark.parametrize("seconds", [math.nan, -0.5, math.inf, "fast"])
def test_a_bad_step_time_is_refused_with_a_clear_message(seconds):
    meter = FlopsMeter(nn.Linear(4, 4), torch.randn(2, 4), peak_flops=1e12)
    with pytest.raises(ValueError, match="step time"):
        meter.step(torch.randn(2, 4), time=seconds)
    assert meter.step(torch.randn(2, 4), time=0.5).flops_per_sec > 0  # the meter goes on


@pytest.mark.parametrize("seconds", ["nan", "inf"])
def test_the_cli_refuses_a_step_time_that_is_not_a_finite_number(capsys, seconds):
    from fxflops.cli.main import main

    assert main(["lenet5", "--step-time", seconds]) == 2
    assert f"--step-time is a step's seconds, a finite number; got {seconds}" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ 20. windows read well


def test_a_windows_repr_shows_its_rates():
    window = WindowStats(steps=2, flops=4_000_000, samples=8, tokens=None, time=2.0, six_n_flops=None,
                         peak_flops=1e7, world_size=2)
    text = repr(window)
    assert "flops_per_sec=2000000.0" in text and "mfu=0.2" in text and "samples_per_sec=4.0" in text
    assert "tokens" not in text  # not known: left out
    step = StepStats(step=1, micro_batches=1, fwd_flops=3, bwd_flops=6, samples=2, tokens=None, six_n_flops=None,
                     attention_flops=None, optimizer_flops=None, peak_flops=None, _time=0.5)
    assert "time=0.5" in repr(step) and "flops_per_sec=18.0" in repr(step)
    assert summed([step]).flops == 9


# ------------------------------------------------------------------- 7, 8, 20 on two ranks (gloo, 127.0.0.1)


def test_two_ranks_sum_counts_exactly_refuse_a_nan_time_and_summarize_the_job(tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    import json

    done = torchrun("distributed_meter.py", "exact", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = [json.loads((tmp_path / f"exact-rank{rank}.json").read_text()) for rank in range(2)]
    for seen in ranks:
        assert seen["sums"] == [2 * (2 ** 53 + 1)] * 5  # exact: float64 would say 2^54
        assert seen["time"] == 2.0  # the slowest rank's
        assert seen["bad_time"] is None  # rank 1's NaN is not dropped in favour of rank 0's 2.0
        assert any("not finite seconds" in message for message in seen["warned"])
        assert "(all 2 ranks, sum over ranks)" in seen["job_summary"]
        assert "mfu=" in seen["repr"] and "flops_per_sec=" in seen["repr"]
    assert ranks[0]["refused"] == "" and "a step time must be finite seconds, 0 or more; got nan" in ranks[1]["refused"]
    assert "(rank 0 of 2: summary(job=True) for the job)" in ranks[0]["local_summary"]
    assert "(rank 1 of 2: summary(job=True) for the job)" in ranks[1]["local_summary"]
    per_step = [ranks[rank]["local_total"] for rank in range(2)]
    assert per_step[0] != per_step[1]  # each rank its own batches


def test_the_manuals_torchrun_example_prints_what_the_manual_shows(tmp_path):
    """docs/guide/training.md's worked torchrun job, run as the page shows it (2 CPU processes, gloo)."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    from tests.docs_examples import console_commands, examples, output_matches

    shown = [e for e in examples(ROOT / "docs" / "guide" / "training.md") if e.skip and "torchrun_meter" in e.skip]
    script, console = shown
    (tmp_path / "train_ddp.py").write_text(script.body)
    [(command, expected)] = console_commands(console.body)
    assert command == "torchrun --nproc_per_node 2 train_ddp.py"
    done = torchrun("train_ddp.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert output_matches(expected, done.stdout), done.stdout
    # the page's figures by hand: 8,834 FLOPs a sample per step (forward 4,353, backward 4,481), 16 + 8 samples
    assert 24 * 8834 == 212016 and 8 * 8834 == quiet_estimate(mlp_32(), input_shape=(8, 32), backward=True).total_flops


def mlp_32() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))


def test_a_state_that_changes_every_step_is_said_once():
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.calls = 0  # a public counter: a setting, as far as the meter can tell

        def forward(self, x):
            self.calls += 1
            return self.linear(x)

    model = Counting()
    meter = FlopsMeter(model, torch.randn(2, 4), peak_flops=1e12)
    expected = quiet_estimate(nn.Linear(4, 4), (torch.randn(3, 4),), backward=True).total_flops
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(20):
            model(torch.randn(3, 4))
            assert meter.step(torch.randn(3, 4), time=0.1).flops == expected
    said = [str(w.message) for w in caught if "states" in str(w.message)]
    assert len(said) == 1 and "a module or one of its settings changed" in said[0]


ROOT = Path(__file__).resolve().parent.parent


def test_the_timing_package_has_no_import_cycle():
    """DESIGN.md's meter <-> families cycle is gone: no module of fxflops/timing imports one that imports it
    back (TYPE_CHECKING imports included)."""
    import ast

    folder = ROOT / "fxflops" / "timing"
    imports: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        imports[path.stem] = {node.module.rsplit(".", 1)[-1] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                              and node.module and node.module.startswith("fxflops.timing.")}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(name == goal or (name not in seen and reaches(name, goal, seen | {name}))
                   for name in imports.get(start, ()))

    assert [name for name in imports if reaches(name, name, {name})] == []
