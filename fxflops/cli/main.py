"""Command line: `fxflops MODEL [options]` prints the estimate; `fxflops examples` lists built-ins.

Errors print one line (`fxflops: error: ...`) and exit non-zero: 2 for a MODEL or option that
cannot be used, 1 when the model cannot be estimated. `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn, TextIO
from pathlib import Path

from fxflops.cli import examples
from fxflops.capture.diagnosis import CaptureError
from fxflops.capture.methods import AUTO, CHOICES, runs_model
from fxflops.cli.model_spec import (
    HF_TASKS,
    MAX_SWEEP_POINTS,
    InputOptions,
    ModelSpecError,
    known_checkpoints,
    load,
    parse_dtype,
    parse_input_shape,
    parse_override,
    parse_sweep,
)
from fxflops.optimizer import NAMES as OPTIMIZERS
from fxflops.cli.progress import StageProgress
from fxflops.rules import CONVENTIONS, PRESET_TABLE

FORMATS = ("text", "table", "json", "csv", "html")
EXIT_FAILED = 1
EXIT_USAGE = 2

EPILOG = """\
MODEL is one of:
  NAME                    a built-in example: fxflops examples
  torchvision:NAME        e.g. torchvision:resnet50 (weights are never downloaded)
  hf:NAME                 a checkpoint fxflops knows the config of (fxflops examples lists them),
                          e.g. hf:gpt2, hf:facebook/opt-350m; or a model type with its config
                          class's defaults (hf:llama, said in the report); nothing is downloaded
  hf:PATH                 a local config.json (or a folder holding one)
  FILE.py:FACTORY         FACTORY() returns a model, or (model, inputs)
  package.module:FACTORY  likewise, from an importable module
Everything is built on the meta device: no weights are allocated and nothing is computed.

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
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (fxflops --help lists the options)\n")


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
    parser.add_argument("model", metavar="MODEL", help="what to estimate (see below), or 'examples'")
    inputs = parser.add_argument_group("inputs")
    inputs.add_argument("--input-shape", action="append", default=[], metavar="[NAME=]SHAPE",
                        help="shape of one positional input, e.g. 1,3,224,224, or of a keyword input by "
                             "name, e.g. input_ids=2,16 (repeat for more inputs)")
    inputs.add_argument("--batch", type=int, default=1, help="batch size of the default inputs (default 1)")
    inputs.add_argument("--seq-len", type=int, help="sequence length for token models (default 128; refused for "
                                                   "models that take no token sequence)")
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
    counting.add_argument("--attention", default="dense", choices=("dense", "effective"),
                          help="how attention ops count in the totals: dense (every (query, key) pair, as "
                               "FlopCounterMode) or effective (only the pairs causal / sliding-window masks "
                               "keep); the summary shows both when they differ")
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
                             "installed, and show their own numbers beside ours")
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
    lines += ["", "Checkpoints hf:NAME builds from their published configs (nothing is downloaded):"]
    lines += textwrap.wrap(", ".join(known_checkpoints()), width=100, initial_indent="  ", subsequent_indent="  ",
                           break_on_hyphens=False)
    return "\n".join(lines) + "\n"


