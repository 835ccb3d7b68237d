"""Lightning: `Trainer(callbacks=[FlopsMonitor()])` where ThroughputMonitor would go, with no
`flops_per_batch` to write and batches of any shape.

The monitor reads the inputs of the LightningModule's own training forward calls (`self(x)` in
training_step; a forward pre-hook added at train start, removed at train end and on exceptions), or
`inputs(batch)` when given (for a training_step that calls a submodule: pass `module=` too). A
training_step that calls a submodule instead (`self.model(**batch)`, a wrapped Hugging Face model) is
found at the first batch: the monitor watches the direct submodules too until then, counts the one
that ran, and says so once (several that ran: it says what to pass). A forward under torch.no_grad()
(a teacher's or reference pass) counts its forward alone. Every `log_every_n_steps` optimizer steps it
logs, with ThroughputMonitor's names:

    train/device/flops, train/device/flops_per_sec, train/device/tflops, train/device/mfu,
    train/device/samples_per_sec, train/device/items_per_sec (tokens), train/device/step_time,
    and, all ranks together: train/flops, train/flops_per_sec, train/samples_per_sec, train/world_size

Inside a process group each rank counts its LOCAL work (a model sharded by parallelize_module, FSDP2
or a pipeline stage counts what the rank executes): train/device/flops is this rank's local count,
train/device/local_mfu this device's MFU from it (train/device/mfu stays the devices' mean, as
ThroughputMonitor's), and train/flops the job's: every rank's local count all-reduced, or local x world
size with `job_total="local_x_world"` (no collective) and under torch's fake process group
(`monitor.job.job_total` says which).

Under attention="effective" (a FlopsMeter option) the dense count is beside the effective one:
train/device/dense_flops, train/device/dense_mfu and, all ranks together, train/dense_flops.

(`flops` is fwd + bwd per optimizer step, the rates over the steps since the last log). The loss
computed outside the module's forward is not in the count: the backward is counted from the
forward's output, as estimate(backward=True) does.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from fxflops.integrations import ForwardInputs, warn_uncounted
from fxflops.timing.meter import FlopsMeter
from fxflops.timing.steps import summed


class FlopsMonitor(Callback):
    """Exact FLOPs, throughput and MFU per logging step of a Lightning Trainer; see the module's docstring.

    `peak_flops` (FLOP/s per device) overrides the peaks table (GPUs by name, for the Trainer's
    precision). `inputs(batch)` gives the module's forward inputs from a batch; `module(pl_module)`
    the module it is called on (default: the LightningModule). Other keywords go to FlopsMeter."""

    def __init__(self, *, peak_flops: float | None = None, inputs: Callable[[Any], Any] | None = None,
                 module: Callable[[Any], torch.nn.Module] | None = None, separator: str = "/",
                 **meter_options: Any) -> None:
        super().__init__()
        self.peak_flops = peak_flops
        self.inputs = inputs
        self.module = module
        self.separator = separator
        self.meter_options = meter_options
        self.meter: FlopsMeter | None = None
        self._calls = ForwardInputs()
        self._children: dict[str, ForwardInputs] = {}  # until the first batch: which module's forward ran
        self._options: dict[str, Any] = {}
        self._since: list[Any] = []
        self._steps = 0
        self.job: Any = None  # the job's figures (WindowStats) as last logged
        self._observing = ExitStack()  # the meter's observe() over a batch's forward: a MoE's routed rows

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        counted = self.module(pl_module) if self.module is not None else pl_module
        self._options = dict(self.meter_options)
        self._options.setdefault("dtype", _precision_dtype(str(trainer.precision)))
        self.meter = FlopsMeter(counted, None, peak_flops=self.peak_flops, **self._options)
        if self.inputs is None:
            self._calls.attach(counted)
            if self.module is None:  # a training_step may call a submodule instead of self(...)
                for name, child in pl_module.named_children():
                    self._children[name] = ForwardInputs()
                    self._children[name].attach(child)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._accumulated(trainer, batch_idx) == 0:
            self.meter.start()
        self._observing.close()
        self._observing.enter_context(self.meter.observe())

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._children:
            self._choose(pl_module)
        calls = self._calls.take() if self.inputs is None else [(self.inputs(batch), torch.is_grad_enabled())]
        with self._calls.paused():  # a capture runs the module's forward on fake tensors
            for call, backward in calls:
                self.meter.micro_batch(call, backward=backward)
        self._observing.close()
        if self._accumulated(trainer, batch_idx) != trainer.accumulate_grad_batches - 1:
            return  # the optimizer step is not over
        self._since.append(self.meter.step())
        self._steps += 1
        if self._steps % max(trainer.log_every_n_steps, 1) == 0:
            self._log(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._detach()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._detach()

    def _detach(self) -> None:
        self._observing.close()
        self._calls.detach()
        for watched in self._children.values():
            watched.detach()
        self._children = {}

    def _choose(self, pl_module: Any) -> None:
        """After the first batch: keep the LightningModule if its forward ran, else the one direct submodule
        whose forward did (training_step calling self.model(...)); several, or none: say what to pass."""
        ran = [name for name, watched in self._children.items() if watched.calls]
        if self._calls.calls or len(ran) != 1:
            if not self._calls.calls:
                which = (f"its submodules {', '.join(ran)}" if ran else "none of its direct submodules")
                self.meter.warn_once(
                    f"fxflops.FlopsMonitor: training_step did not call the LightningModule's forward (self(...)) "
                    f"and {which} ran in training mode: no FLOPs are logged; pass FlopsMonitor(module=lambda m: "
                    "m.<the module training_step calls>, inputs=lambda batch: <its inputs>)")
            for watched in self._children.values():
                watched.detach()
            self._children = {}
            return
        name = ran[0]
        self._calls.detach()
        self._calls = self._children.pop(name)  # its calls of this batch are counted now
        for watched in self._children.values():
            watched.detach()
        self._children = {}
        started = self.meter._started  # the step under way was started on the first meter: its time carries over
        self.meter = FlopsMeter(getattr(pl_module, name), None, peak_flops=self.peak_flops, **self._options)
        self.meter._started = started
        self.meter.warn_once(f"fxflops.FlopsMonitor: training_step calls self.{name}(...), not self(...): counting "
                             f"the forward and backward of `{name}` (module=lambda m: m.{name} says so, silently)")

    def _log(self, trainer: Any) -> None:
        """Every rank reduces (a collective, at the same step on all of them); the loggers write on rank 0."""
        steps, self._since = self._since, []
        warn_uncounted(self.meter, steps)
        local = summed(steps)
        reduced = self.job = self.meter.reduce(local)
        s = self.separator
        metrics = {f"train{s}device{s}{key}": value for key, value in self.meter.metrics(local).items()
                   if key != "world_size"}  # one device's figures: the world size is the job's
        everyone = self.meter.metrics(reduced)
        for key in ("flops", "flops_per_sec", "tflops", "samples_per_sec", "tokens_per_sec", "world_size",
                    "dense_flops"):
            if key in everyone:
                metrics[f"train{s}{key}"] = everyone[key]
        for key in ("mfu", "dense_mfu"):  # the devices' mean, as ThroughputMonitor's device/mfu is
            if key in everyone:
                metrics[f"train{s}device{s}{key}"] = everyone[key]
        if "local_mfu" in (own := self.meter.local_metrics(local)):  # this device's, from its own count
            metrics[f"train{s}device{s}local_mfu"] = own["local_mfu"]
        if f"train{s}device{s}tokens_per_sec" in metrics:  # Lightning's name for lengths per second
            metrics[f"train{s}device{s}items_per_sec"] = metrics.pop(f"train{s}device{s}tokens_per_sec")
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @staticmethod
    def _accumulated(trainer: Any, batch_idx: int) -> int:
        return batch_idx % max(trainer.accumulate_grad_batches, 1)


def _precision_dtype(precision: str) -> torch.dtype | None:
    """The compute dtype of a Lightning precision setting ("bf16-mixed", "16-mixed", "32-true", ...)."""
    if "bf16" in precision:
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    if precision.startswith("64"):
        return torch.float64
    return None
