"""Where a first count's time goes: the fake-tensor forward every tool pays, then what each layer adds (issue 23).

    python benchmarks/capture_floor.py                       # gpt2, resnet50, Llama-2-7B; writes results/capture_floor.md
    python benchmarks/capture_floor.py --models gpt2 --output ''

One forward of the model on fake tensors, as the eager capture sets it up (fxflops' fake twins of a
meta-built model), under each stack of layers below, each in a fresh process (its first call: fake
tensors' per-op cache starts empty, as for a user), CPU seconds of the forward alone, the minimum of
`--repeats` processes:

  fake              FakeTensorMode alone: the floor every fake-tensor counter pays
  + modules         and fxflops' ModuleTracker (global module hooks: which module runs)
  + pass-through    and a TorchDispatchMode that only calls each op (the cost of a Python mode layer)
  FlopCounterMode   fake + FlopCounterMode (its own module tracking and per-op counting) instead
  fxflops capture   fake + modules + fxflops' recorder and composite-keeping torch-function mode
  fxflops estimate  the whole estimate(): rule table, capture, count, results

A counter that records a graph (every op's node, module, source line and value) cannot go below
"+ pass-through"; the gap from there to "fxflops capture" is the recording itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

from common import ROOT, environment

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "capture_floor.md")
LAYERS = ("fake", "+ modules", "+ pass-through", "FlopCounterMode", "fxflops capture", "fxflops estimate")


def worker(layer: str, model: str) -> float:
    import gc
    import warnings

    import torch
    from first_call import _build, _pay_fake_first_use

    warnings.filterwarnings("ignore")
    _pay_fake_first_use()
    with torch.device("meta"):
        net, args, kwargs = _build(model, False, 4096)
    if layer == "fxflops estimate":
        from fxflops import estimate

        gc.disable()
        start = time.process_time()
        estimate(net, args, kwargs)
        return time.process_time() - start
    return _forward_under(layer, net, args, kwargs)


def _forward_under(layer: str, net, args, kwargs) -> float:
    import gc

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from fxflops.api import Counting
    from fxflops.capture.attribution import ModuleTracker
    from fxflops.capture.eager import FakeTwins
    from fxflops.capture.reach import Reach
    from fxflops.capture.isolation import isolated
    from fxflops.capture.twins import swap_tensors
    from fxflops.capture.recorder import CompositeOps, OpRecorder

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    knows_op = Counting.prepare("deepspeed", None, None).table.knows_op  # (loaded before the timer)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    twins = FakeTwins(mode, torch.device("cpu"))
    inputs = Reach((args, kwargs))
    with isolated(net, inputs) as modules:
        swap_tensors(modules, twins)
        fake_args, fake_kwargs = inputs.with_twins(twins)
        tracker = ModuleTracker(net)
        recorder = OpRecorder(tracker, type(net).__name__, run=twins.run)
        stack = {
            "fake": [mode],
            "+ modules": [mode, tracker],
            "+ pass-through": [mode, tracker, PassThrough()],
            "FlopCounterMode": [mode, FlopCounterMode(display=False)],
            "fxflops capture": [mode, tracker, recorder, CompositeOps(recorder, knows_op)],
        }[layer]
        gc.disable()
        start = time.process_time()
        with torch.no_grad(), contextlib.ExitStack() as entered:
            for context in stack:
                entered.enter_context(context)
            net(*fake_args, **fake_kwargs)
        return time.process_time() - start


def run_worker(layer: str, model: str) -> float | str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, HERE, os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", layer, model],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        return f"error: {tail[-1] if tail else proc.returncode}"
    return json.loads(lines[-1])["cpu_s"]


def render(rows: dict[str, dict[str, float | str]], models: list[str], repeats: int, env: str) -> str:
    labels = {"7b": "Llama-2-7B seq 4096 use_cache=False"}
    out = ["# Where a first count's time goes", "", env, "",
           f"CPU seconds of one fake-tensor forward under each stack (minimum of {repeats} fresh processes); "
           "the last row is the whole `estimate()`.", "",
           "| layers | " + " | ".join(labels.get(m, m) for m in models) + " |",
           "|---|" + "---:|" * len(models)]
    for layer in LAYERS:
        cells = [rows[model][layer] for model in models]
        out.append(f"| {layer} | " + " | ".join(f"{c:.3f}" if isinstance(c, float) else c for c in cells) + " |")
    out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,resnet50,7b", help="zoo names, or 7b/70b for the Llama-2 shapes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=RESULTS, help="markdown file to write ('' to print only)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        print(json.dumps({"cpu_s": worker(*options.worker)}))
        return
    models = [m for m in options.models.split(",") if m]
    rows: dict[str, dict[str, float | str]] = {model: {} for model in models}
    for model in models:
        for layer in LAYERS:
            found = [run_worker(layer, model) for _ in range(options.repeats)]
            times = [t for t in found if isinstance(t, float)]
            rows[model][layer] = min(times) if times else found[0]
            print(f"{model} {layer}: {rows[model][layer]}", file=sys.stderr, flush=True)
    report = render(rows, models, options.repeats, environment(("torch", "torchvision", "transformers")))
    print(report)
    if options.output:
        with open(options.output, "w") as handle:
            handle.write(report)


if __name__ == "__main__":
    main()
