"""Command line: `fxflops MODEL [options]` prints the estimate; `fxflops examples` lists built-ins.

Errors print one line (`fxflops: error: ...`) and exit non-zero: 2 for a MODEL or option that
cannot be used, 1 when the model cannot be estimated. `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn
from pathlib import Path

from fxflops import examples
from fxflops.capture.diagnosis import CaptureError
from fxflops.capture.methods import AUTO, CHOICES, runs_model
from fxflops.model_spec import (
    HF_TASKS,
    MAX_SWEEP_POINTS,
    InputOptions,
    ModelSpecError,
    load,
    parse_dtype,
    parse_override,
    parse_shape,
    parse_sweep,
)
from fxflops.optimizer import NAMES as OPTIMIZERS
from fxflops.progress import StageProgress
from fxflops.rules import CONVENTIONS, PRESET_TABLE

FORMATS = ("text", "table", "json", "csv", "html")
EXIT_FAILED = 1
EXIT_USAGE = 2

EPILOG = """\
MODEL is one of:
  NAME                    a built-in example: fxflops examples
  torchvision:NAME        e.g. torchvision:resnet50 (weights are never downloaded)
  hf:NAME                 a transformers config class with its defaults, e.g. hf:gpt2,
                          hf:bert-base-uncased, hf:llama
  hf:PATH                 a local config.json (or a folder holding one)
  FILE.py:FACTORY         FACTORY() returns a model, or (model, inputs)
  package.module:FACTORY  likewise, from an importable module
Everything is built on the meta device: no weights are allocated and nothing is computed.

examples:
  fxflops lenet5 --batch 1024 --top 3
  fxflops torchvision:resnet50 --depth 2
  fxflops hf:gpt2 --seq-len 1024 --set n_layer=2 --format table
  fxflops my_model.py:build --input-shape 8,3,224,224 --format json --output cost.json
  fxflops gpt2-small --sweep seq=128..4096*2 --sweep batch=1,8
  fxflops torchvision:resnet50 --sweep size[2,3]=160..320:32
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake costs one line (the whole usage block would bury it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (fxflops --help lists the options)\n")


def _at_least(lowest: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be {lowest} or more, got {value}")
        return value
    parse.__name__ = "int"  # argparse names the type in its message: "invalid int value"
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fxflops",
        description="Estimate MACs, FLOPs and parameters per module of a PyTorch model.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL", help="what to estimate (see below), or 'examples'")
    inputs = parser.add_argument_group("inputs")
    inputs.add_argument("--input-shape", action="append", default=[], metavar="SHAPE",
                        help="shape of one positional input, e.g. 1,3,224,224 (repeat for more inputs)")
    inputs.add_argument("--batch", type=int, default=1, help="batch size of the default inputs (default 1)")
    inputs.add_argument("--seq-len", type=int, default=128, help="sequence length for token models (default 128)")
    inputs.add_argument("--dtype", help="cast model and floating inputs: float32, float16, bfloat16, float64")
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
    counting.add_argument("--method", default=AUTO, choices=CHOICES,
                          help="eager (the default's first try): the model's own forward on fake tensors; "
                               "export; symbolic; trace: one real forward (default auto: each in turn)")
    counting.add_argument("--backward", action="store_true",
                          help="also count the backward autograd runs for the sum of the outputs, op by op "
                               "(frozen parameters get no gradient; checkpointing's recompute is counted)")
    counting.add_argument("--train", action="store_true",
                          help="count the model in training mode (dropout, batch statistics); default: as built")
    counting.add_argument("--optimizer", choices=OPTIMIZERS,
                          help="add one optimizer step's FLOPs over the trainable parameters")
    counting.add_argument("--sweep", action="append", default=[], metavar="NAME=VALUES",
                          help="count at many sizes from one capture, with the formula: seq=128,256,1024, "
                               "batch=1..64*2, size[2,3]=160..320:32 (several make a grid; batch, seq, "
                               "size, height, width know their axes, others name them: n[1]=...)")
    counting.add_argument("--device", metavar="GPU",
                          help="predict each module's latency on this GPU from its FLOPs and bytes (a roofline): "
                               "a name from the peaks table, e.g. 'H100 SXM', 'A100 80GB SXM', 'L4'")
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
    report.add_argument("--roofline", metavar="FILE.svg",
                        help="with --device: also write the roofline picture of every module as an SVG image")
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="no progress on a terminal and no note of what --output wrote (warnings stay)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and warnings")
    return parser


