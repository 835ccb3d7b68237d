"""The meter under a mixture of experts: each micro-batch counts the rows its experts really received
(read from the forward inside meter.observe()), not an assumed routing; the hooks never outlive it.

A top-1 router over 4 experts of different widths (so the split changes the total), its weights set so
a token goes to the expert named by its largest of the first 4 features. Hand counts, torch
conventions (matmuls only): router 2·T·8·4 forward and no backward (argmax passes no gradient);
expert i (hidden h = 4(i+1)) on r rows: forward 2 x 2·r·8·h, backward 3 x 2·r·8·h (two weight
gradients and the second layer's input gradient: the first layer's input needs none). Checked against
FlopCounterMode on the real forward and backward too.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from fxflops import FlopsMeter
from fxflops.timing.meter import FlopsMeterWarning

D, EXPERTS, SEQ = 8, 4, 5
DIMS = {"batch": 0, "seq": 1}


class WidthsMoE(nn.Module):
    """Top-1 routing to experts of hidden widths 4, 8, 12, 16, each called with the rows routed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, width(i), bias=False), nn.ReLU(),
                                                   nn.Linear(width(i), D, bias=False)) for i in range(EXPERTS))
        with torch.no_grad():
            self.router.weight.copy_(torch.eye(EXPERTS, D))  # a token's pick: the largest of its first 4 features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, D)
        picks = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            rows = (picks == i).nonzero().squeeze(-1)
            out = out.index_add(0, rows, self.run(expert, flat[rows]))
        return out.reshape(x.shape)

    def run(self, expert: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        return expert(rows)


def width(expert: int) -> int:
    return 4 * (expert + 1)


def batch(picks: list[int]) -> torch.Tensor:
    """A (tokens / SEQ, SEQ, D) batch whose token t the router sends to expert picks[t]."""
    x = torch.rand(len(picks) // SEQ, SEQ, D) * 0.1
    for token, expert in enumerate(picks):
        x.view(-1, D)[token, expert] = 10.0
    return x


def hand(picks: list[int]) -> tuple[int, int]:
    """(forward, backward) FLOPs of one step on a batch routed as `picks`."""
    rows = [picks.count(i) for i in range(EXPERTS)]
    fwd = 2 * len(picks) * D * EXPERTS + sum(2 * 2 * r * D * width(i) for i, r in enumerate(rows))
    bwd = sum(3 * 2 * r * D * width(i) for i, r in enumerate(rows))
    return fwd, bwd


def oracle(model: nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    model.zero_grad()
    return counter.get_total_flops()


def watched(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.fixture
def quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*peak.*")  # no MFU on a CPU
        yield


def test_each_step_counts_the_rows_its_experts_received(quiet) -> None:
    model = WidthsMoE()
    first, second = [0, 0, 1, 2, 2, 2, 3, 0, 1, 1], [3, 3, 3, 3, 3, 3, 3, 3, 0, 1]
    meter = FlopsMeter(model, batch(first), dims=DIMS, conventions="torch")
    totals = []
    for picks in (first, second):
        x = batch(picks)
        with meter.observe():
            assert watched(model) == 1 + EXPERTS  # the model (its forwards) and each expert
            model(x).sum().backward()
            counted = meter.micro_batch(x)
        model.zero_grad()
        stats = meter.step(time=1.0)
        assert (counted.fwd_flops, counted.bwd_flops) == hand(picks)
        assert stats.flops == sum(hand(picks)) == oracle(model, x)
        assert stats.routed_rows == {f"experts.{i}": picks.count(i) for i in range(EXPERTS)}
        assert watched(model) == 0
        totals.append(stats.flops)
    # 640 + 128·3 + 256·3 + 384·3 + 512 forward, 192·3 + 384·3 + 576·3 + 768 backward; then rows (1, 1, 0, 8)
    assert totals == [3456 + 4224, 5120 + 6720]
    assert meter.captures == 1  # the second split is the same family: an evaluation, no capture


@pytest.mark.parametrize("counted_at_the_end", [False, True])
def test_micro_batches_count_their_own_forwards_routing(quiet, counted_at_the_end: bool) -> None:
    """Gradient accumulation: each micro-batch counts its own forward's rows, counted after each forward or
    all at the step's end (as the callbacks do), in the order the forwards ran."""
    model = WidthsMoE()
    first, second = [0] * 10, [1, 2, 3, 1, 2, 3, 1, 2, 3, 0]
    meter = FlopsMeter(model, batch(first), dims=DIMS, conventions="torch")
    counted = []
    with meter.observe():
        batches = [batch(first), batch(second)]
        for x in batches:
            model(x).sum().backward()
            if not counted_at_the_end:
                counted.append(meter.micro_batch(x))
        if counted_at_the_end:
            counted = [meter.micro_batch(x) for x in batches]
    stats = meter.step(time=1.0)
    assert [(c.fwd_flops, c.bwd_flops) for c in counted] == [hand(first), hand(second)]
    assert stats.flops == sum(hand(first)) + sum(hand(second))
    assert stats.routed_rows == {"experts.0": 11, "experts.1": 3, "experts.2": 3, "experts.3": 3}


class CheckpointedMoE(WidthsMoE):
    """Each expert under activation checkpointing: run again in the backward, on no more tokens."""

    def run(self, expert: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        return checkpoint(expert, rows, use_reentrant=False)


def test_an_expert_recomputed_in_the_backward_adds_no_rows(quiet) -> None:
    model = CheckpointedMoE()
    picks = [0, 0, 1, 2, 2, 2, 3, 0, 1, 1]
    x = batch(picks)
    meter = FlopsMeter(model, x, dims=DIMS, conventions="torch")
    with meter.observe():
        model(x).sum().backward()
        counted = meter.micro_batch(x)
    assert counted.routed_rows == {"experts.0": 3, "experts.1": 3, "experts.2": 3, "experts.3": 1}
    fwd, bwd = hand(picks)
    # checkpointing's recomputation stops at the last tensor the backward needs: each expert's first layer
    recomputed = sum(2 * picks.count(i) * D * width(i) for i in range(EXPERTS))
    assert (counted.fwd_flops, counted.bwd_flops) == (fwd, bwd + recomputed) == (3456, 4224 + 1408)
    assert counted.flops == oracle(model, x)


def test_the_hooks_are_removed_on_an_exception(quiet) -> None:
    model = WidthsMoE()
    meter = FlopsMeter(model, batch([0] * 10), dims=DIMS, conventions="torch")
    with pytest.raises(RuntimeError, match="the loop failed"):
        with meter.observe():
            assert watched(model) == 1 + EXPERTS
            raise RuntimeError("the loop failed")
    assert watched(model) == 0


def test_a_forward_not_observed_is_not_counted_and_says_so(quiet) -> None:
    model = WidthsMoE()
    x = batch([0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    meter = FlopsMeter(model, x, dims=DIMS, conventions="torch")
    model(x).sum().backward()
    with pytest.warns(UserWarning, match=r"rows routed to its experts were not read: run the forward inside "
                                         r"meter.observe\(\)"):
        assert meter.micro_batch(x) is None
    assert meter.step(time=1.0).flops is None
    assert "meter.observe()" in meter.uncounted()
    assert watched(model) == 0


def test_lightning_monitor_logs_each_steps_routing(quiet) -> None:
    """FlopsMonitor observes each batch's forward, the first step's too (before the first capture every
    module is watched for that step): each logged step counts the rows its batch routed."""
    pytest.importorskip("lightning")
    import lightning as L

    from fxflops.integrations.lightning import FlopsMonitor
    from tests.distributed_meter import memory_logger

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.moe = WidthsMoE()

        def forward(self, x):
            return self.moe(x)

        def training_step(self, x, batch_idx):
            return self(x).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)  # the router's picks stay as set

    routings = [[0] * 10, [0, 0, 1, 2, 2, 2, 3, 0, 1, 1], [3, 3, 3, 3, 3, 3, 3, 3, 0, 1]]
    module, logger = Module(), memory_logger()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=logger, log_every_n_steps=1,
                        callbacks=[FlopsMonitor(peak_flops=1e12, conventions="torch")], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlopsMeterWarning)  # nothing goes uncounted
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch(p) for p in routings],
                                                                          batch_size=None))
    assert watched(module) == 0
    logged = [row["train/device/flops"] for row in logger.rows if "train/device/flops" in row]
    # all ten tokens to expert 0 (hidden 4): router 2·10·8·4 = 640 and 2 x 640 forward, 3 x 640 backward
    assert logged == [sum(hand(r)) for r in routings] == [640 + 1280 + 1920, 7680, 11840]


class InlineMoE(nn.Module):
    """Experts as slices of one weight, applied inline: no module receives the routed rows."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.weight = nn.Parameter(torch.randn(EXPERTS, D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, D)
        picks = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for i in range(EXPERTS):
            rows = (picks == i).nonzero().squeeze(-1)
            out = out.index_add(0, rows, flat[rows] @ self.weight[i])
        return out.reshape(x.shape)


def test_routed_rows_no_module_receives_are_refused_in_one_line(quiet) -> None:
    model = InlineMoE()
    with pytest.warns(UserWarning, match=r"could not count a batch of shapes \[\(2, 5, 8\)\]: the costs of '\(root\)' "
                                         r"depend on sizes made from tensor values \(u0, u1, u2, u3: a router's picks, "
                                         r"a mask\) that reach no module as its input's rows.*estimate\(routing=\.\.\.\)"):
        meter = FlopsMeter(model, batch([0] * 10), dims=DIMS, conventions="torch")
    assert meter.step(batch([0] * 10), time=1.0).flops is None
    assert watched(model) == 0

