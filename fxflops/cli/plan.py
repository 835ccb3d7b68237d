"""`fxflops plan MODEL --gpus 512 --cluster "DGX H100" --batch 1024 --seq-len 4096`: rank parallel plans.

MODEL is any form `fxflops MODEL` takes. An hf: model is built at a depth of two layers for the captures (its
config's depth is what the plans are for: the blocks are the same); any other MODEL is captured as built.
Prints the fastest plans that fit with their breakdown; --csv / --json write every plan evaluated, --html a plot
of them (step time against memory per rank, the frontier marked).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from fxflops.cli.model_spec import load
from fxflops.cli.options import InputOptions

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxflops plan", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="what to plan for (the forms `fxflops MODEL` takes, e.g. hf:meta-llama/Llama-2-70b-hf)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the job")
    parser.add_argument("--cluster", default="DGX H100", help="a cluster preset or a cluster TOML file (default: DGX H100)")
    parser.add_argument("--device", help="the cluster's GPUs replaced by this device: a preset or a device TOML file "
                        "(such as fxflops.predict.calibrate writes from a measured run)")
    parser.add_argument("--batch", type=int, required=True, help="global batch, in sequences")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[1, 2, 4], help="micro-batch sizes to try")
    parser.add_argument("--cp", type=int, nargs="+", default=[1],
                        help="context parallel degrees to try (long sequences), e.g. --cp 1 2 4")
    parser.add_argument("--ep", type=int, nargs="+", default=[1],
                        help="expert parallel degrees to try (MoE models; with cp, multiples of it), e.g. --ep 1 2 4")
    parser.add_argument("--schedules", nargs="+", choices=["1f1b", "gpipe"], default=["1f1b", "gpipe"],
                        help="pipeline schedules to try with one chunk a stage (virtual stages run interleaved 1F1B)")
    parser.add_argument("--attention", choices=["flash", "cudnn", "math"], default="flash",
                        help="the attention kernels the run launches: flash (fused, default), cudnn (cuDNN's fused "
                        "kernels, as Transformer Engine runs them on Hopper) or math (unfused: batched GEMMs and the "
                        "scores through memory)")
    parser.add_argument("--attention-dropout", type=float, default=0.0,
                        help="dropout on the attention probabilities (a kernel of its own with --attention math)")
    parser.add_argument("--fuse-elementwise", action="store_true",
                        help="the run fuses each chain of pointwise ops into one kernel (Megatron-LM's bias + GeLU "
                        "and bias + dropout + add)")
    parser.add_argument("--persistent-norm", action="store_true",
                        help="the run's layer norms are apex's persistent fast layer norm (Megatron-LM's "
                        "persist_layer_norm, Transformer Engine's LayerNorm)")
    parser.add_argument("--pipeline-engine", choices=["megatron", "deepspeed"], default="megatron",
                        help="whose pipeline engine runs the stages (default megatron); deepspeed: no virtual "
                        "stages, no GPipe, no FSDP with pp > 1")
    parser.add_argument("--dp-shard", type=int, nargs="*", default=None,
                        help="HSDP shard degrees to try beside FSDP over all of dp (default: every divisor of dp "
                        "between 1 and dp; give none, a bare --dp-shard, to try no HSDP)")
    parser.add_argument("--tp-comm-overlap", action="store_true",
                        help="also try each sequence-parallel plan with its tensor-parallel collectives overlapped "
                        "with their GEMMs (Megatron-LM's --tp-comm-overlap, torchtitan's async TP)")
    parser.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default=None,
                        help="time the optimizer step as torch.optim's kernels (default: one fused kernel over fp32 master "
                             "weights and moments, as Megatron's, DeepSpeed's and Apex's optimizers run it)")
    parser.add_argument("--optimizer-impl", choices=["foreach", "for_loop", "fused"], default=None,
                        help="torch.optim's implementation with --optimizer (default foreach, torch's on CUDA)")
    parser.add_argument("--top", type=int, default=10, help="plans to print (default 10)")
    parser.add_argument("--csv", help="write every plan evaluated (fitting or not) to this CSV file")
    parser.add_argument("--json", help="write every plan evaluated to this JSON file")
    parser.add_argument("--html", help="write a plot of every plan (step time against memory per rank, the frontier "
                        "marked) to this HTML file")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


def main(argv: Sequence[str]) -> int:
    from fxflops.predict.search import plan

    args = build_parser().parse_args(list(argv))
    dtype = DTYPES[args.dtype]
    if args.model.startswith("hf:"):
        from fxflops.cli.hf_specs import resolve_hf_config

        config, _ = resolve_hf_config(args.model.removeprefix("hf:"))
        layers = config.num_hidden_layers

        def build(depth: int) -> torch.nn.Module:
            options = InputOptions(batch=1, seq_len=args.seq_len, dtype=dtype, overrides={"num_hidden_layers": depth})
            return load(args.model, options).model

        model, depth = build, layers
    else:
        model, depth = load(args.model, InputOptions(batch=1, seq_len=args.seq_len, dtype=dtype)).model, None
    result = plan(model, gpus=args.gpus, cluster=args.cluster, global_batch=args.batch, seq_len=args.seq_len,
                  layers=depth, dtype=dtype, micro_batch=args.micro_batch, device=args.device,
                  cp=tuple(args.cp), ep=tuple(args.ep), schedules=tuple(args.schedules), attention=args.attention,
                  attention_dropout=args.attention_dropout, fuse_elementwise=args.fuse_elementwise,
                  persistent_norm=args.persistent_norm, pipeline_engine=args.pipeline_engine,
                  dp_shard=None if args.dp_shard is None else tuple(args.dp_shard),
                  tp_comm_overlap=(False, True) if args.tp_comm_overlap else (False,),
                  optimizer=args.optimizer, optimizer_impl=args.optimizer_impl)
    sys.stdout.write(result.render(args.top) + "\n")
    if args.csv:
        result.to_csv(args.csv)
    if args.json:
        result.to_json(args.json)
    if args.html:
        result.to_html(args.html)
    return 0
