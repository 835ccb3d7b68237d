"""Time of a plan search: Llama-2-70B shapes on 512 GPUs of DGX H100 nodes, global batch 1024 x 4096 tokens.

`fxflops.plan` with the model given as a factory (LlamaForCausalLM built on the meta device at the depth it
is asked for: the captures run at two layers, the plans are for 80): one capture per (tp, micro-batch),
every plan derived from those per-layer costs. Reports wall and CPU time of the search, the plans evaluated,
the captures, and the best plan with its predicted memory against the device's. Writes
benchmarks/results/plan_search.md. Issue 41's target: >= 200 plans in under a minute on 2 cores.

    python benchmarks/plan_search.py
"""

from __future__ import annotations

import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import ROOT, environment  # noqa: E402


def build(layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=32000, attn_implementation="sdpa")
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def capture_best(best) -> dict:
    """The best plan's rank captured at the full depth with its optimizer: its peak tensor bytes by kind."""
    import torch

    import fxflops

    started = time.perf_counter()
    ids = torch.zeros(best.plan.micro_batch, 4096, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = fxflops.estimate(build(80), (ids,), parallel=best.parallel, backward=True, optimizer="adamw",
                               memory=True)
    return {"peak": est.memory.peak_bytes, "by_kind": dict(est.memory.by_kind), "started": started}


def main() -> None:
    import fxflops

    wall, cpu = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        search = fxflops.plan(build, gpus=512, cluster="DGX H100", global_batch=1024, seq_len=4096, layers=80)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    best = search.best
    captured, capture_wall = capture_best(best), time.perf_counter()
    capture_wall = capture_wall - captured.pop("started")
    text = "\n".join([
        "# plan_search.py", "", environment(), "Machine shared with other jobs (wall time above CPU time).", "",
        "Llama-2-70B shapes (80 layers, GQA 64/8 heads), 512 x H100 SXM (DGX H100), global batch 1024 x 4096 tokens.",
        "", "| plans evaluated | fit | captures | wall s | CPU s |", "|---|---|---|---|---|",
        f"| {search.evaluated} | {len(search.rows)} | {search.captures} | {wall:.1f} | {cpu:.1f} |", "",
        f"Best plan: {best.parallel}, micro-batch {best.plan.micro_batch}, recompute {best.plan.recompute}: "
        f"predicted step {best.step_time:.3f} s, MFU {best.prediction.mfu:.1%}, predicted memory of its fullest rank "
        f"{best.peak_bytes / 2**30:.1f} GiB of {search.capacity / 2**30:.0f} GiB "
        f"({', '.join(f'{k} {v / 2**30:.1f}' for k, v in best.memory.items())} GiB, plus the 0.5 GiB allowance).", "",
        "The best plan's rank captured whole (`fxflops.estimate(build(80), ..., parallel=best.parallel, "
        "backward=True, optimizer=\"adamw\", memory=True)`, "
        f"{capture_wall:.1f} s wall): peak {captured['peak'] / 2**30:.2f} GiB of tensors "
        f"({', '.join(f'{k} {v / 2**30:.2f}' for k, v in captured['by_kind'].items() if v)} GiB). The search's "
        f"prediction for that rank, {(best.peak_bytes - (512 << 20)) / 2**30:.2f} GiB of tensors, assumes Adam with "
        "fp32 master weights (12 bytes a parameter); torch's AdamW on the bf16 model keeps two bf16 moments (4 bytes "
        f"and a step counter per tensor): restated with 4 bytes a parameter the prediction is "
        f"{(best.peak_bytes - (512 << 20) - best.memory['optimizer'] * 2 // 3) / 2**30:.2f} GiB.", "",
        "```", search.render(10), "```", ""])
    path = os.path.join(ROOT, "benchmarks", "results", "plan_search.md")
    with open(path, "w") as stream:
        stream.write(text)
    print(text)


if __name__ == "__main__":
    main()
