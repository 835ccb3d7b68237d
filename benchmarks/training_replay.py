"""Replay of repeated blocks in a training estimate (backward=True): the time of
`fxflops.estimate(model, kwargs=..., backward=True)` on a Llama-2-70B-shaped LlamaForCausalLM (transformers,
built on the meta device, 80 layers, hidden 8192, 64 heads, 8 KV heads, intermediate 28672), replay on
(the default) against replay=False, measured in the same process, alternating, CPU time (process_time) and
wall; and the totals, per phase, checked equal.

    nice -n 10 python benchmarks/training_replay.py                      # 70B, seq 4096, 3 rounds
    python benchmarks/training_replay.py --layers 8 --seq 512 --rounds 1 # quick look
"""

from __future__ import annotations

import argparse
import gc
import time

import torch


def build(layers: int) -> torch.nn.Module:
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=8192, num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8,
                            intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096)
    with torch.device("meta"):
        return tf.LlamaForCausalLM(config)


def timed(model: torch.nn.Module, kwargs: dict, replay: bool) -> tuple[float, float, object]:
    import fxflops

    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    est = fxflops.estimate(model, kwargs=kwargs, backward=True, replay=replay)
    return time.process_time() - cpu, time.perf_counter() - wall, est


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    model = build(options.layers)
    kwargs = {"input_ids": torch.zeros(1, options.seq, dtype=torch.long), "use_cache": False}
    timed(model, kwargs, True)  # warm: imports, rule table, kernels
    rows: dict = {True: [], False: []}
    totals = {}
    for _ in range(options.rounds):
        for replay in (True, False):
            cpu, wall, est = timed(model, kwargs, replay)
            rows[replay].append((cpu, wall))
            totals[replay] = (est.total_flops, est.fwd_flops, est.bwd_flops, len(est.nodes))
            rows[replay, "nodes"] = [(c.name, c.op, c.status, c.module, c.macs, c.flops, c.bytes, c.source, c.phase,
                                      c.differentiates, c.input_shapes, c.output_shapes) for c in est.nodes]
    for replay in (True, False):
        cpu = min(c for c, _ in rows[replay])
        wall = min(w for _, w in rows[replay])
        print(f"replay={replay!s:5}  cpu min {cpu:.2f} s  wall min {wall:.2f} s  all cpu {[round(c, 2) for c, _ in rows[replay]]}")
    print("totals (total, forward, backward FLOPs, nodes):", totals[True], "equal" if totals[True] == totals[False] else f"DIFFER {totals[False]}")
    print("every node's cost row (name, op, module, MACs, FLOPs, bytes, source, phase, forward op, shapes):",
          "equal" if rows[True, "nodes"] == rows[False, "nodes"] else "DIFFER")


if __name__ == "__main__":
    main()