def examples_listing() -> str:
    width = max(len(name) for name in examples.EXAMPLES)
    lines = ["Built-in examples (fxflops NAME [--batch N] [--seq-len N] [--set key=value]):"]
    lines += [f"  {name:<{width}}  {example.description}" for name, example in examples.EXAMPLES.items()]
    return "\n".join(lines) + "\n"


def input_options(args: argparse.Namespace) -> InputOptions:
    if args.batch < 1 or args.seq_len < 1:
        raise ModelSpecError("--batch and --seq-len must be positive")
    return InputOptions(
        batch=args.batch,
        seq_len=args.seq_len,
        input_shapes=tuple(parse_shape(text) for text in args.input_shape),
        dtype=parse_dtype(args.dtype),
        overrides=dict(parse_override(text) for text in args.overrides),
        hf_task=args.hf_task,
        trust_remote_code=args.trust_remote_code,
    )


def render(estimate, args: argparse.Namespace) -> str:
    """The report in the requested format."""
    from fxflops.report.machine import to_csv, to_json
    from fxflops.report.tables import tables
    from fxflops.report.text import render as render_text

    if args.format == "json":
        return to_json(estimate, include_nodes=args.nodes)
    if args.format == "csv":
        return to_csv(estimate)
    if args.format == "html":
        from fxflops.report.html import to_html

        return to_html(estimate, fold=args.fold)
    if args.format == "table":
        return tables(estimate, module_depth=args.depth, fold=args.fold, tablefmt=args.tablefmt)
    return render_text(estimate, module_depth=args.depth, top_modules=args.top,
                       detailed=args.detailed, fold=args.fold)


def _check_sweeps(sweeps: list[tuple[str, tuple[int, ...], list[int]]]) -> None:
    names = [name for name, _, _ in sweeps]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ModelSpecError(f"--sweep {', '.join(repeated)} given twice; give each size once, with all its values")
    points = 1
    for _, _, values in sweeps:
        points *= len(values)
    if points > MAX_SWEEP_POINTS:
        raise ModelSpecError(f"the --sweep grid has {points} points; at most {MAX_SWEEP_POINTS}")


def run_sweep(model, loaded, sweeps: list[tuple[str, tuple[int, ...], list[int]]], args: argparse.Namespace):
    """Capture once with the swept sizes symbolic; the result at every point of the grid."""
    from fxflops.sweeps import sweep

    swept = sweep(model, loaded.args, loaded.kwargs, dims={name: axes for name, axes, _ in sweeps},
                  method=args.method, conventions=args.conventions, rules=args.rules, backward=args.backward,
                  optimizer=args.optimizer)
    return swept.result({name: values for name, _, values in sweeps})


def render_sweep(result, args: argparse.Namespace) -> str:
    from fxflops.report import sweep as report

    depth = args.depth if args.depth > 0 else 1
    if args.format == "json":
        return report.to_json(result, depth=depth, top=args.top)
    if args.format == "csv":
        return report.to_csv(result)
    return report.render_text(result, depth=depth, top=args.top,
                              tablefmt=args.tablefmt if args.format == "table" else "github")


def run(args: argparse.Namespace) -> int:
    if args.model == "examples":
        sys.stdout.write(examples_listing())
        return 0
    sweeps = [parse_sweep(text) for text in args.sweep]
    _check_sweeps(sweeps)
    _check_device(args, sweeps)
    _check_writable(args.output, "--output")
    _check_writable(args.roofline, "--roofline")
    args.rules = _load_rules(args.rules)
    progress = StageProgress.on_terminal(sys.stderr, quiet=args.quiet)
    try:
        result, report = _estimate_and_render(args, sweeps, progress)
    finally:
        progress.done()
    if args.roofline:
        from fxflops.report.roofline import roofline_svg

        Path(args.roofline).write_text(roofline_svg(result, result.prediction), encoding="utf-8")
        if not args.quiet:
            sys.stderr.write(f"fxflops: wrote the roofline of {result.model_type} to {args.roofline}\n")
    if args.output:
        Path(args.output).write_text(report, encoding="utf-8")
        if not args.quiet:
            sys.stderr.write(f"fxflops: wrote the {args.format} report on {result.model_type} to {args.output}\n")
    else:
        sys.stdout.write(report)
    return 0


def _load_rules(paths: list[str]) -> list | None:
    """The user's rule files, loaded once before the model, so a bad file fails fast (as a usage error)
    and a warning about one (an op that names nothing) reaches stderr past the CLI's quiet warnings."""
    if not paths:
        return None
    from fxflops.rules import RuleFileError, load_user_entries

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            entries = load_user_entries(paths)
        except RuleFileError as error:
            raise ModelSpecError(str(error)) from None
    for warning in caught:
        sys.stderr.write(f"fxflops: warning: {warning.message}\n")
    return entries


