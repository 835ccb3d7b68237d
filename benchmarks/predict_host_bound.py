"""Could CPU dispatch explain Megatron-Core 1.7B on H100 (issue 41)? A two-clock check, not a model.

One micro-batch of the validation row "Megatron-Core 1.7B on 48 H100" (Megatron's GPT, h = 2,048, 24 layers,
vocabulary 131,072, sequence 4,096, micro-batch 1) as the op sequence fxflops times: the two-layer capture's
embedding and head ops and its first layer's ops repeated 24 times, forward then backward, each op's predicted
H100 time (fxflops.predict.op_time). A host that issues one op every h seconds and runs ahead of the GPU (no
sync inside a micro-batch) starts op i at max(host ready, GPU free); the GPU idles only where the host falls
behind. Prints the largest h at which it never does (the break-even: min over k of the first k ops' GPU time
over k) and the idle time at several h. No per-op host time is predicted: fxflops has no published figure for
a CUDA op under PyTorch eager and Transformer Engine on a modern host (docs/guide/predict.md). Writes
benchmarks/results/predict_host_bound.md.

    python benchmarks/predict_host_bound.py
"""

from __future__ import annotations

import os
import re
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import ROOT, environment  # noqa: E402

HOST_SECONDS = (10e-6, 20e-6, 50e-6, 62e-6, 80e-6, 100e-6)


def layer_index(module: str) -> int:
    """The repeated block a node runs in (its module path's first number), -1 outside the blocks."""
    found = re.search(r"(?:^|\.)(\d+)(?:\.|$)", module or "")
    return int(found.group(1)) if found else -1


def gpu_idle(seconds: list[float], host: float) -> float:
    """GPU idle time when the host issues an op every `host` seconds and runs ahead: op i starts at
    max(the host has issued it, the GPU is free)."""
    issued = free = 0.0
    for op in seconds:
        issued += host
        free = max(free, issued) + op
    return free - sum(seconds)


def main() -> None:
    import torch

    import fxflops
    from fxflops.predict.hardware import cluster
    from fxflops.predict.op_time import FLASH, node_times
    from fxflops.predict.validation import RUNS, gpt, lm_loss
    from fxflops.results import FORWARD

    run = next(r for r in RUNS if r.name == "Megatron-Core 1.7B on 48 H100")
    device = cluster(run.cluster).device
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = gpt(2, run.hidden, run.heads, vocab=run.vocab, seq=run.seq).to(torch.bfloat16)
        est = fxflops.estimate(model, (torch.zeros(1, run.seq, dtype=torch.long),), backward=True, loss=lm_loss)
    nodes = [n for n in est.nodes if n.status == "counted"]
    timed = list(zip(nodes, (t.seconds for t in node_times(nodes, device, torch.bfloat16, FLASH))))
    forward = [(n, t) for n, t in timed if n.phase == FORWARD]
    backward = [(n, t) for n, t in timed if n.phase != FORWARD]
    first = next(i for i, (n, _) in enumerate(forward) if layer_index(n.module) >= 0)
    first_back = next(i for i, (n, _) in enumerate(backward) if layer_index(n.module) >= 0)
    pre_forward = [t for _, t in forward[:first]]
    post_forward = [t for n, t in forward[first:] if layer_index(n.module) < 0]
    post_backward = [t for _, t in backward[:first_back]]
    pre_backward = [t for n, t in backward[first_back:] if layer_index(n.module) < 0]
    layer_forward = [t for n, t in forward if layer_index(n.module) == 0]
    layer_backward = [t for n, t in backward if layer_index(n.module) == 0]
    seq = pre_forward + layer_forward * run.layers + post_forward + post_backward + layer_backward * run.layers \
        + pre_backward
    gpu = sum(seq)
    running = [sum(seq[:k]) / k for k in range(1, len(seq))]
    lines = ["# predict_host_bound.py", "", environment(), "",
             f"{run.name}: one micro-batch, {len(seq)} ops ({len(layer_forward)} + {len(layer_backward)} a layer), "
             f"predicted GPU time {gpu * 1e3:.1f} ms, mean {gpu / len(seq) * 1e6:.1f} us an op; a layer "
             f"{sum(layer_forward) * 1e3:.3f} ms forward, {sum(layer_backward) * 1e3:.3f} ms backward.",
             f"Break-even host time an op (the GPU never idles below it): {min(running) * 1e6:.1f} us.", "",
             "| host time an op | GPU idle a micro-batch | of its GPU time |", "|---|---|---|"]
    for host in HOST_SECONDS:
        idle = gpu_idle(seq, host)
        lines.append(f"| {host * 1e6:.0f} us | {idle * 1e3:.3f} ms | {idle / gpu * 100:.1f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(ROOT, "benchmarks", "results", "predict_host_bound.md"), "w") as out:
        out.write(text)


if __name__ == "__main__":
    main()
