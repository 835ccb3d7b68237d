"""Run by tests/test_meter.py under `torchrun --nproc_per_node 2` (gloo, CPU): each rank trains its own
batch shapes, counts them with a FlopsMeter (plain DDP, FSDP2), a FlopsCallback (the Trainer's DDP)
or a FlopsMonitor (Lightning's DDP), and writes what it saw to OUT/<kind>-rank<k>.json.

`exact`: the reduction of counts above 2^53, a NaN step time on one rank, and summary() of the job.
`tp`: a Llama sharded tensor-parallel over both ranks, its local FLOPs metered (tests/test_meter_parallel.py).
`ep`: torchtitan's expert parallelism, each rank's experts metered at the tokens they received
(tests/test_meter_experts.py).

    torchrun --nproc_per_node 2 tests/distributed_meter.py ddp,fsdp,trainer,lightning,exact,tp,ep OUT"""

from __future__ import annotations

import json
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

import fxflops
from fxflops import FlopsMeter


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def main(kinds: list[str], out: str) -> None:
    dist.init_process_group("gloo")
    for kind in kinds:
        if kind == "trainer":
            trainer(out)
        elif kind == "lightning":
            lightning_fit(out)
        elif kind == "exact":
            exact(out)
        elif kind == "tp":
            tensor_parallel(out)
        elif kind == "ep":
            expert_parallel(out)
        else:
            train(kind, out)
    dist.destroy_process_group()


def train(kind: str, out: str) -> None:
    rank = dist.get_rank()
    model = build()
    sizes = [3 + rank, 5 + 2 * rank, 2 + rank]  # every rank its own batch sizes
    meter = FlopsMeter(model, torch.randn(2, 8), peak_flops=1e12)  # built before the model is wrapped
    if kind == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    local, logged = [], []
    for step, size in enumerate(sizes):
        x = torch.randn(size, 8)
        meter.start()
        wrapped(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        stats = meter.step(x)
        local.append(stats.flops)
        if rank == 0:  # only rank 0 logs its own figures: no collective in here
            meter.metrics()
            meter.summary()
        if step == 1:  # a logging step: every rank reduces
            logged.append(meter.reduce().flops)
    total = meter.reduce(meter.total())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # of the model's own arithmetic: an unwrapped twin (fully_shard changed the model's class in place)
        estimates = [fxflops.estimate(build(), (torch.randn(size, 8),), backward=True).total_flops for size in sizes]
    with open(f"{out}/{kind}-rank{rank}.json", "w") as file:
        json.dump({"local": local, "estimates": estimates, "logged": logged, "total": total.flops,
                   "world": total.world_size, "captures": meter.captures, "mfu": total.mfu,
                   "time": total.time, "peak": total.peak_flops}, file)


def exact(out: str) -> None:
    """Counts summed as integers, a NaN time on rank 1 refused there and not dropped from the job's time,
    and summary() of this rank and of the job."""
    from fxflops.timing.reduction import all_reduced
    from fxflops.timing.steps import WindowStats

    rank = dist.get_rank()
    big = 2 ** 53 + 1  # float64 rounds 2 x this to 2^54
    local = WindowStats(steps=1, flops=big, samples=big, tokens=big, time=1.0 + rank, six_n_flops=big,
                        peak_flops=1e12, dense_flops=big)
    reduced = all_reduced(local, None)
    meter = FlopsMeter(build(), torch.randn(2, 8), peak_flops=1e12)
    refused = ""
    try:
        meter.step(torch.randn(3, 8), time=float("nan") if rank == 1 else 0.5)
    except ValueError as error:
        refused = str(error)
    meter.step(torch.randn(3 + rank, 8), time=0.25)
    nan = WindowStats(steps=1, flops=1, samples=1, tokens=None, time=float("nan") if rank == 1 else 2.0,
                      six_n_flops=None, peak_flops=1e12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bad = all_reduced(nan, None)
    with open(f"{out}/exact-rank{rank}.json", "w") as file:
        json.dump({"sums": [reduced.flops, reduced.samples, reduced.tokens, reduced.six_n_flops, reduced.dense_flops],
                   "time": reduced.time, "refused": refused, "bad_time": bad.time,
                   "warned": [str(w.message) for w in caught], "local_summary": meter.summary(),
                   "job_summary": meter.summary(job=True), "local_total": meter.total().flops,
                   "repr": repr(meter.reduce(meter.total()))}, file)


def tensor_parallel(out: str) -> None:
    """A Llama sharded with the Megatron plan over both ranks (one batch, each rank half of every matmul),
    trained two real steps of two shapes and metered: each rank's local FLOPs, and the job's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fxflops.parallel.megatron import megatron_plan
    from tests.parallel_models import Llama

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Llama()
    model = parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), megatron_plan(model))
    meter = FlopsMeter(model, conventions="torch", peak_flops=1e12)
    scaled = FlopsMeter(model, conventions="torch", peak_flops=1e12, job_total="local_x_world")
    for seq in (16, 8):
        tokens = torch.randint(0, 256, (2, seq))  # the same on both ranks (seeded): tensor parallel shares the batch
        meter.start()
        model(tokens).sum().backward()
        meter.step(tokens)
        scaled.step(tokens, time=1.0)
    logged = meter.local_metrics()
    job, alone = meter.reduce(meter.total()), scaled.reduce(scaled.total())
    with open(f"{out}/tp-rank{rank}.json", "w") as file:
        json.dump({"local": [s.flops for s in meter.steps], "captures": meter.captures,
                   "logged": {"rank": logged["rank"], "local_flops": logged["local_flops"]},
                   "job": [job.flops, job.world_size, job.job_total],
                   "scaled": [alone.flops, alone.world_size, alone.job_total]}, file)


# per rank, per step: the expert each of its 10 tokens is routed to (tests/test_meter_experts.py)
EP_ROUTINGS = ([[0, 0, 1, 2, 2, 2, 3, 0, 1, 1], [3] * 8 + [0, 1]],
               [[2, 3, 3, 3, 0, 1, 1, 1, 1, 2], [0] * 10])


def expert_parallel(out: str) -> None:
    """torchtitan's expert parallelism over both ranks (2 of 4 experts each), each rank routing its own
    batches; a meter built without an example (its first step observed) logs the rows this rank's experts
    received from both ranks and its local FLOPs."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.moe_models import ExpertParallel, TitanMoE, routed_batch

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TitanMoE(8, 8, 4)
    ExpertParallel(init_device_mesh("cpu", (dist.get_world_size(),))).apply(model.experts)
    meter = FlopsMeter(model, dims={"batch": 0, "seq": 1}, conventions="torch", peak_flops=1e12)
    for picks in EP_ROUTINGS[rank]:
        x = routed_batch(picks, 8, 5)
        meter.start()
        with meter.observe():
            model(x).sum().backward()
            meter.micro_batch(x)
        meter.step()
    job = meter.reduce(meter.total())
    with open(f"{out}/ep-rank{rank}.json", "w") as file:
        json.dump({"local": [s.flops for s in meter.steps], "rows": [s.routed_rows for s in meter.steps],
                   "job": job.flops, "uncounted": meter.uncounted()}, file)


def trainer(out: str) -> None:
    """transformers' Trainer in this job (its own DDP, gloo on CPU) with a FlopsCallback."""
    import transformers as tf

    from fxflops.integrations.transformers import FlopsCallback

    rank = dist.get_rank()
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0,
                           eos_token_id=0)
    model = tf.GPT2LMHeadModel(config)
    fed: list[dict] = []

    def collate(features: list[dict]) -> dict:
        longest = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), longest, dtype=torch.long)
        for row, feature in enumerate(features):
            ids[row, :len(feature["input_ids"])] = torch.tensor(feature["input_ids"])
        fed.append({"input_ids": ids, "labels": ids.clone()})
        return fed[-1]

    data = [{"input_ids": list(range(1, n + 1))} for n in (3, 9, 5, 12, 7, 4, 10, 6)]
    args = tf.TrainingArguments(output_dir=f"{out}/trainer", max_steps=2, per_device_train_batch_size=2,
                                logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                                ddp_backend="gloo", disable_tqdm=True, dataloader_num_workers=0)
    callback = FlopsCallback(peak_flops=1e12)
    job = tf.Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[callback])
    job.train()
    logs = [entry for entry in job.state.log_history if "mfu" in entry]
    inner = model.module if hasattr(model, "module") else model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimates = [fxflops.estimate(inner, kwargs={**batch, "num_items_in_batch": torch.tensor(1)}, backward=True,
                                      loss=lambda output: output.loss).total_flops for batch in fed[:2]]
    with open(f"{out}/trainer-rank{rank}.json", "w") as file:
        json.dump({"local": [s.flops for s in callback.meter.steps], "estimates": estimates,
                   "logged": [entry["flops"] for entry in logs], "world": [entry["world_size"] for entry in logs],
                   "captures": callback.meter.captures}, file)


