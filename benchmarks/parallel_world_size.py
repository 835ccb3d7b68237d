"""Time and peak memory of a what-if parallel plan against its world size (issue 38).

A Llama-2-7B-shaped LlamaForCausalLM (hidden 4096, 32 heads, intermediate 11008, vocab 32000; `--layers`
of them, default 4, so a run takes seconds; `--shape 70b`: Llama-2-70B's, hidden 8192, 64 heads, 8 KV heads,
intermediate 28672), built on the meta device without a KV cache, batch 1 x `--seq` tokens, forward + backward (`--forward`:
forward only; `--no-replay`: replay=False, every repeated block run) under
`fxflops.estimate(..., parallel=plan)`, pipeline plans included (one capture,
cut into stages; with tp the unsharded model is captured once more for the replicated-work report). Each plan runs in its own subprocess
(peak RSS = that process' VmHWM, imports and the meta model included); wall and CPU time are of the
estimate call only. The counted rank's FLOPs must not depend on dp (each rank runs its own micro-batch):
the script checks that too.

    python benchmarks/parallel_world_size.py [--layers 4] [--seq 512] [--shape 7b|70b] [--forward] [--no-replay]
                                             [--plans "tp=8" "tp=8,dp=16" ...]
    python benchmarks/parallel_world_size.py --shape 70b --layers 80 --seq 4096   # the 70B training plans
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import ROOT, environment, status_kib  # noqa: E402

PLANS = ("tp=8", "tp=8,dp=16", "tp=8,dp=128", "tp=8,dp=512", "tp=8,dp=16,dp_shard=8",
         # pipelines (4 stages of the 4 layers: first, middle, last roles), with micro-batches, FSDP and DDP
         "pp=4", "tp=8,pp=4,dp=32,microbatches=8", "tp=8,pp=4,dp=512,microbatches=8", "pp=4,dp=256,fsdp=false")
# --shape 70b (80 layers, seq 4096 in the results): 8, 1,024 and 16,384 ranks, training plans of issue 38
PLANS_70B = ("tp=8", "tp=8,dp=128", "tp=8,pp=4,dp=32,microbatches=8", "tp=8,pp=4,dp=512")


SHAPES = {"7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32),
          "70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8)}


def one(plan: str, layers: int, seq: int, shape: str = "7b", backward: bool = True, replay: bool = True) -> dict:
    import warnings

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import fxflops

    # no KV cache: a forward given one passes the cache object to every layer, which replay cannot key
    config = LlamaConfig(**SHAPES[shape], num_hidden_layers=layers, vocab_size=32000, attn_implementation="sdpa",
                         use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(1, seq, dtype=torch.long)
    before = status_kib("VmRSS")
    wall, cpu = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = fxflops.estimate(model, (ids,), backward=backward, parallel=plan, replay=replay)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"plan": plan, "ranks": sum(len(r.ranks) for r in est.ranks), "roles": len(est.ranks), "wall": wall, "cpu": cpu,
            "rss_before_mib": before / 1024, "peak_mib": status_kib("VmHWM") / 1024, "flops": est.total_flops,
            "collectives": len(est.collectives), "wire_bytes": est.collective_wire_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--forward", action="store_true", help="forward only (backward=False)")
    parser.add_argument("--no-replay", action="store_true", help="replay=False: every repeated block runs")
    parser.add_argument("--plans", nargs="*", help="default: PLANS, or PLANS_70B with --shape 70b")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.layers, args.seq, args.shape, not args.forward, not args.no_replay)))
        return
    print(environment())
    print(f"Llama-2-{args.shape.upper()} shapes, {args.layers} layers, batch 1 x seq {args.seq}, "
          f"{'forward only' if args.forward else 'forward + backward'}, replay={'off' if args.no_replay else 'on'}, "
          "deepspeed conventions")
    print("| plan | ranks | roles | wall s | CPU s | peak RSS MiB (before) | rank FLOPs | collectives | wire bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    flops_by_tp = {}
    for plan in args.plans or (PLANS_70B if args.shape == "70b" else PLANS):
        flags = ["--shape", args.shape] + ["--forward"] * args.forward + ["--no-replay"] * args.no_replay
        done = subprocess.run([sys.executable, __file__, "--one", plan, "--layers", str(args.layers), "--seq", str(args.seq),
                               *flags],
                              capture_output=True, text=True, cwd=ROOT, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        key = tuple(part for part in plan.split(",") if not part.startswith("dp"))
        flops_by_tp.setdefault(key, set()).add(row["flops"])
        print(f"| {plan} | {row['ranks']:,} | {row['roles']} | {row['wall']:.1f} | {row['cpu']:.1f} | {row['peak_mib']:.0f} "
              f"({row['rss_before_mib']:.0f}) | {row['flops']:,} | {row['collectives']} | {row['wire_bytes']:,} |")
    assert all(len(values) == 1 for values in flops_by_tp.values()), f"rank FLOPs depend on dp: {flops_by_tp}"


if __name__ == "__main__":
    main()
