"""The training meter and its callbacks under parallelism: each rank counts its LOCAL work, the job's
total is every rank's summed (or local x world without a collective), MFU per device from the local count.

Under torch.distributed's own fake process group (4 ranks, no process per rank); the real 2-process
gloo job is in test_a_real_two_rank_gloo_job_meters_what_the_fake_plan_predicted. Every number is a
hand count (torch conventions: only the matmuls count).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

import fxflops
from tests.parallel_models import UpDownMLP
from fxflops import FlopsMeter
from fxflops.timing.steps import JOB_SCALED, JOB_SUMMED

V, H, F, WORLD = 32, 16, 64, 4
DIMS = {"batch": 0, "seq": 1}


def MLP() -> UpDownMLP:  # noqa: N802 - read as the class it builds
    return UpDownMLP(H, F)


def mm(tokens: int, shards: int = 1) -> int:
    """One (tokens, H) x (H, F / shards) product's FLOPs (or its transpose's: the same size)."""
    return 2 * tokens * H * F // shards


@pytest.fixture
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield init_device_mesh("cpu", (WORLD,))
    finally:
        dist.destroy_process_group()


def tp(model: torch.nn.Module, mesh) -> torch.nn.Module:
    return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def fsdp(model: UpDownMLP, mesh) -> UpDownMLP:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.up, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def quiet_estimate(model, x) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(model, (x,), conventions="torch", backward=True).total_flops


@pytest.mark.parametrize("sharding, shards", [(tp, WORLD), (fsdp, 1)], ids=["tp", "fsdp2"])
def test_the_meter_counts_the_ranks_local_work_and_the_job_is_local_times_world(mesh, sharding, shards):
    model = sharding(MLP(), mesh)
    meter = FlopsMeter(model, torch.randn(2, 8, H), dims=DIMS, conventions="torch", peak_flops=1e6)
    for batch, seq in ((2, 8), (3, 5)):
        x = torch.randn(batch, seq, H)
        stats = meter.step(x, time=2.0)
        # x needs no gradient: forward up and down, backward grad weight of up, grad input and weight of down;
        # TP: each rank holds F/4 of both weights; FSDP2: the whole weights (gathered), its own batch
        local = 5 * mm(batch * seq, shards)
        assert stats.flops == quiet_estimate(model, x) == local
        job = meter.reduce()  # a fake group's collective sums nothing: the job is local x world
        assert (job.flops, job.world_size, job.job_total) == (WORLD * local, WORLD, JOB_SCALED)
        assert job.mfu == stats.mfu == local / 2.0 / 1e6  # per device, from the local count
        assert meter.local_metrics(prefix="p/") == {"p/rank": 0.0, "p/local_flops": local,
                                                    "p/local_flops_per_sec": local / 2.0,
                                                    "p/local_mfu": local / 2.0 / 1e6}
    assert meter.captures == 1  # one sweep: both shapes are points of it
    assert meter.reduce(meter.total()).flops == WORLD * 5 * (mm(16, shards) + mm(15, shards))
    assert f"(all {WORLD} ranks, local x world)" in meter.summary(job=True)
    assert f"(rank 0 of {WORLD}" in meter.summary()


@pytest.mark.parametrize("index", [0, WORLD - 1], ids=["first", "last"])
def test_a_pipeline_stage_counts_its_own_layers(mesh, index):
    from torch.distributed.pipelining import PipelineStage

    layers = [torch.nn.Linear(H, F, bias=False) if i % 2 == 0 else torch.nn.Linear(F, H, bias=False)
              for i in range(WORLD)]  # one a stage
    width = layers[index].in_features
    stage = PipelineStage(layers[index], index, WORLD, torch.device("cpu"))
    x = torch.randn(2, 8, width)  # the micro-batch, or the activation the last stage receives
    meter = FlopsMeter(stage, x, dims=DIMS, conventions="torch", peak_flops=1e6)
    stats = meter.step(torch.randn(3, 5, width), time=1.0)
    # the first stage's input needs no gradient (grad weight only); the last stage's received activation
    # does (its gradient is sent back): grad input and grad weight
    assert stats.flops == (2 if index == 0 else 3) * mm(15)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = fxflops.estimate(stage, (torch.randn(3, 5, width),), conventions="torch", backward=True)
    assert stats.flops == est.total_flops
    assert meter.model is layers[index] and meter.reduce().job_total == JOB_SCALED


def test_an_input_that_needs_its_gradient_costs_a_grad_input():
    """The family's capture keeps the batch's requires_grad (it dropped it: no grad input was counted)."""
    meter = FlopsMeter(torch.nn.Linear(H, F, bias=False), dims=DIMS, conventions="torch", peak_flops=1e6)
    x = torch.randn(3, 5, H)
    assert meter.step(x, time=1.0).flops == 2 * mm(15)  # forward, grad weight
    assert meter.step(x.requires_grad_(), time=1.0).flops == 3 * mm(15)  # and grad input


def test_local_x_world_is_a_choice_and_a_misspelling_is_refused(mesh):
    meter = FlopsMeter(tp(MLP(), mesh), torch.randn(2, 8, H), conventions="torch", peak_flops=1e6,
                       job_total="local_x_world")
    meter.step(torch.randn(2, 8, H), time=1.0)
    assert meter.reduce().job_total == JOB_SCALED
    with pytest.raises(ValueError, match="job_total is one of 'all_reduce', 'local_x_world', got 'sum'"):
        FlopsMeter(MLP(), job_total="sum")


def test_outside_a_process_group_nothing_local_is_added():
    meter = FlopsMeter(MLP(), torch.randn(2, 8, H), conventions="torch", peak_flops=1e6)
    meter.step(torch.randn(2, 8, H), time=1.0)
    assert meter.local_metrics() == {} and meter.reduce().job_total is None


# ----------------------------------------------------------------------------------------- callbacks


class Tokens(torch.nn.Module):
    """Embedding, a tensor-parallel MLP, and a loss: what a Trainer or a LightningModule trains."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(V, H)
        self.mlp = MLP()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.mlp(self.embed(input_ids))
        return {"loss": out.float().pow(2).mean(), "logits": out}