def summing_module(net: torch.nn.Module):
    """A LightningModule that trains `net` on the sum of its output with SGD (also used by the single-process
    tests)."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return self(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module()


def memory_logger():
    """A Lightning logger that keeps every logged row in `.rows` (also used by the single-process tests)."""
    from lightning.pytorch.loggers import Logger

    class Memory(Logger):
        name, version = "memory", 0

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[dict] = []

        def log_metrics(self, metrics, step=None):
            self.rows.append(dict(metrics))

        def log_hyperparams(self, *args, **kwargs):
            pass

    return Memory()


def lightning_fit(out: str) -> None:
    """Lightning's own DDP strategy in this job, with a FlopsMonitor logging to memory on rank 0."""
    import lightning as L

    from fxflops.integrations.lightning import FlopsMonitor

    rank = dist.get_rank()
    sizes = [3 + rank, 6 + rank]  # each rank its own batches: a loader per rank, no sampler
    loader = torch.utils.data.DataLoader([torch.randn(n, 8) for n in sizes], batch_size=None)
    logger, monitor = memory_logger(), FlopsMonitor(peak_flops=1e12)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=2, strategy="ddp", logger=logger,
                        log_every_n_steps=1, callbacks=[monitor], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(summing_module(build()), train_dataloaders=loader)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimates = [fxflops.estimate(build(), (torch.randn(n, 8),), backward=True).total_flops for n in sizes]
    rows = [row for row in logger.rows if "train/flops" in row]
    with open(f"{out}/lightning-rank{rank}.json", "w") as file:
        json.dump({"local": [s.flops for s in monitor.meter.steps], "estimates": estimates,
                   "logged": [row["train/flops"] for row in rows],
                   "device": [row["train/device/flops"] for row in rows],
                   "world": [row["train/world_size"] for row in rows]}, file)


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2])
