"""The `fxflops` argument parser: its options, its --help text, and what they say about the inputs.

`build_parser()` is the whole command line (the manual's CLI reference is generated from it); a
mistake costs one line and exit status 2. `input_options()` turns the parsed `--batch`, `--seq-len`,
`--input-shape`, `--dtype`, `--set` and hf: options into the `InputOptions` a MODEL is built with.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import NoReturn

from fxflops.capture.methods import AUTO, CHOICES
from fxflops.cli.hf_specs import HF_TASKS
from fxflops.cli.options import (INPUT_DTYPES, InputOptions, ModelSpecError, parse_dtype, parse_input_shape,
                                 parse_override)
from fxflops.optimizer import NAMES as OPTIMIZERS
from fxflops.rules import CONVENTIONS, PRESET_TABLE

FORMATS = ("text", "table", "json", "csv", "html")
EXIT_USAGE = 2


EPILOG = """\
MODEL is one of:
  NAME                    a built-in example: fxflops examples
  explain                 with --cluster NAME|FILE or --device NAME|FILE: every constant of the time
                          model (bandwidths, latencies, peaks, efficiencies) with its source
  torchvision:NAME        e.g. torchvision:resnet50 (weights are never downloaded)
  hf:NAME                 a checkpoint fxflops knows the config of (fxflops examples lists them),
                          e.g. hf:gpt2, hf:facebook/opt-350m; or a model type with its config
                          class's defaults (hf:llama, said in the report); nothing is downloaded
  hf:PATH                 a local config.json (or a folder holding one)
  FILE.py:FACTORY         FACTORY() returns a model, or (model, inputs)
  package.module:FACTORY  likewise, from an importable module
Everything is built on the meta device and --input-shape inputs are meta tensors: nothing is
allocated and nothing is computed. (FILE.py:FACTORY builds its model as its code does; one that can
be counted only by running it, or --method trace, runs once on all-zero inputs made then.)

examples:
  fxflops lenet5 --batch 1024 --top 3
  fxflops torchvision:resnet50 --depth 2
  fxflops hf:gpt2 --seq-len 1024 --set n_layer=2 --format table
  fxflops my_model.py:build --input-shape 8,3,224,224 --format json --output cost.json
  fxflops my_model.py:build --input-shape input_ids=2,16 --peak-flops 989.4T --bandwidth 3.35T
  fxflops gpt2-small --sweep seq=128..4096*2 --sweep batch=1,8
  fxflops torchvision:resnet50 --sweep size[2,3]=160..320:32
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake costs one line (the whole usage block would bury it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}{self._guess(message)} (fxflops --help lists the options)\n")

    def _guess(self, message: str) -> str:
        """The closest option to a misspelt one (--conventoins), or the closest choice to a misspelt value."""
        from fxflops.spelling import did_you_mean

        if message.startswith("unrecognized arguments: "):
            for word in message.removeprefix("unrecognized arguments: ").split():
                if word.startswith("-"):
                    guess = did_you_mean(word.partition("=")[0], self._option_string_actions)
                    if guess:
                        return guess
            return ""
        invalid = re.search(r"invalid choice: '(.*?)' \(choose from (.*)\)$", message)
        if invalid:
            return did_you_mean(invalid[1], re.findall(r"'([^']*)'", invalid[2]))
        return ""


