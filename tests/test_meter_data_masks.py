"""FlopsMeter(attention="effective") with masks that arrive as data (padding, packed documents): the
kept pairs come from each real batch's mask, replayed from the graph that derived it. Every count is
by hand: dense attention is B.H.Lq.Lk pairs; a head keeping P pairs costs P.(E + Ev) MACs forward and
P.(3E + 2Ev) backward (the fused kernels'), 2 FLOPs a MAC; the dense count is FlopCounterMode's."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxflops import FlopsMeter
from fxflops.rules.kept_pairs import mask_kept_pairs
from fxflops.timing.data_masks import kept_count
from fxflops.timing.meter import FlopsMeterWarning
from fxflops.timing.steps import unread
from tests.oracle import oracle_training_flops

B, L, H, E = 2, 8, 2, 8  # batch, sequence, heads, head dim (Ev = E)
FWD_PER_PAIR, BWD_PER_PAIR = 2 * (E + E), 2 * (3 * E + 2 * E)


class Attention(nn.Module):
    """A projection to q, k, v and SDPA under the mask `build(x, mask)` makes of the given one."""

    def __init__(self, build) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(16, 3 * H * E)
        self.build = build

    def forward(self, x, mask):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, H, E).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.build(x, mask))


def padding(x, attention_mask):
    """transformers' way: a (B, L) 0/1 mask turned into (B, 1, L, L), keys past a row's length dropped."""
    return attention_mask[:, None, None, :].bool().expand(-1, 1, x.shape[1], -1)


def causal_padding(x, attention_mask):
    i = torch.arange(x.shape[1], device=x.device)
    return padding(x, attention_mask) & (i[:, None] >= i[None, :])


def given(x, mask):
    return mask  # a 4-D mask passed in as it is


def padded(lengths, seq=L):
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return mask


def documents(lengths, causal=False):
    """A packed row's block-diagonal mask, (1, 1, L, L): each token sees its own document (causally)."""
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask = mask & torch.ones(len(doc), len(doc), dtype=torch.bool).tril()
    return mask[None, None]


def oracle(model, batch, all_pairs, layers=1, **options):
    """FlopCounterMode's (fwd, bwd) of the real step. On the CPU it sees SDPA only as the MATH backend's
    bmms, whose backward does not recompute the scores (Q K^T, all_pairs x E MACs) that the fused
    backward kernels do and that its own fused formula (sdpa_backward_flop_count, 3E + 2Ev) counts."""
    fwd, bwd = oracle_training_flops(model, batch if isinstance(batch, tuple) else (), None if isinstance(
        batch, tuple) else batch, **options)
    return fwd, bwd + layers * all_pairs * 2 * E


