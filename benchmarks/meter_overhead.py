"""What FlopsMeter costs a training loop: the capture per shape family, and the per-step cost after it.

    python benchmarks/meter_overhead.py [--steps 2000] [--output benchmarks/results/meter_overhead.md]

For each model (built on the meta device: the meter never runs it), in one process:
- capture: the first batch of a family (FlopsMeter(model, example_batch)), one sweep capture of the
  forward and its backward with batch and seq symbolic;
- new point: meter.step() at a (batch, seq) not seen before: the compiled total evaluated there;
- step: meter.step(batch, time=...) over `--steps` steps cycling through 16 sequence lengths and 2
  batch sizes (variable-length batches), the median and 99th percentile per call: the loop's cost;
- state: of that, the read of the model's state (fxflops.timing.model_state: trainable and training
  flags, settings, modules, dtypes) the meter makes once per step so its count follows the model, median
  over 200 reads; also alone for a Llama-2-7B-shaped model (32 layers, on the meta device).
Every step's count is checked against estimate(backward=True) at a few of the shapes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxflops  # noqa: E402
from benchmarks.common import environment  # noqa: E402
from fxflops import FlopsMeter  # noqa: E402
from fxflops.timing.model_state import model_state  # noqa: E402


def gpt2(layers: int, width: int, heads: int):
    import transformers as tf

    config = tf.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=50257, n_positions=1024,
                           bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        return tf.GPT2LMHeadModel(config).train()


def batch(b: int, s: int) -> dict[str, torch.Tensor]:
    ids = torch.zeros(b, s, dtype=torch.long, device="meta")
    return {"input_ids": ids, "attention_mask": torch.ones(b, s, dtype=torch.long, device="meta"), "labels": ids}


def measure(name: str, model, steps: int) -> dict[str, str]:
    start = time.perf_counter()
    meter = FlopsMeter(model, batch(2, 128), peak_flops=1e15)
    capture = time.perf_counter() - start
    start = time.perf_counter()
    meter.step(batch(3, 200), time=0.1)
    new_point = time.perf_counter() - start
    shapes = [(b, s) for b in (4, 8) for s in range(64, 1024 + 1, 64)]
    batches = [batch(*shape) for shape in shapes]
    for b in batches:  # every point once: what is measured next is the steady state
        meter.step(b, time=0.1)
    costs = []
    for i in range(steps):
        b = batches[i % len(batches)]
        begin = time.perf_counter_ns()
        meter.step(b, time=0.1)
        costs.append((time.perf_counter_ns() - begin) / 1e3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for shape in (shapes[0], shapes[-1]):
            expected = fxflops.estimate(model, kwargs=batch(*shape), backward=True, loss=lambda o: o.loss).total_flops
            meter.step(batch(*shape), time=0.1)
            assert meter.steps[-1].flops == expected, (name, shape)
    costs.sort()
    return {"model": name, "captures": str(meter.captures), "capture (s)": f"{capture:.2f}",
            "new point (ms)": f"{new_point * 1e3:.2f}", "step median (us)": f"{statistics.median(costs):.1f}",
            "step p99 (us)": f"{costs[int(len(costs) * 0.99)]:.1f}", "state (us)": f"{state_read(model):.1f}"}


def state_read(model) -> float:
    """The median microseconds of one model_state(model): the meter's per-step read of the model's state."""
    costs = []
    for _ in range(200):
        begin = time.perf_counter_ns()
        model_state(model)
        costs.append((time.perf_counter_ns() - begin) / 1e3)
    return statistics.median(costs)


def llama_7b():
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                            vocab_size=32000)
    with torch.device("meta"):
        return tf.LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--output")
    options = parser.parse_args()
    rows = [measure("GPT-2 tiny (2 layers, 64 wide)", gpt2(2, 64, 2), options.steps),
            measure("GPT-2 small (12 layers, 768 wide)", gpt2(12, 768, 12), options.steps)]
    rows.append({"model": "Llama-2-7B shape (32 layers), state read alone", "state (us)": f"{state_read(llama_7b()):.1f}"})
    from tabulate import tabulate

    text = ("# FlopsMeter overhead\n\n" + environment() + "\n\n"
            + tabulate(rows, headers="keys", tablefmt="github") + "\n\n"
            "step: meter.step(batch, time=...) on variable-length batches (32 shapes, each seen before), "
            f"{options.steps} steps. new point: the first step at an unseen shape (the compiled formula "
            "evaluated). capture: the first batch of the family (forward + backward, batch and seq symbolic). "
            "Counts checked equal to estimate(backward=True) at the smallest and largest shapes. state: the read of "
            "the model's state in each step (model_state), median of 200.\n")
    print(text)
    if options.output:
        Path(options.output).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