def tokens_step(batch: int, seq: int) -> int:
    # the embedding is trained, so up's input needs a gradient too: forward 2 products, backward 4
    return 6 * mm(batch * seq, WORLD)


def test_the_trainer_callback_logs_local_and_job_flops_of_a_sharded_model(mesh, tmp_path):
    tf = pytest.importorskip("transformers")
    from fxflops.integrations.transformers import FlopsCallback

    torch.manual_seed(0)
    model = Tokens()
    tp(model.mlp, mesh)
    shapes = [(2, 6), (2, 9)]

    def collate(features: list[dict]) -> dict:
        ids = torch.randint(0, V, shapes[len(fed) % len(shapes)])  # the loader may fetch ahead: in order
        fed.append(ids)
        return {"input_ids": ids, "labels": ids}

    fed: list[torch.Tensor] = []
    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, logging_steps=1,
                                report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                dataloader_num_workers=0)
    callback = FlopsCallback(peak_flops=1e12, conventions="torch")
    trainer = tf.Trainer(model=model, args=args, train_dataset=[{"x": 0}] * 8, data_collator=collate,
                         callbacks=[callback])
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "local_flops" in entry]
    local = [tokens_step(*shape) for shape in shapes]
    assert [entry["local_flops"] for entry in logs] == local
    assert [entry["flops"] for entry in logs] == [WORLD * flops for flops in local]
    assert [entry["world_size"] for entry in logs] == [WORLD, WORLD] and logs[0]["rank"] == 0
    assert all(entry["local_mfu"] == pytest.approx(entry["mfu"]) for entry in logs)  # every rank alike here
    assert callback.total.job_total == JOB_SCALED and callback.total.flops == WORLD * sum(local)


def test_the_lightning_monitor_logs_local_and_job_flops_of_a_sharded_model(mesh):
    L = pytest.importorskip("lightning")
    from fxflops.integrations.lightning import FlopsMonitor
    from tests.distributed_meter import memory_logger, summing_module

    shapes = [(2, 6), (3, 4)]
    loader = torch.utils.data.DataLoader([torch.randn(*shape, H) for shape in shapes], batch_size=None)
    logger, monitor = memory_logger(), FlopsMonitor(peak_flops=1e12, conventions="torch", dims=DIMS)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=logger, log_every_n_steps=1,
                        callbacks=[monitor], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(summing_module(tp(MLP(), mesh)), train_dataloaders=loader)
    rows = [row for row in logger.rows if "train/flops" in row]
    local = [5 * mm(b * s, WORLD) for b, s in shapes]  # the batch needs no gradient
    assert [row["train/device/flops"] for row in rows] == local
    assert [row["train/flops"] for row in rows] == [WORLD * flops for flops in local]
    assert [row["train/world_size"] for row in rows] == [WORLD, WORLD]
    assert all(row["train/device/local_mfu"] == pytest.approx(row["train/device/mfu"]) for row in rows)
    assert monitor.job.job_total == JOB_SCALED


# ------------------------------------------------------------------------------------ a real job


def test_a_real_two_rank_gloo_job_meters_what_the_fake_plan_predicted(tmp_path):
    """tests/distributed_meter.py `tp`: a Llama sharded tensor-parallel over 2 gloo processes, metered for
    steps of two shapes; each rank's local FLOPs equal estimate(parallel={"tp": 2})'s per-rank count, the
    job's total their all-reduced sum (and local x world without a collective: the same here)."""
    import json

    from tests.parallel_models import Llama
    from tests.test_parallel_plans import bwd, fwd
    from tests.torchrun import torchrun

    done = torchrun("distributed_meter.py", "tp", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    shapes = [(2, 16), (2, 8)]
    predicted = []
    for shape in shapes:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = fxflops.estimate(Llama(), (torch.zeros(shape, dtype=torch.long),), conventions="torch",
                                   backward=True, parallel={"tp": 2})
        predicted.append(est.total_flops)
    assert predicted[0] == fwd(2) + bwd(2)  # the plan's hand count (tests/test_parallel_plans.py)
    ranks = [json.loads((tmp_path / f"tp-rank{rank}.json").read_text()) for rank in range(2)]
    for rank, seen in enumerate(ranks):
        assert seen["local"] == predicted and seen["captures"] == 1
        assert seen["logged"] == {"rank": rank, "local_flops": predicted[-1]}
        assert seen["job"] == [2 * sum(predicted), 2, JOB_SUMMED]
        assert seen["scaled"] == [2 * sum(predicted), 2, JOB_SCALED]