def steps(model, batch, **options):
    """(dense step, effective step) of the meter, both captured from `batch`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = FlopsMeter(model, batch, conventions="torch", peak_flops=1e12, **options).step(batch, time=1.0)
        effective = FlopsMeter(model, batch, conventions="torch", attention="effective", peak_flops=1e12, **options)
    return dense, effective


def expected(dense, kept_pairs, all_pairs, layers=1):
    """(fwd, bwd) of the dense step with `layers` attention ops counted at `kept_pairs` instead of `all_pairs`."""
    return (dense.fwd_flops - layers * (all_pairs - kept_pairs) * FWD_PER_PAIR,
            dense.bwd_flops - layers * (all_pairs - kept_pairs) * BWD_PER_PAIR)


@pytest.mark.parametrize("build, per_head", [
    (padding, 8 * 8 + 8 * 5),  # row 0 keeps every key, row 1 its first 5 for each of its 8 queries
    (causal_padding, 36 + (1 + 2 + 3 + 4 + 5 + 5 + 5 + 5)),
])
def test_a_padding_mask_counts_the_pairs_the_real_batch_keeps(build, per_head):
    model = Attention(build)
    batch = (torch.randn(B, L, 16), padded([8, 5]))
    dense, meter = steps(model, batch, dims={"batch": 0, "seq": 1})
    assert (dense.fwd_flops, dense.bwd_flops) == oracle(model, batch, B * H * L * L)  # dense: FlopCounterMode's
    stats = meter.step(batch, time=1.0)
    assert (stats.fwd_flops, stats.bwd_flops) == expected(dense, H * per_head, B * H * L * L)
    assert stats.dense_flops == dense.flops
    # another batch of the family: its own mask, no new capture
    other = (torch.randn(3, 6, 16), padded([2, 6, 4], seq=6))
    again = meter.step(other, time=1.0)
    dense_other = FlopsMeter(model, other, conventions="torch", dims={"batch": 0, "seq": 1}, peak_flops=1e12).step(other, time=1.0)
    per_head = 2 * 6 + 6 * 6 + 4 * 6 if build is padding else (1 + 2 * 5) + 21 + (1 + 2 + 3 + 4 * 3)
    assert (again.fwd_flops, again.bwd_flops) == expected(dense_other, H * per_head, 3 * H * 6 * 6)
    assert meter.captures == 1


@pytest.mark.parametrize("causal, per_head", [(False, 9 + 9 + 4), (True, 6 + 6 + 3)])
def test_packed_documents_given_as_a_block_diagonal_mask(causal, per_head):
    model = Attention(given)
    batch = (torch.randn(1, L, 16), documents([3, 3, 2], causal))
    dense, meter = steps(model, batch, dims={"batch": 0})
    assert (dense.fwd_flops, dense.bwd_flops) == oracle(model, batch, H * L * L)
    stats = meter.step(batch, time=1.0)
    assert (stats.fwd_flops, stats.bwd_flops) == expected(dense, H * per_head, H * L * L)
    two = (torch.randn(1, L, 16), documents([4, 4], causal))  # other documents, the same shapes
    per_head = 2 * (10 if causal else 16)
    assert (meter.step(two, time=1.0).fwd_flops, meter.steps[-1].bwd_flops) == expected(dense, H * per_head, H * L * L)


def tiny_llama(attention="sdpa"):
    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = attention
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).train()


LLAMA_HEADS, LLAMA_HEAD_DIM, LLAMA_LAYERS = 4, 8, 2


def llama_saving(lengths, seq):
    """(fwd, bwd) FLOPs the tiny Llama's effective attention saves on a padded batch, by hand: per layer
    and head, causal with keys past the row's length dropped (queries there still see the row)."""
    kept = LLAMA_HEADS * sum(min(i + 1, n) for n in lengths for i in range(seq))
    dropped = len(lengths) * LLAMA_HEADS * seq * seq - kept
    return (LLAMA_LAYERS * dropped * 2 * (2 * LLAMA_HEAD_DIM), LLAMA_LAYERS * dropped * 2 * (5 * LLAMA_HEAD_DIM))


def test_a_tiny_llama_with_a_padded_attention_mask_by_hand():
    model = tiny_llama()
    dense_meter = effective_meter = None
    for lengths, seq in (([8, 5], 8), ([12, 7, 3], 12)):  # one family: one capture per meter
        ids = torch.randint(0, 64, (len(lengths), seq))
        batch = {"input_ids": ids, "attention_mask": padded(lengths, seq), "labels": ids}
        if dense_meter is None:
            dense_meter = FlopsMeter(model, batch, conventions="torch", peak_flops=1e12)
            effective_meter = FlopsMeter(model, batch, conventions="torch", attention="effective", peak_flops=1e12)
        dense, stats = dense_meter.step(batch, time=1.0), effective_meter.step(batch, time=1.0)
        dense_pairs = len(lengths) * LLAMA_HEADS * seq * seq
        assert (dense.fwd_flops, dense.bwd_flops) == oracle(model, batch, dense_pairs, LLAMA_LAYERS,
                                                            loss=lambda out: out.loss)
        saved = llama_saving(lengths, seq)
        assert (stats.fwd_flops, stats.bwd_flops) == (dense.fwd_flops - saved[0], dense.bwd_flops - saved[1])
        assert stats.dense_flops == dense.flops
        metrics = effective_meter.metrics()
        assert (metrics["flops"], metrics["dense_flops"]) == (stats.flops, dense.flops)
        assert metrics["mfu"] == pytest.approx(stats.flops / 1e12) and metrics["dense_mfu"] == pytest.approx(dense.flops / 1e12)
    assert effective_meter.captures == dense_meter.captures == 1