def _check_writable(path: str | None, option: str) -> None:
    """Before the model is built: a report that cannot be written should not cost the estimate first."""
    if path is None:
        return
    folder = Path(path).absolute().parent  # the path as it will be written, not expanded
    if not folder.is_dir():
        raise ModelSpecError(f"{option} {path!r}: the folder {str(folder)!r} does not exist")
    if Path(path).is_dir():
        raise ModelSpecError(f"{option} {path!r} is a folder: give a file name")


def _check_device(args: argparse.Namespace, sweeps: list) -> None:
    from fxflops import peaks

    if args.roofline and not args.device:
        raise ModelSpecError("--roofline draws a device's roofs: give --device too, e.g. --device 'H100 SXM'")
    if args.format == "html" and sweeps:
        raise ModelSpecError("--format html shows one estimate; a --sweep writes text, table, json or csv")
    if args.device and sweeps:
        raise ModelSpecError("--device predicts one estimate's latency; it does not combine with --sweep")
    if args.device:
        try:
            peaks.named(args.device)
        except ValueError as error:
            raise ModelSpecError(f"--{error}") from None


def _estimate_and_render(args: argparse.Namespace, sweeps: list, progress: StageProgress) -> tuple:
    from fxflops.api import estimate

    progress(f"loading {args.model}")
    loaded = load(args.model, input_options(args))
    progress.done()
    for note in loaded.notes:
        sys.stderr.write(f"fxflops: note: {note}\n")
    model = loaded.model.train() if args.train else loaded.model
    if sweeps:
        progress("capturing with symbolic sizes, then counting every point")
        result = run_sweep(model, loaded, sweeps, args)
        progress.done()
        _say_cautions(result.cautions, args)
        progress("writing the report")
        return result, render_sweep(result, args)
    result = estimate(model, loaded.args, loaded.kwargs, method=args.method, conventions=args.conventions,
                      rules=args.rules, backward=args.backward, optimizer=args.optimizer,
                      progress=lambda stage: progress(_STAGE_WORDS.get(stage, stage)))
    if args.device:
        result.prediction = result.predict(args.device)
    progress.done()  # warnings start on a clean line
    _say_what_ran_on(result, loaded)
    _say_cautions(result.cautions, args)
    progress("writing the report")
    return result, render(result, args)


def _say_cautions(cautions: list[str], args: argparse.Namespace) -> None:
    if not args.debug:  # with --debug, the CautionWarning itself is shown
        for caution in cautions:
            sys.stderr.write(f"fxflops: warning: {caution}\n")


_STAGE_WORDS = {"capture": "capturing the forward", "count": "counting every op"}


def _say_what_ran_on(result, loaded) -> None:
    """A count that ran the model on inputs fxflops made up is a count for those values: say so."""
    if loaded.made_up is None or not runs_model(result.method):
        return
    result.input_values = loaded.made_up
    if result.attempts:  # the static methods failed: the forward most likely reads tensor values
        how = (f"could only be counted by running it ({result.method}), on {loaded.made_up}; its control flow "
               "or sizes likely depend on tensor values, so the count holds for those values only")
    else:
        how = (f"was counted by running it ({result.method}), on {loaded.made_up}; if its control flow "
               "depends on tensor values, the count holds for those values only")
    sys.stderr.write(f"fxflops: warning: {result.model_type} {how}. For real inputs, return (model, inputs) "
                     "from the factory.\n")


def _one_line(error: BaseException) -> str:
    if isinstance(error, CaptureError):
        return error.summary() + " (--debug shows every attempt)"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    first = lines[0] if lines else type(error).__name__
    used = 1
    while first.endswith(":") and used < len(lines):  # the detail follows on the next line
        first, used = f"{first} {lines[used]}", used + 1
    return first + (" (--debug shows the details)" if used < len(lines) else "")


@contextlib.contextmanager
def _library_logging_quiet() -> Iterator[None]:
    """Errors only from the libraries that build models (transformers logs its config on load), for the
    duration of the command; --debug leaves them as they are."""
    loggers = [logging.getLogger(name) for name in ("transformers", "torch")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.debug:
        return run(args)
    try:
        with warnings.catch_warnings(), _library_logging_quiet():
            # The report lists unknown ops itself; library chatter would bury it.
            warnings.simplefilter("ignore")
            return run(args)
    except ModelSpecError as error:
        print(f"fxflops: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # a one-line message; --debug gives the traceback
        print(f"fxflops: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