def input_options(args: argparse.Namespace) -> InputOptions:
    if args.batch < 1 or (args.seq_len is not None and args.seq_len < 1):
        raise ModelSpecError("--batch and --seq-len must be positive")
    shapes = [parse_input_shape(text) for text in args.input_shape]
    named = [name for name, _ in shapes if name is not None]
    if len(set(named)) < len(named):
        raise ModelSpecError(f"--input-shape names {sorted({n for n in named if named.count(n) > 1})[0]} twice")
    return InputOptions(
        batch=args.batch,
        seq_len=128 if args.seq_len is None else args.seq_len,
        seq_len_given=args.seq_len is not None,
        input_shapes=tuple(shape for name, shape in shapes if name is None),
        named_shapes=tuple((name, shape) for name, shape in shapes if name is not None),
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
    """Capture once with the swept sizes symbolic: the Sweep (its points are counted as they are written)."""
    from fxflops.sweeps import sweep

    return sweep(model, loaded.args, loaded.kwargs, dims={name: axes for name, axes, _ in sweeps},
                 method=args.method, conventions=args.conventions, rules=args.rules, backward=args.backward,
                 optimizer=args.optimizer, attention=args.attention)


def render_sweep(swept, sweeps: list, args: argparse.Namespace) -> str | Callable[[TextIO], None]:
    """The text report, or a writer that streams the JSON / CSV one point at a time."""
    from fxflops.report import sweep as report

    grid = {name: values for name, _, values in sweeps}
    depth = args.depth if args.depth > 0 else 1
    if args.format == "json":
        return lambda stream: report.write_json(swept, grid, stream, depth=depth, top=args.top)
    if args.format == "csv":
        return lambda stream: report.write_csv(swept, grid, stream)
    return report.render_text(swept.result(grid, depth=depth, top=args.top),
                              tablefmt=args.tablefmt if args.format == "table" else "github")


class _Encodable:
    """A stream whose write() escapes what its encoding cannot hold (a lone surrogate in a module name)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        from fxflops.report.formats import encodable

        return self._stream.write(encodable(text, getattr(self._stream, "encoding", None)))


def _write_report(report: str | Callable[[TextIO], None], stream: TextIO) -> None:
    if callable(report):
        report(stream)
    else:
        stream.write(report)


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
    if args.step_time is not None:
        _check_step_time(args, sweeps)
        try:
            sys.stdout.write(_training_step(args, progress))
        finally:
            progress.done()
        return 0
    try:
        result, report = _estimate_and_render(args, sweeps, progress)
    finally:
        progress.done()
    from fxflops.report.formats import ENCODING_ERRORS

    if args.roofline:
        from fxflops.report.roofline import roofline_svg

        Path(args.roofline).write_text(roofline_svg(result, result.prediction), encoding="utf-8",
                                       errors=ENCODING_ERRORS)
        if not args.quiet:
            sys.stderr.write(f"fxflops: wrote the roofline of {result.model_type} to {args.roofline}\n")
    if args.output:
        with open(args.output, "w", encoding="utf-8", errors=ENCODING_ERRORS) as stream:
            _write_report(report, stream)
        if not args.quiet:
            sys.stderr.write(f"fxflops: wrote the {args.format} report on {result.model_type} to {args.output}\n")
    else:
        _write_report(report, _Encodable(sys.stdout))
    if sweeps:  # the points' cautions (a lookup past a table), each once, once they are counted
        _say_cautions(list(getattr(result, "cautions", ())), args)
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
    from fxflops.device import peaks

    given = args.peak_flops is not None or args.bandwidth is not None
    if args.device is not None and not args.device.strip():  # "" would otherwise mean: no --device
        raise ModelSpecError("--device is empty: name a GPU from the peaks table, e.g. --device 'H100 SXM'")
    if args.roofline is not None and Path(args.roofline).suffix.lower() != ".svg":
        raise ModelSpecError(f"--roofline {args.roofline!r}: the roofline is an SVG image; give a file name ending "
                             "in .svg")
    if args.roofline and not (args.device or given):
        raise ModelSpecError("--roofline draws a device's roofs: give --device too, e.g. --device 'H100 SXM'")
    if args.format == "html" and sweeps:
        raise ModelSpecError("--format html shows one estimate; a --sweep writes text, table, json or csv")
    if args.run_tools and not args.compare:
        raise ModelSpecError("--run-tools runs the other counters for --compare: give --compare too")
    if (args.explain is not None or args.compare) and args.format not in ("text", "json"):
        raise ModelSpecError("--explain and --compare print text or json (--format text|json)")
    if args.compare and sweeps:
        raise ModelSpecError("--compare counts one estimate under every preset; it does not combine with --sweep")
    if (args.device or given) and sweeps:
        raise ModelSpecError("--device predicts one estimate's latency; it does not combine with --sweep")
    if not args.device and given and (args.peak_flops is None or args.bandwidth is None):
        missing = "--bandwidth" if args.bandwidth is None else "--peak-flops"
        raise ModelSpecError(f"without --device, a prediction needs both --peak-flops and --bandwidth: give {missing} "
                             "too, or --device to take it from")
    if args.device:
        try:
            peaks.named(args.device)
        except ValueError as error:
            raise ModelSpecError(f"--{error}; for another device give --peak-flops and --bandwidth") from None


def _estimate_and_render(args: argparse.Namespace, sweeps: list, progress: StageProgress) -> tuple:
    from fxflops.api import estimate

    progress(f"loading {args.model}")
    loaded = load(args.model, input_options(args))
    progress.done()
    for note in loaded.notes:
        sys.stderr.write(f"fxflops: note: {note}\n")
    model = loaded.model.train() if args.train else loaded.model
    if sweeps and args.explain is not None:
        return _explain_sweep(model, loaded, sweeps, args, progress)
    if sweeps:
        progress("capturing with symbolic sizes")
        swept = run_sweep(model, loaded, sweeps, args)
        progress.done()
        _say_cautions(loaded.cautions, args)  # how the model was built; the points' own come with them
        progress("counting every point")
        return swept, render_sweep(swept, sweeps, args)
    result = estimate(model, loaded.args, loaded.kwargs, method=args.method, conventions=args.conventions,
                      rules=args.rules, backward=args.backward, optimizer=args.optimizer, attention=args.attention,
                      progress=lambda stage: progress(_STAGE_WORDS.get(stage, stage)))
    result.cautions[:0] = loaded.cautions  # how the model was built comes first
    if args.device or args.peak_flops is not None:
        result.prediction = result.predict(args.device, peak_flops=args.peak_flops, bandwidth=args.bandwidth)
    progress.done()  # warnings start on a clean line
    _say_what_ran_on(result, loaded)
    _say_cautions(result.cautions, args)
    progress("writing the report")
    if args.explain is not None or args.compare:
        return result, _views(result, loaded, model, args)
    return result, render(result, args)


def _views(result, loaded, model, args: argparse.Namespace) -> str:
    """--explain and --compare: views of the estimate instead of the report."""
    parts = []
    if args.explain is not None:
        try:
            explanation = result.explain(args.explain)
        except KeyError as error:
            raise ModelSpecError(f"--explain: {error.args[0]}") from None
        parts.append(explanation)
    if args.compare:
        comparison = result.compare()
        if args.run_tools:
            comparison.run_tools(model, loaded.args, loaded.kwargs)
        parts.append(comparison)
    if args.format == "json":
        import json

        data = [part.to_dict() for part in parts]
        return json.dumps(data[0] if len(data) == 1 else data, indent=2) + "\n"
    return "\n\n".join(str(part) for part in parts) + "\n"


def _explain_sweep(model, loaded, sweeps: list, args: argparse.Namespace, progress: StageProgress) -> tuple:
    """--explain with --sweep: the explanation with sizes as formulas in the swept names."""
    from fxflops.sweeps import sweep

    progress("capturing with symbolic sizes")
    swept = sweep(model, loaded.args, loaded.kwargs, dims={name: axes for name, axes, _ in sweeps},
                  method=args.method, conventions=args.conventions, rules=args.rules, backward=args.backward,
                  attention=args.attention)
    progress.done()
    try:
        explanation = swept.explain(args.explain)
    except KeyError as error:
        raise ModelSpecError(f"--explain: {error.args[0]}") from None
    if args.format == "json":
        import json

        return swept, json.dumps(explanation.to_dict(), indent=2) + "\n"
    return swept, str(explanation) + "\n"


def _check_step_time(args: argparse.Namespace, sweeps: list) -> None:
    if args.step_time <= 0:
        raise ModelSpecError(f"--step-time is a step's seconds, more than 0; got {args.step_time:g}")
    if sweeps or args.output or args.roofline or args.format != "text":
        raise ModelSpecError("--step-time prints one step's FLOPs and MFU as text; it does not combine with "
                             "--sweep, --output, --roofline or --format")


def _training_step(args: argparse.Namespace, progress: StageProgress) -> str:
    """One training step's exact FLOPs over the measured --step-time: FLOP/s, MFU, tokens/s and 6N."""
    from fxflops.device import peaks
    from fxflops.api import estimate
    from fxflops.timing.meter import StepStats, attention_flops, non_embedding_params
    from fxflops.capture.inputs import tensors_in
    from fxflops.report.mfu import render_step

    progress(f"loading {args.model}")
    loaded = load(args.model, input_options(args))
    model = loaded.model.train() if args.train else loaded.model
    progress("capturing the forward and the backward")
    result = estimate(model, loaded.args, loaded.kwargs, method=args.method, conventions=args.conventions,
                      rules=args.rules, backward=True, optimizer=args.optimizer)
    progress.done()
    first = next(iter(tensors_in((loaded.args, loaded.kwargs))), None)
    samples = int(first.shape[0]) if first is not None and first.dim() else 1
    tokens = int(first.numel()) if first is not None and first.dim() == 2 and not first.is_floating_point() else None
    seq = tokens // samples if tokens is not None else None
    peak, source = getattr(args, "peak_flops", None), "--peak-flops"  # i21a's flag, where it exists
    if peak is None and args.device:
        row = peaks.named(args.device)
        key = peaks.dtype_key(parse_dtype(args.dtype) or parse_dtype("float32"))
        peak = row.flops.get(key) if key else None
        source = f"{row.label} {key} dense, {row.source}" if peak else None
    stats = StepStats(step=1, micro_batches=1, fwd_flops=result.fwd_flops, bwd_flops=result.bwd_flops, samples=samples,
                      tokens=tokens, six_n_flops=6 * non_embedding_params(model) * tokens if tokens else None,
                      attention_flops=attention_flops(model, samples, seq) if tokens else None,
                      optimizer_flops=result.optimizer.flops if result.optimizer else None, peak_flops=peak,
                      _time=args.step_time)
    shape = f"batch {samples}" + (f" x seq {seq}" if seq else "")
    return render_step(result.model_type, shape, stats, source)


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