def test_the_trainer_callback_logs_effective_flops_from_each_batch_mask(tmp_path):
    tf = pytest.importorskip("transformers")
    from fxflops import estimate
    from fxflops.integrations.transformers import FlopsCallback

    model = tiny_llama()
    lengths = [5, 9, 7, 3]  # micro-batches of 2, one per step: 2 steps, each padded to its longest
    data = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    fed = []

    def collate(features):
        longest = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), longest, dtype=torch.long)
        for row, feature in enumerate(features):
            ids[row, :len(feature["input_ids"])] = torch.tensor(feature["input_ids"])
        batch = {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": ids.masked_fill(ids == 0, -100)}
        fed.append(batch)
        return batch

    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, logging_steps=1,
                                report_to=[], use_cpu=True, save_strategy="no", dataloader_num_workers=0,
                                disable_tqdm=True)
    callback = FlopsCallback(peak_flops=1e12, attention="effective")
    trainer = tf.Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[callback])
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "mfu" in entry]
    assert len(logged) == 2 and callback.meter.captures == 1
    for entry, batch in zip(logged, fed):
        items = (batch["labels"][:, 1:] != -100).sum()  # the Trainer passes the step's loss denominator
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dense = estimate(model, kwargs={**batch, "num_items_in_batch": items}, backward=True,
                             loss=lambda output: output.loss)
        lengths = batch["attention_mask"].sum(1).tolist()
        saved = llama_saving(lengths, batch["input_ids"].shape[1])
        assert entry["flops"] == dense.total_flops - sum(saved) and entry["dense_flops"] == dense.total_flops
        assert entry["mfu"] == pytest.approx(entry["flops"] / entry["step_time"] / 1e12, rel=1e-9)
        assert entry["dense_mfu"] == pytest.approx(entry["dense_flops"] / entry["step_time"] / 1e12, rel=1e-9)