def _at_least(lowest: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be {lowest} or more, got {value}")
        return value
    parse.__name__ = "int"  # argparse names the type in its message: "invalid int value"
    return parse


_SI = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def _rate(text: str) -> float:
    """`989.4T`, `9.894e14` or `3350G` -> a positive number per second."""
    scale = _SI.get(text.strip()[-1:], 1.0)
    number = text.strip()[:-1] if scale != 1.0 else text.strip()
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number such as 989.4T or 9.894e14") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


_rate.__name__ = "rate"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fxflops",
        description="Estimate MACs, FLOPs and parameters per module of a PyTorch model.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL",
                        help="what to estimate (see below), 'examples', or 'explain' with --cluster or --device: "
                             "the time model's constants and their sources")
    inputs = parser.add_argument_group("inputs")
    inputs.add_argument("--input-shape", action="append", default=[], metavar="[NAME=]SHAPE",
                        help="shape of one positional input, e.g. 1,3,224,224, or of a keyword input by "
                             "name, e.g. input_ids=2,16 (repeat for more inputs)")
    inputs.add_argument("--batch", type=int, default=1, help="batch size of the default inputs (default 1)")
    inputs.add_argument("--seq-len", type=int, help="sequence length for token models (default 128; refused for "
                                                   "models that take no token sequence)")
    inputs.add_argument("--dtype", help="cast model and floating inputs: float32, float16, bfloat16, float64")
    inputs.add_argument("--input-dtype", help="dtype of the inputs made from --input-shape, e.g. long for token "
                                              "ids or an nn.Embedding's indices (default: long for input_ids-like "
                                              "names, else floating)")
    inputs.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="config field (hf:), constructor or factory argument, e.g. n_layer=2")
    inputs.add_argument("--hf-task", default="auto", choices=sorted(HF_TASKS),
                        help="which transformers auto class builds hf: models (default auto: the class "
                             "config.architectures names, else the causal or seq2seq LM for those types, "
                             "else the base model)")
    inputs.add_argument("--trust-remote-code", action="store_true",
                        help="let hf:DIR run the Python its config.json's auto_map names (never by default)")
    counting = parser.add_argument_group("counting")
    counting.add_argument("--conventions", default="deepspeed", choices=CONVENTIONS,
                          help="counting preset (rules/presets.toml): "
                               + "; ".join(f"{name}: {PRESET_TABLE.presets[name].doc}" for name in CONVENTIONS))
    counting.add_argument("--rules", action="append", default=[], metavar="FILE",
                          help="your own rule file (TOML, the format of rules/*.toml) or a folder of them; "
                               "its rules take precedence over ours (repeatable)")
    counting.add_argument("--fail-on-unknown", action="store_true",
                          help="exit with an error (status 1) naming the ops no rule counts and their modules, "
                               "instead of a report whose totals leave them out (for CI)")
    counting.add_argument("--attention", default="dense", choices=("dense", "effective"),
                          help="how attention ops count in the totals: dense (every (query, key) pair, as "
                               "FlopCounterMode) or effective (only the pairs causal / sliding-window masks "
                               "keep); the summary shows both when they differ")
    counting.add_argument("--parallel", default=None, metavar="PLAN",
                          help="a what-if parallel plan, e.g. tp=8,pp=4,dp=32,batch=1024 or tp=4,sequence_parallel=true: "
                               "each rank role's FLOPs and every collective's bytes, on torch.distributed's fake process "
                               "group (keys: tp, pp, virtual_stages, dp, dp_shard, ep, cp, sequence_parallel, loss_parallel, fsdp (false: DDP), "
                               "reshard_after_forward, bucket_cap_mb (DDP's gradient bucket MiB), microbatch, microbatches, batch, schedule (1F1B, GPipe, interleaved), world_size; the inputs are one "
                               "data-parallel rank's micro-batch)")
    counting.add_argument("--method", default=AUTO, choices=CHOICES,
                          help="eager (the default's first try): the model's own forward on fake tensors; "
                               "export; symbolic; trace: one real forward (default auto: each in turn)")
    counting.add_argument("--replay", action=argparse.BooleanOptionalAction, default=True,
                          help="copy a repeated block's call from an earlier one where provably the same "
                               "(default); --no-replay runs every call")
    counting.add_argument("--backward", action="store_true",
                          help="also count the backward autograd runs for the sum of the outputs, op by op "
                               "(frozen parameters get no gradient; checkpointing's recompute is counted)")
    counting.add_argument("--train", action="store_true",
                          help="count the model in training mode (dropout, batch statistics); default: as built. "
                               "With --device: one more line, whether a training step (forward, backward, "
                               "--optimizer) fits in its memory and the largest micro-batch that does")
    counting.add_argument("--optimizer", choices=OPTIMIZERS,
                          help="add one optimizer step's FLOPs over the trainable parameters")
    counting.add_argument("--memory", action="store_true",
                          help="the step's peak tensor bytes per rank (with --backward: saved activations and "
                               "gradients; with --optimizer: its state and step), by kind and where, the "
                               "allocator's allowance apart, and with --device whether it fits")
    counting.add_argument("--sweep", action="append", default=[], metavar="NAME=VALUES",
                          help="count at many sizes from one capture, with the formula: seq=128,256,1024, "
                               "batch=1..64*2, size[2,3]=160..320:32 (several make a grid; batch, seq, "
                               "size, height, width know their axes, others name them: n[1]=...)")
    counting.add_argument("--step-time", type=float, metavar="SECONDS",
                          help="your measured time of one training step: prints the step's forward + backward "
                               "FLOPs, tokens/s, TFLOP/s, MFU (with --device and --dtype) and the 6N approximation")
    counting.add_argument("--device", metavar="GPU",
                          help="predict each module's latency on this GPU from its FLOPs and bytes (a roofline): "
                               "a name from the peaks table, e.g. 'H100 SXM', 'A100 80GB SXM', 'L4', 'MI300X', "
                               "'TPU v5e'")
    counting.add_argument("--peak-flops", type=_rate, metavar="FLOP/S",
                          help="the dense peak to predict with, e.g. 989.4T or 9.894e14: with --bandwidth for a "
                               "device the table lacks, or with --device to override its peak")
    counting.add_argument("--bandwidth", type=_rate, metavar="BYTES/S",
                          help="the memory bandwidth to predict with, e.g. 3.35T (bytes/s): with --peak-flops, or "
                               "with --device to override its bandwidth")
    predicting = parser.add_argument_group("time prediction")
    predicting.add_argument("--cluster", metavar="NAME|FILE",
                            help="a cluster preset ('DGX A100 80GB', 'DGX H100', 'GB200 NVL72', 'MI300X', 'TPU v5p') "
                                 "or your TOML file; `fxflops explain --cluster NAME` prints every constant of it "
                                 "(and of its GPU) with its source")
    report = parser.add_argument_group("report")
    report.add_argument("--format", default="text", choices=FORMATS,
                        help="html: one self-contained page (zoomable module icicle, sortable tables); "
                             "give --output page.html")
    report.add_argument("--output", "-o", metavar="FILE", help="write the report here instead of stdout")
    report.add_argument("--depth", type=_at_least(-1), default=-1, help="deepest module level shown (-1 = all)")
    report.add_argument("--top", type=_at_least(1), default=3, help="module types per depth in the aggregated profile")
    report.add_argument("--fold", action=argparse.BooleanOptionalAction, default=True,
                        help="fold identical numbered repeats (layers 0-23) into one entry with a count")
    report.add_argument("--detailed", action=argparse.BooleanOptionalAction, default=True,
                        help="include the detailed module tree in the text report")
    report.add_argument("--tablefmt", default="github", help="tabulate format for --format table")
    report.add_argument("--nodes", action="store_true", help="include per-node costs in --format json")
    report.add_argument("--explain", metavar="PATH",
                        help="print why module PATH (or op node PATH) costs what it does: each op's rule, formula, "
                             "bound values and result; '' for the whole model (json with --format json)")
    report.add_argument("--compare", action="store_true",
                        help="count the same capture under every preset side by side, each difference attributed "
                             "to the convention that causes it (json with --format json)")
    report.add_argument("--run-tools", action="store_true",
                        help="with --compare: also run FlopCounterMode, fvcore, ptflops and DeepSpeed where "
                             "installed, and show their own numbers beside ours; fvcore, ptflops and DeepSpeed run "
                             "a real forward, on the model built again on the CPU with random weights when it has "
                             "at most 200 M params")
    report.add_argument("--roofline", metavar="FILE.svg",
                        help="with --device: also write the roofline picture of every module as an SVG image")
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="no progress on a terminal and no note of what --output wrote (warnings stay)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and warnings")
    return parser


def input_options(args: argparse.Namespace) -> InputOptions:
    if args.batch < 1 or (args.seq_len is not None and args.seq_len < 1):
        raise ModelSpecError("--batch and --seq-len must be positive")
    shapes = [parse_input_shape(text) for text in args.input_shape]
    named = [name for name, _ in shapes if name is not None]
    if args.input_dtype is not None and not shapes:
        raise ModelSpecError("--input-dtype sets the dtype of the inputs made from --input-shape; give --input-shape")
    if len(set(named)) < len(named):
        raise ModelSpecError(f"--input-shape names {sorted({n for n in named if named.count(n) > 1})[0]} twice")
    return InputOptions(
        batch=args.batch,
        seq_len=128 if args.seq_len is None else args.seq_len,
        seq_len_given=args.seq_len is not None,
        input_shapes=tuple(shape for name, shape in shapes if name is None),
        named_shapes=tuple((name, shape) for name, shape in shapes if name is not None),
        dtype=parse_dtype(args.dtype),
        input_dtype=parse_dtype(args.input_dtype, INPUT_DTYPES),
        overrides=dict(parse_override(text) for text in args.overrides),
        hf_task=args.hf_task,
        trust_remote_code=args.trust_remote_code,
    )
