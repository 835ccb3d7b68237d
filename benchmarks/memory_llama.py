"""Memory of a Llama-2-70B-shaped training step at seq 4096, on the meta device: fxflops' time and its own RSS.

A fresh subprocess builds the model on the meta device (bf16 weights, training mode, use_cache=False,
batch 1, seq 4096) and times, one after the other in the same process:

  estimate    fxflops.estimate(model, ..., backward=True, optimizer="adamw"): capture and count
  memory      fxflops.memory.estimate_memory(that capture, "adamw", MemoryOptions(master_weights=True,
              device="H100 SXM")): what memory=... adds to the estimate

It reports both calls' wall times (memory's as a ratio to the estimate's), the process' peak RSS
(VmHWM) after each, and what the memory estimate found: the peak tensor bytes per rank, by kind,
where, and whether one H100 holds the step (it does not: 70B parameters' model states alone are
16 bytes each, ~1 TiB; the point is the timeline at this size, and fxflops' own memory, target < 2 GB).

    python benchmarks/memory_llama.py                 # writes results/memory_llama.md
    python benchmarks/memory_llama.py --seq 512 --layers 4 --output ''   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import environment

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "memory_llama.md")

CHILD = r'''
import json, sys, time, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[3])
import torch, transformers
from common import status_kib
import fxflops
from fxflops.memory import MemoryOptions, estimate_memory
seq, layers = int(sys.argv[1]), int(sys.argv[2])
config = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
                                  num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                                  max_position_embeddings=max(4096, seq), use_cache=False)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()
ids = torch.zeros(1, seq, dtype=torch.long)
start = time.perf_counter()
e = fxflops.estimate(model, (), {"input_ids": ids}, backward=True, optimizer="adamw")
counted = time.perf_counter() - start
counted_kib = status_kib("VmHWM")
start = time.perf_counter()
m = estimate_memory(e.source.captured, "adamw", MemoryOptions(master_weights=True, device="H100 SXM"))
seconds = time.perf_counter() - start
out = {"counted": counted, "counted_kib": counted_kib, "seconds": seconds, "peak_kib": status_kib("VmHWM"),
       "params": e.total_params, "nodes": len(e.nodes), "peak_bytes": m.peak_bytes, "by_kind": m.by_kind,
       "phase": m.peak_at.phase, "module": m.peak_at.module, "op": m.peak_at.op, "model_states": m.model_states,
       "device_bytes": m.device_bytes, "fits": m.fits, "points": len(m.timeline),
       "layer0_saved": m.saved_under("model.layers.0"), "phase_peaks": m.phase_peaks()}
print(json.dumps(out))
'''


def run(seq: int, layers: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(seq), str(layers), HERE], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if done.returncode != 0:
        raise SystemExit(f"the child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def gib(num: float) -> str:
    return f"{num / 2**30:,.1f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--output", default=RESULTS, help="markdown file to write ('' = print only)")
    options = parser.parse_args()
    memory = run(options.seq, options.layers)
    kinds = ", ".join(f"{kind} {gib(size)}" for kind, size in memory["by_kind"].items() if size)
    lines = [
        "# Memory of a Llama-2-70B-shaped training step",
        "",
        environment(),
        "",
        f"Llama-2-70B shape ({options.layers} layers, {memory['params']:,} parameters), bf16 on the meta device, "
        f"batch 1, seq {options.seq}, training mode, backward and AdamW with fp32 master weights; "
        f"{memory['nodes']:,} graph nodes, {memory['points']:,} timeline points.",
        "",
        "| call | wall | peak RSS of the process after it |",
        "|---|---|---|",
        f"| estimate(backward=True, optimizer='adamw') (capture and count) | {memory['counted']:.1f} s | "
        f"{memory['counted_kib'] / 1024:,.0f} MiB |",
        f"| estimate_memory(that capture, 'adamw', MemoryOptions(master_weights=True, device='H100 SXM')) | "
        f"{memory['seconds']:.1f} s ({memory['seconds'] / memory['counted']:.2f}x the estimate) | "
        f"{memory['peak_kib'] / 1024:,.0f} MiB |",
        "",
        f"- peak tensor bytes per rank: {gib(memory['peak_bytes'])} in the {memory['phase']}"
        + (f", in {memory['module']} ({memory['op']})" if memory["module"] else ""),
        f"- alive at the peak: {kinds}",
        f"- model states: " + ", ".join(f"{k} {gib(v)}" for k, v in memory["model_states"].items() if v),
        f"- activations layer 0 saves: {gib(memory['layer0_saved'])}",
        "- highest total per phase: " + ", ".join(f"{k} {gib(v)}" for k, v in memory["phase_peaks"].items()),
        f"- fits on one H100 SXM (80 GiB): {memory['fits']} (needs {gib(memory['device_bytes'])} with the allowance)",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if options.output:
        with open(options.output, "w") as stream:
            stream.write(text)


if __name__ == "__main__":
    main()