def test_the_lightning_monitor_logs_effective_and_dense_flops_from_each_batch_mask():
    lightning = pytest.importorskip("lightning")
    from fxflops.integrations.lightning import FlopsMonitor
    from tests.distributed_meter import memory_logger

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention(padding)

        def forward(self, x, mask):
            return self.attn(x, mask)

        def training_step(self, batch, batch_idx):
            return self(*batch).sum()  # the forward's output summed: what the meter's backward starts from

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)  # the weights stay: the oracle runs them after

    batches = [(torch.randn(2, L, 16), padded([8, 5])), (torch.randn(3, 6, 16), padded([2, 6, 4], seq=6))]
    dropped = [H * 8 * 3, H * (6 * 4 + 6 * 2)]  # pairs of the padded keys, every query of the row
    module, logger = Module(), memory_logger()
    monitor = FlopsMonitor(peak_flops=1e12, attention="effective", conventions="torch", dims={"batch": 0, "seq": 1})
    trainer = lightning.Trainer(max_steps=2, accelerator="cpu", logger=logger, log_every_n_steps=1, callbacks=[monitor],
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own advice on workers and logging
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    rows = [row for row in logger.rows if "train/device/flops" in row]
    assert len(rows) == 2 and monitor.meter.captures == 1
    for row, batch, drop in zip(rows, batches, dropped):
        fwd, bwd = oracle(module, batch, batch[0].shape[0] * H * batch[0].shape[1] ** 2)
        assert row["train/device/dense_flops"] == row["train/dense_flops"] == fwd + bwd
        assert row["train/device/flops"] == row["train/flops"] == fwd + bwd - drop * (FWD_PER_PAIR + BWD_PER_PAIR)
        seconds = row["train/device/step_time"]
        assert row["train/device/mfu"] == pytest.approx(row["train/device/flops"] / seconds / 1e12, rel=1e-9)
        assert row["train/device/dense_mfu"] == pytest.approx(row["train/device/dense_flops"] / seconds / 1e12,
                                                              rel=1e-9)
        assert "train/device/world_size" not in row and row["train/world_size"] == 1


class BufferMask(nn.Module):
    """A mask derived from the input and a buffer: not replayed from the inputs alone."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention(lambda x, mask: (mask[:, None, None, :] * self.keep[: x.shape[1]]).bool())
        self.register_buffer("keep", torch.ones(64, dtype=torch.long))

    def forward(self, x, mask):
        return self.attn(x, mask)


def test_a_mask_that_cannot_be_replayed_counts_dense_and_says_so_once():
    model = BufferMask()
    batch = (torch.randn(B, L, 16), padded([8, 5]))
    meter = FlopsMeter(model, conventions="torch", attention="effective", dims={"batch": 0, "seq": 1}, peak_flops=1e12)
    with pytest.warns(FlopsMeterWarning, match=r"attention mask of attn: .*parameter, buffer or constant.*counts dense"):
        stats = meter.step(batch, time=1.0)
    assert (stats.fwd_flops, stats.bwd_flops) == oracle(model, batch, B * H * L * L)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        meter.step(batch, time=1.0)  # said once


def random_padding(x, attention_mask):
    """A padding mask and'ed with a random one that keeps everything: a random op on the way."""
    return padding(x, attention_mask) & (torch.rand(x.shape[1], x.shape[1], device=x.device) >= 0)


def written_padding(x, attention_mask):
    """A padding mask written in place after it is built: its value depends on when it is read."""
    mask = padding(x, attention_mask).clone()
    mask[..., 0] = True
    return mask


def uninitialized_padding(x, attention_mask):
    """A padding mask and'ed with uninitialized memory: values no one knows (the capture's input values refuse
    them too: capture.input_values owns which ops' values are computed)."""
    return padding(x, attention_mask) & torch.empty(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device)


@pytest.mark.parametrize("build, reason", [(random_padding, r"random or in place"),
                                           (written_padding, r"in.place"),
                                           (uninitialized_padding, r"aten.empty.memory_format \(uninitialized memory\)")])
def test_a_mask_built_with_a_random_op_or_written_in_place_counts_dense_and_says_so(build, reason):
    model = Attention(build)
    batch = (torch.randn(B, L, 16), padded([8, 5]))
    meter = FlopsMeter(model, conventions="torch", attention="effective", dims={"batch": 0, "seq": 1}, peak_flops=1e12)
    with pytest.warns(FlopsMeterWarning, match=rf"attention mask of the model: .*{reason}.*counts dense"):
        stats = meter.step(batch, time=1.0)
    assert (stats.fwd_flops, stats.bwd_flops) == oracle(model, batch, B * H * L * L)


def test_counts_stay_on_the_device_until_read_and_agree_with_mask_kept_pairs():
    model = Attention(padding)
    batch = (torch.randn(B, L, 16), padded([8, 5]))
    meter = FlopsMeter(model, batch, attention="effective", dims={"batch": 0, "seq": 1}, peak_flops=1e12)
    stats = meter.step(batch, time=1.0)
    assert isinstance(unread(stats, "fwd_flops"), torch.Tensor)  # summed where the mask is, not read yet
    assert isinstance(stats.fwd_flops, int) and isinstance(unread(stats, "fwd_flops"), int)  # read once, kept
    mask = documents([3, 3, 2])[0, 0]
    for form in (mask, mask.long(), torch.zeros(L, L).masked_fill(~mask, float("-inf"))):
        assert int(kept_count(form)) == mask_kept_pairs(form) == 22
    assert meter.total().dense_flops == stats.dense_flops > stats.flops
    assert "dense attention (every pair)" in meter.summary()


class EagerMasked(nn.Module):
    """Attention written as plain ops under a padding mask passed in (masked_fill with -inf)."""

    def __init__(self, additive: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(16, 3 * H * E)
        self.additive = additive

    def forward(self, x, mask):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, H, E).permute(2, 0, 3, 1, 4)
        if self.additive:  # transformers 5.17's eager mask: where(keep, torch.tensor(0.0), min), added
            keep = mask[:, None, None, :].bool()
            scores = q @ k.transpose(-1, -2) + torch.where(keep, torch.tensor(0.0), torch.finfo(q.dtype).min)
        else:
            scores = (q @ k.transpose(-1, -2)).masked_fill(~mask[:, None, None, :].bool(), float("-inf"))
        return scores.softmax(-1) @ v


# attention written as plain ops: 2 products forward (q k^T, probs v), 4 backward (their gradients:
# nothing recomputed), each E MACs a pair
EAGER_FWD_PER_PAIR, EAGER_BWD_PER_PAIR = 2 * (2 * E), 2 * (4 * E)


@pytest.mark.parametrize("additive", [False, True], ids=["masked_fill", "where_tensor_zero"])
def test_eager_attention_under_a_data_mask_counts_the_pairs_the_batch_keeps(additive):
    # where_tensor_zero: the 0 kept pairs add is a constant the forward made (a real scalar in the capture)
    model = EagerMasked(additive)
    meter = FlopsMeter(model, attention="effective", dims={"batch": 0, "seq": 1}, conventions="torch", peak_flops=1e12)
    for lengths, seq in (([8, 5], 8), ([2, 6, 4], 6)):  # one family: one capture
        batch = (torch.randn(len(lengths), seq, 16), padded(lengths, seq))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing stays dense
            stats = meter.step(batch, time=1.0)
        dense = oracle_training_flops(model, batch)  # FlopCounterMode: the products as they run
        assert stats.dense_flops == sum(dense)
        dropped = H * sum(seq * (seq - n) for n in lengths)  # each query of a row drops its padded keys
        assert (stats.fwd_flops, stats.bwd_flops) == (dense[0] - dropped * EAGER_FWD_PER_PAIR,
                                                      dense[1] - dropped * EAGER_BWD_PER_PAIR)
    assert meter.captures == 1


def test_an_eager_tiny_llama_with_a_padded_attention_mask_by_hand():
    """transformers' eager attention adds a float mask, where(causal & padding, 0, min), to its scores."""
    model = tiny_llama("eager")
    meter = FlopsMeter(model, conventions="torch", attention="effective", peak_flops=1e12)
    for lengths, seq in (([8, 5], 8), ([12, 7, 3], 12)):
        ids = torch.randint(0, 64, (len(lengths), seq))
        batch = {"input_ids": ids, "attention_mask": padded(lengths, seq), "labels": ids}
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            stats = meter.step(batch, time=1.0)
        dense = oracle_training_flops(model, kwargs=batch, loss=lambda out: out.loss)
        assert stats.dense_flops == sum(dense)
        # per layer and head: causal, keys past the row's length dropped; GQA's shared k, v change nothing
        kept = LLAMA_HEADS * sum(min(i + 1, n) for n in lengths for i in range(seq))
        dropped = len(lengths) * LLAMA_HEADS * seq * seq - kept
        per_pair = 2 * LLAMA_HEAD_DIM  # FLOPs of one product for one pair
        assert (stats.fwd_flops, stats.bwd_flops) == (dense[0] - LLAMA_LAYERS * dropped * 2 * per_pair,
                                                      dense[1] - LLAMA_LAYERS * dropped * 4 * per_pair)
    assert meter.captures == 1


def test_capture_tags_the_placeholders_that_are_model_inputs():
    from fxflops.capture import capture
    from fxflops.capture.inputs import INPUT_INDEX

    class Swapped(nn.Module):  # uses its second input first, then a parameter, then its first
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, a, b):
            return b * self.w + a

    captured = capture(Swapped(), (torch.randn(4),), {"b": torch.randn(4)}, "eager")
    placeholders = captured.graph_module.graph.find_nodes(op="placeholder")
    assert [node.meta.get(INPUT_INDEX) for node in placeholders] == [1, None, 0]
