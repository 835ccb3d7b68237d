"""FlopsMeter in a plain training loop, and its callbacks for transformers' Trainer and Lightning:
per-step FLOPs equal to estimate(backward=True) at that step's shapes, and FlopCounterMode's count of
the real step under conventions="torch"; MFU = FLOPs / step time / peak."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import fxflops
from fxflops import FlopsMeter
from fxflops.timing.families import infer_dims
from fxflops.timing.meter import FlopsMeterWarning
from tests.oracle import oracle_training_flops

VOCAB = 100
PEAK = 2e12


def tiny_gpt2() -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                           eos_token_id=0)
    return tf.GPT2LMHeadModel(config).train()


def lm_batch(batch: int, seq: int, padded: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padded:
        mask[0, seq - padded:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def expected(model: nn.Module, batch: dict) -> fxflops.Estimate:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(model, kwargs=batch, backward=True, loss=lambda output: output.loss)


@pytest.fixture(scope="module")
def gpt2():
    pytest.importorskip("transformers")
    return tiny_gpt2()


def test_plain_loop_with_gradient_accumulation_counts_each_micro_batch_from_one_capture(gpt2):
    meter = FlopsMeter(gpt2, lm_batch(2, 8), peak_flops=PEAK, optimizer="adamw")
    steps = [[(2, 8, 3), (2, 11, 0)], [(3, 5, 1), (2, 16, 4)]]  # (batch, seq, padding) per micro-batch
    for micro_batches, seconds in zip(steps, (0.25, 0.5)):
        batches = [lm_batch(*shape) for shape in micro_batches]
        for batch in batches:
            meter.micro_batch(batch)
        stats = meter.step(time=seconds)
        counts = [expected(gpt2, batch) for batch in batches]
        assert stats.flops == sum(count.total_flops for count in counts)
        assert stats.fwd_flops == sum(count.fwd_flops for count in counts)
        assert stats.bwd_flops == sum(count.bwd_flops for count in counts)
        assert stats.micro_batches == 2
        assert stats.samples == sum(b for b, _, _ in micro_batches)
        assert stats.tokens == sum(b * s for b, s, _ in micro_batches)
        assert stats.real_tokens == sum(b * s - p for b, s, p in micro_batches)
        assert stats.mfu == pytest.approx(stats.flops / seconds / PEAK, rel=1e-12)
        assert stats.tflops == pytest.approx(stats.flops / seconds / 1e12, rel=1e-12)
        trainable = sum(p.numel() for p in gpt2.parameters())
        assert stats.optimizer_flops == trainable * 14  # adamw with decay: 1 + 3 + 4 + 3 + 3 per element
        embeddings = gpt2.transformer.wte.weight.numel() + gpt2.transformer.wpe.weight.numel()
        assert stats.six_n_flops == 6 * (trainable - embeddings) * stats.tokens
        # nanoGPT's attention term: 12 x layers x heads x head dim x seq, per token
        assert stats.attention_flops == sum(12 * 2 * 2 * 16 * s * b * s for b, s, _ in micro_batches)
    assert meter.captures == 1
    total = meter.total()
    assert total.steps == 2 and total.time == 0.75
    assert total.flops == sum(s.flops for s in meter.steps)
    assert total.mfu == pytest.approx(total.flops / 0.75 / PEAK, rel=1e-12)
    assert "MFU" in meter.summary() and "6N approximation" in meter.summary()


def test_step_flops_under_torch_conventions_equal_flop_counter_mode_on_the_real_step(gpt2):
    batch = lm_batch(3, 12, padded=2)
    meter = FlopsMeter(gpt2, lm_batch(2, 8), conventions="torch")
    stats = meter.step(batch, time=1.0)
    forward, backward = oracle_training_flops(gpt2, kwargs=batch, loss=lambda output: output.loss)
    assert (stats.fwd_flops, stats.bwd_flops) == (forward, backward)


def test_step_time_is_measured_from_start_to_step():
    model = nn.Linear(8, 4)
    meter = FlopsMeter(model, torch.randn(2, 8), peak_flops=PEAK)
    meter.start()
    stats = meter.step(torch.randn(5, 8))
    assert stats.time is not None and stats.time > 0
    # 5 x 8 x 4 MACs forward (+ bias), backward: grad of the input and of the weight, and the bias's
    assert stats.fwd_flops == 2 * 5 * 8 * 4 + 5 * 4
    assert stats.mfu == pytest.approx(stats.flops / stats.time / PEAK, rel=1e-12)
    second = meter.step(torch.randn(3, 8))  # no start(): since the last step
    assert second.time is not None and second.samples == 3
    assert meter.captures == 1


def test_a_batch_of_another_structure_is_a_family_of_its_own():
    model = _Pool()
    meter = FlopsMeter(model, torch.randn(2, 3, 8, 8))
    meter.step(torch.randn(4, 3, 16, 16), time=1.0)
    assert meter.captures == 1
    with pytest.warns(FlopsMeterWarning, match="axis dims= does not name"):
        stats = meter.step(torch.randn(4, 5, 16, 16), time=1.0)  # channels changed: not a named size
    assert stats.flops == expected_plain(model, torch.randn(4, 5, 16, 16))
    assert meter.captures == 2


class _Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3)) * self.scale


def test_errors_are_one_line_warned_once_and_never_stop_training():
    forwards = []

    class Picky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            forwards.append(x.shape[0])
            if x.shape[0] > 3:
                raise RuntimeError("batches above 3 are not supported")
            return self.linear(x)

    meter = FlopsMeter(Picky(), torch.randn(2, 4), peak_flops=PEAK)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = meter.step(torch.randn(5, 4), time=0.1)
        tried = len(forwards)
        meter.step(torch.randn(5, 4), time=0.1)
        assert len(forwards) == tried  # batch 5 failed once: not captured again every step
        stats = meter.step(torch.randn(6, 4), time=0.1)
    messages = [str(w.message) for w in caught if issubclass(w.category, FlopsMeterWarning)]
    assert len(messages) == 1 and "\n" not in messages[0]  # batch 6 failed alike: no second warning
    assert "could not count a batch of shapes [(5, 4)]" in messages[0]
    assert stats.flops is None and stats.mfu is None and stats.samples is None  # left out, not 0 (issue 35.6)
    assert "samples_per_sec" not in meter.metrics(stats)
    assert meter.step(torch.randn(3, 4), time=0.1).flops is not None  # and the next batch is counted


def test_no_known_peak_is_warned_once_and_mfu_left_out():
    meter = FlopsMeter(nn.Linear(4, 4), torch.randn(2, 4))
    with pytest.warns(FlopsMeterWarning, match="no known float32 peak for cpu: MFU is not logged; pass peak_flops="):
        stats = meter.step(torch.randn(2, 4), time=0.1)
    assert stats.mfu is None and stats.flops_per_sec is not None
    assert "mfu" not in meter.metrics() and "flops" in meter.metrics()


def test_dims_are_inferred_for_common_batches():
    ids = torch.zeros(2, 7, dtype=torch.long)
    assert infer_dims((), {"input_ids": ids}) == {"batch": 0, "seq": 1}
    assert infer_dims((), {"pixel_values": torch.zeros(2, 3, 8, 8)}) == {"batch": 0, "height": 2, "width": 3}
    assert infer_dims((ids,), {}) == {"batch": 0, "seq": 1}
    assert infer_dims((torch.zeros(2, 3, 8, 8),), {}) == {"batch": 0, "height": 2, "width": 3}
    assert infer_dims((torch.zeros(2, 5),), {}) == {"batch": 0}


def test_import_fxflops_imports_neither_transformers_nor_lightning():
    code = ("import sys, fxflops; fxflops.FlopsMeter; "
            "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------ transformers


class _RecordingCollator:
    """Pads each batch to its longest sequence, and records the shape each step was fed."""

    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), longest, dtype=torch.long)
        mask = torch.zeros(len(features), longest, dtype=torch.long)
        for row, feature in enumerate(features):
            ids[row, :len(feature["input_ids"])] = torch.tensor(feature["input_ids"])
            mask[row, :len(feature["input_ids"])] = 1
        labels = ids.masked_fill(mask == 0, -100)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        self.batches.append(batch)
        return batch


def test_trainer_logs_exact_step_flops_and_mfu_from_one_capture(tmp_path):
    tf = pytest.importorskip("transformers")
    from fxflops.integrations.transformers import FlopsCallback

    model = tiny_gpt2()
    lengths = [5, 9, 7, 12, 6, 3, 4, 10, 8, 2, 11, 6]  # micro-batches of 2, 2 per step: 3 steps
    data = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    collator = _RecordingCollator()
    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                gradient_accumulation_steps=2, logging_steps=1, report_to=[], use_cpu=True,
                                save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    callback = FlopsCallback(peak_flops=PEAK, replace_total_flos=True)

    class Logger(tf.TrainerCallback):  # a reporting callback the Trainer calls before the user's
        seen: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append(dict(logs))

    trainer = tf.Trainer(model=model, args=args, train_dataset=data, data_collator=collator,
                         callbacks=[Logger(), callback])
    hooks_before = dict(model._forward_pre_hooks)
    trainer.train()
    assert dict(model._forward_pre_hooks) == hooks_before  # the callback's hook is gone
    logged = [entry for entry in trainer.state.log_history if "mfu" in entry]
    assert len(logged) == 3
    micro = collator.batches[:6]
    assert len({tuple(b["input_ids"].shape) for b in micro}) > 1  # the shapes did vary
    # the Trainer passes the step's loss denominator too: the count is of the call it makes
    counts = []
    for step in range(3):
        pair = micro[2 * step:2 * step + 2]
        items = sum((b["labels"][:, 1:] != -100).sum() for b in pair)
        counts.append(sum(expected(model, {**b, "num_items_in_batch": items}).total_flops for b in pair))
    for entry, count in zip(logged, counts):
        assert entry["flops"] == count
        assert entry["mfu"] == pytest.approx(entry["flops"] / entry["step_time"] / PEAK, rel=1e-9)
        assert entry["tflops"] == pytest.approx(entry["flops"] / entry["step_time"] / 1e12, rel=1e-9)
        assert entry["world_size"] == 1
    assert callback.meter.captures == 1
    assert [entry["flops"] for entry in Logger.seen if "flops" in entry] == counts  # the loggers got them too
    final = trainer.state.log_history[-1]
    assert final["total_flos"] == sum(counts)


# -------------------------------------------------------------------------------------------- lightning


def test_lightning_logs_exact_step_flops_and_mfu(tmp_path):
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.loggers import Logger

    from fxflops.integrations.lightning import FlopsMonitor

    class Memory(Logger):
        name, version = "memory", 0

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int, dict]] = []

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, dict(metrics)))

        def log_hyperparams(self, *args, **kwargs):
            pass

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    sizes = [4, 7, 5]
    batches = [(torch.randn(n, 6), torch.randint(0, 3, (n,))) for n in sizes]
    module = Module()
    logger = Memory()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=logger, log_every_n_steps=1,
                        callbacks=[FlopsMonitor(peak_flops=PEAK)], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    assert not module._forward_pre_hooks
    rows = [metrics for _, metrics in logger.rows if "train/device/mfu" in metrics]
    assert len(rows) == 3
    for metrics, n in zip(rows, sizes):
        # forward: 2 linears (MACs x 2 + bias) and a GELU; backward from the logits' sum
        count = expected_plain(module, torch.randn(n, 6))
        assert metrics["train/device/flops"] == count
        assert metrics["train/device/mfu"] == pytest.approx(
            metrics["train/device/flops"] / metrics["train/device/step_time"] / PEAK, rel=1e-9)
        assert metrics["train/device/samples_per_sec"] > 0


def expected_plain(model: nn.Module, x: torch.Tensor) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(model, (x,), backward=True).total_flops


def test_six_n_is_far_off_where_attention_dominates(gpt2):
    meter = FlopsMeter(gpt2, lm_batch(2, 8), peak_flops=PEAK)
    stats = meter.step(lm_batch(2, 64), time=1.0)
    assert stats.six_n_flops < stats.flops  # 6N leaves the attention out
    assert math.isclose(meter.metrics()["6n_over_counted"], stats.six_n_flops / stats.flops)


# ------------------------------------------------------------------------------------------ distributed


def test_each_rank_counts_its_own_steps_and_the_reduction_sums_them(tmp_path):
    """DDP, FSDP2's fully_shard where this torch has it, transformers' Trainer (its own DDP) with a
    FlopsCallback and Lightning's DDP strategy with a FlopsMonitor, in one torchrun job of 2 CPU
    processes (gloo)."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    import json

    from torch.distributed import fsdp

    from tests.torchrun import torchrun

    kinds = ["ddp", "fsdp"] if hasattr(fsdp, "fully_shard") else ["ddp"]
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    else:
        kinds.append("trainer")  # the Trainer's own DDP, with a FlopsCallback
    try:
        import lightning  # noqa: F401
    except ImportError:
        pass
    else:
        kinds.append("lightning")  # Lightning's own DDP strategy, with a FlopsMonitor
    done = torchrun("distributed_meter.py", ",".join(kinds), str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    if "trainer" in kinds:
        ranks = [json.loads((tmp_path / f"trainer-rank{rank}.json").read_text()) for rank in range(2)]
        for seen in ranks:
            assert seen["local"] == seen["estimates"] and seen["captures"] == 1 and seen["world"] == [2, 2]
        assert ranks[0]["logged"] == ranks[1]["logged"] == [a + b for a, b in zip(ranks[0]["local"], ranks[1]["local"])]
        kinds.remove("trainer")
    if "lightning" in kinds:
        ranks = [json.loads((tmp_path / f"lightning-rank{rank}.json").read_text()) for rank in range(2)]
        for seen in ranks:
            assert seen["local"] == seen["estimates"]
        sums = [a + b for a, b in zip(ranks[0]["local"], ranks[1]["local"])]
        assert ranks[0]["logged"] == sums and ranks[0]["device"] == ranks[0]["local"] and ranks[0]["world"] == [2, 2]
        assert ranks[1]["logged"] == []  # only rank 0's loggers write; the reduction ran on both
        kinds.remove("lightning")
    for kind in kinds:
        ranks = [json.loads((tmp_path / f"{kind}-rank{rank}.json").read_text()) for rank in range(2)]
        for seen in ranks:
            assert seen["local"] == seen["estimates"]  # each rank: its own steps, as estimate() counts them
            # fully_shard after the meter was built changes the model's classes and hooks: one capture more
            assert seen["captures"] == (2 if kind == "fsdp" else 1)
            assert seen["world"] == 2 and seen["peak"] == 2 * 1e12
        assert ranks[0]["logged"] == ranks[1]["logged"] == [ranks[0]["local"][1] + ranks[1]["local"][1]]
        assert ranks[0]["total"] == ranks[1]["total"] == sum(ranks[0]["local"]) + sum(ranks[1]["local"])
        assert ranks[0]["time"] == ranks[1]["time"] > 0  # the slowest rank's
        assert ranks[0]["mfu"] == pytest.approx(ranks[0]["total"] / ranks[0]["time"] / 2e12, rel=1e-9)


def test_the_compute_dtype_is_autocasts_or_the_weights():
    model = nn.Linear(4, 4)
    meter = FlopsMeter(model, torch.randn(2, 4), peak_flops=PEAK)
    assert meter.compute_dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        meter.micro_batch(torch.randn(2, 4))
    meter.step(time=0.1)
    assert meter.compute_dtype == torch.bfloat16
    assert FlopsMeter(nn.Linear(4, 4).to(torch.bfloat16)).compute_dtype == torch.bfloat16
    assert FlopsMeter(model, dtype=torch.float16).compute_dtype == torch.float16


def test_frozen_parameters_are_counted_as_estimate_counts_them():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model[0].requires_grad_(False)  # a frozen first layer: no weight gradient, and no input gradient below it
    meter = FlopsMeter(model, torch.randn(2, 8))
    stats = meter.step(torch.randn(5, 8), time=1.0)
    # forward: 2 matmuls + biases + relu; backward: the second layer's weight and input gradients,
    # its bias gradient (a sum over the batch), relu's gradient; nothing for the frozen first layer
    forward = 2 * 5 * 8 * 16 + 5 * 16 + 5 * 16 + 2 * 5 * 16 * 4 + 5 * 4
    assert stats.fwd_flops == forward
    assert stats.flops == expected_plain(model, torch.randn(5, 8))


def test_a_padded_sequence_sweeps_over_every_length_from_one_capture():
    # F.pad (aten.constant_pad_nd, as in transformers' causal-LM loss) once pinned a sweep to its example sizes
    from fxflops.sweeps import sweep

    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.pad(self.linear(x), (0, 0, 0, 1), value=0.0)

    swept = sweep(Shifted(), (torch.randn(2, 8, 4),), dims={"batch": 0, "seq": 1})
    assert swept.holds_for == "batch >= 1, seq >= 2"
    at = swept.at(batch=3, seq=20)
    assert at.total_flops == expected_plain_forward(Shifted(), torch.randn(3, 20, 4))
    assert len(swept.pieces) == 1


def expected_plain_forward(model: nn.Module, x: torch.Tensor) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(model, (x,)).total_flops


class CausalAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_effective_attention_is_passed_to_the_count():
    model = CausalAttention()
    meter = FlopsMeter(model, torch.randn(2, 8, 16), peak_flops=PEAK, attention="effective")
    for seq in (8, 12):
        x = torch.randn(2, seq, 16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            effective = fxflops.estimate(model, (x,), backward=True, attention="effective")
            dense = fxflops.estimate(model, (x,), backward=True)
        assert meter.step(x, time=1.0).flops == effective.total_flops < dense.total_flops
    with pytest.raises(ValueError, match="attention='sparse'"):
        FlopsMeter(model, attention="sparse")


def test_totals_over_many_steps_stay_exact_and_bounded():
    meter = FlopsMeter(nn.Linear(4, 4), torch.randn(2, 4), peak_flops=PEAK, window=10)
    per_step = meter.step(torch.randn(3, 4), time=0.5).flops
    for _ in range(1500):
        meter.step(torch.randn(3, 4), time=0.5)
    total = meter.total()
    assert total.steps == 1501 and total.flops == 1501 * per_step and total.time == pytest.approx(750.5)
    assert len(meter._totals._unread) < 1024 and len(meter.steps) == 10
    assert meter.window().steps == 10 and meter.window().flops == 10 * per_step
