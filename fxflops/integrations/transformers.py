"""transformers' Trainer: `Trainer(..., callbacks=[FlopsCallback()])` logs exact FLOPs, TFLOP/s and MFU.

The callback reads the inputs of every training forward (a forward pre-hook on the model, added at
train begin and removed at train end), so the count follows the batches the Trainer really feeds:
variable lengths, padding, packing, gradient accumulation; a forward run under torch.no_grad() (a
reference pass in a Trainer subclass's compute_loss) counts its forward alone, and the count follows
the model as it is (frozen layers, checkpointing: see FlopsMeter). Steps that could not be counted are
said at every log, with why. At each logging step it adds to the logs
(`state.log_history` and every logger the Trainer reports to):

    flops            fwd + bwd FLOPs per optimizer step, all ranks together (mean over the steps logged)
    flops_per_sec    achieved, all ranks; tflops the same in TFLOP/s
    mfu              per device: achieved over world size x the device's dense peak (when known)
    tokens_per_sec, samples_per_sec, 6n_flops (transformers' 6·N·tokens for the same steps),
    6n_over_counted  (how far the approximation is off), world_size

Inside a process group each rank counts its LOCAL work (a model sharded by parallelize_module, FSDP2 or
a pipeline stage counts what the rank executes) and adds its own figures beside the job's:

    rank, local_flops (this rank's FLOPs per step), local_flops_per_sec, local_mfu (this device's MFU
    from its local count)

(every rank's `state.log_history` holds its own; the loggers write rank 0's). The job's `flops` is
the all-reduced sum of every rank's local count, or local x world size with `job_total="local_x_world"`
(no collective) and under torch's fake process group; `callback.total.job_total` says which.

`total_flos`, the Trainer's 6N sum, stays as it is unless `replace_total_flos=True`: then the logged
and saved `total_flos` is the exact count. Under torch.distributed every rank counts its own
micro-batches; figures are reduced with the job's process group at logging steps only.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from typing import Any

import torch
from transformers import TrainerCallback

from fxflops.integrations import ForwardInputs, warn_uncounted
from fxflops.timing.meter import FlopsMeter
from fxflops.timing.steps import WindowStats, combined, summed


class FlopsCallback(TrainerCallback):
    """Exact FLOPs and MFU per logging step of a transformers Trainer; see the module's docstring.

    `peak_flops` (FLOP/s per device) overrides the peaks table (GPUs by name, for the dtype the
    Trainer computes in: bf16/fp16 from its arguments); the other keywords go to FlopsMeter
    (dims, loss, conventions, optimizer, ...)."""

    def __init__(self, *, peak_flops: float | None = None, replace_total_flos: bool = False, prefix: str = "",
                 **meter_options: Any) -> None:
        self.peak_flops = peak_flops
        self.replace_total_flos = replace_total_flos
        self.prefix = prefix
        self.meter_options = meter_options
        self.meter: FlopsMeter | None = None
        self.total: WindowStats | None = None  # every rank's steps so far, as last reduced
        self._inputs = ForwardInputs()
        self._since: list[Any] = []  # steps closed since the last reduction
        self._logs: dict[str, float] = {}
        self._observing = ExitStack()  # the meter's observe() over a step's forwards: a MoE's routed rows

    # ------------------------------------------------------------------------------------- events

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._move_ahead_of_loggers()
        options = dict(self.meter_options)
        options.setdefault("dtype", torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None)
        # built without an example: the first training forward's inputs are its first family
        self.meter = FlopsMeter(model, None, peak_flops=self.peak_flops, **options)
        self._inputs.attach(model)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.meter.start()
        self._observing.close()  # (a step whose end was not reached)
        self._observing.enter_context(self.meter.observe())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self._inputs.paused():  # a capture runs the model's forward on fake tensors
            for call, backward in self._inputs.take():
                self.meter.micro_batch(call, backward=backward)
        self._observing.close()
        self._since.append(self.meter.step())
        if control.should_log:
            self._logs = self._reduce_since_last()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._since:  # steps after the last log, so the final total_flos has them
            self._reduce_since_last()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs is None:
            return
        added, self._logs = self._logs, {}
        if self.replace_total_flos and "total_flos" in logs and self.total is not None and self.total.flops is not None:
            added["total_flos"] = float(self.total.flops)
            state.total_flos = float(self.total.flops)
        logs.update(added)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(added)  # the Trainer appended a copy of logs before calling us

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.replace_total_flos and self.total is not None and self.total.flops is not None:
            state.total_flos = float(self.total.flops)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._observing.close()
        self._inputs.detach()

    # ------------------------------------------------------------------------------------ helpers

    def _reduce_since_last(self) -> dict[str, float]:
        """The steps since the last reduction, summed over every rank (a collective: every rank is here
        at the same step, since logging steps and epoch ends are global)."""
        steps, self._since = self._since, []
        warn_uncounted(self.meter, steps)
        local = summed(steps)
        reduced = self.meter.reduce(local)
        self.total = reduced if self.total is None else combined(self.total, reduced, reduced.job_total)
        return {**self.meter.metrics(reduced, prefix=self.prefix), **self.meter.local_metrics(local, prefix=self.prefix)}

    def _move_ahead_of_loggers(self) -> None:
        """The Trainer calls the reporting callbacks (wandb, tensorboard, ...) before the user's: to reach
        them, this callback moves right after the flow callback in the Trainer's list (safe during the
        event's own loop: it moves to an index already called)."""
        handler = sys._getframe(2).f_locals.get("self")
        callbacks = getattr(handler, "callbacks", None)
        if not isinstance(callbacks, list) or self not in callbacks:
            return
        position = callbacks.index(self)
        if position > 1:
            callbacks.pop(position)
            callbacks.insert(1, self)

