"""Running one command: an estimate, a sweep, --explain / --compare, or a training step's MFU.

`run` checks the options, builds the MODEL (`model_spec.load`), runs the estimate or the sweep
with the stage progress on a terminal, and writes the report and the roofline where they were asked
for; `fxflops examples` prints the built-ins instead. With `--step-time` it prints one training
step's FLOPs, FLOP/s and MFU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fxflops.cli.checks import check_device, check_step_time, check_sweeps, check_writable, load_rules
from fxflops.cli.factories import ZERO_INPUTS
from fxflops.cli.model_spec import load
from fxflops.cli.options import ModelSpecError, parse_dtype, parse_sweep
from fxflops.cli.output import (
    _Encodable,
    _say_cautions,
    _say_what_ran_on,
    _write_report,
    examples_listing,
    on_terminal,
    render,
    render_sweep,
    say,
)
from fxflops.cli.parser import input_options
from fxflops.cli.progress import StageProgress


def run_sweep(model, loaded, sweeps: list[tuple[str, tuple[int, ...], list[int]]], args: argparse.Namespace):
    """Capture once with the swept sizes symbolic: the Sweep (its points are counted as they are written)."""
    from fxflops.sweeps import sweep

    return sweep(model, loaded.args, loaded.kwargs, dims={name: axes for name, axes, _ in sweeps},
                 method=args.method, conventions=args.conventions, rules=args.rules, backward=args.backward,
                 optimizer=args.optimizer, attention=args.attention, strict=args.fail_on_unknown)


def run(args: argparse.Namespace) -> int:
    if args.model == "examples":
        sys.stdout.write(examples_listing())
        return 0
    if args.model == "explain":
        _Encodable(sys.stdout).write(_hardware_constants(args))
        return 0
    sweeps = [parse_sweep(text) for text in args.sweep]
    check_sweeps(sweeps)
    if sweeps and args.parallel:
        raise ModelSpecError("--parallel with --sweep is not built yet: estimate one plan at a time")
    check_device(args, sweeps)
    check_writable(args.output, "--output")
    check_writable(args.roofline, "--roofline")
    args.rules = load_rules(args.rules)
    progress = StageProgress.on_terminal(sys.stderr, quiet=args.quiet)
    if args.step_time is not None:
        check_step_time(args, sweeps)
        try:
            _Encodable(sys.stdout).write(_training_step(args, progress))
        finally:
            progress.done()
        return 0
    try:
        result, report, fits = _estimate_and_render(args, sweeps, progress)
    finally:
        progress.done()
    from fxflops.report.formats import ENCODING_ERRORS

    if args.roofline:
        from fxflops.report.roofline import roofline_svg

        Path(args.roofline).write_text(roofline_svg(result, result.prediction), encoding="utf-8",
                                       errors=ENCODING_ERRORS)
        if not args.quiet:
            say(f"wrote the roofline of {result.model_type} to {args.roofline}")
    if args.output:
        with open(args.output, "w", encoding="utf-8", errors=ENCODING_ERRORS) as stream:
            _write_report(report, stream)
        if not args.quiet:
            say(f"wrote the {args.format} report on {result.model_type} to {args.output}")
    else:
        _write_report(report, _Encodable(sys.stdout))
    if fits:  # --train --device: the one line on the step's fit (stdout under a text report there, else stderr)
        if args.format == "text" and not args.output:
            _Encodable(sys.stdout).write(fits + "\n")
        else:
            say(fits)
    if sweeps:  # the points' cautions (a lookup past a table), each once, once they are counted
        _say_cautions(list(getattr(result, "cautions", ())), args, on_terminal(report, args))
    return 0


def _memory_options(args: argparse.Namespace, sweeps: list) -> object:
    """--memory: False, or the MemoryOptions to estimate with (the --device's memory, checked before loading)."""
    if not getattr(args, "memory", False):
        return False
    if sweeps:
        raise ModelSpecError("--memory estimates one step's peak; it does not combine with --sweep")
    from fxflops.memory import MemoryOptions
    from fxflops.memory.devices import device_capacity

    if not args.device:
        return MemoryOptions()
    try:
        label, capacity = device_capacity(args.device)
    except ValueError as error:
        raise ModelSpecError(f"--memory --device: {error}") from None
    return MemoryOptions(device=label, device_bytes=capacity)


def _estimate_and_render(args: argparse.Namespace, sweeps: list, progress: StageProgress) -> tuple:
    memory = _memory_options(args, sweeps)
    progress(f"loading {args.model}")
    loaded = load(args.model, input_options(args))
    progress.done()
    for note in loaded.notes:
        say(f"note: {note}")
    model = loaded.model.train() if args.train else loaded.model
    if sweeps and args.explain is not None:
        return (*_explain_sweep(model, loaded, sweeps, args, progress), None)
    if sweeps:
        progress("capturing with symbolic sizes")
        swept = run_sweep(model, loaded, sweeps, args)
        progress.done()
        _say_cautions(loaded.cautions, args)  # how the model was built; the points' own come with them
        progress("counting every point")
        return swept, render_sweep(swept, sweeps, args), None
    result = _estimate_on_shapes(model, loaded, args, method=args.method, conventions=args.conventions,
                                 rules=args.rules, backward=args.backward, optimizer=args.optimizer,
                                 attention=args.attention, strict=args.fail_on_unknown, parallel=args.parallel,
                                 replay=args.replay,
                                 progress=lambda stage: progress(_STAGE_WORDS.get(stage, stage)), memory=memory)
    result.cautions[:0] = loaded.cautions  # how the model was built comes first
    if args.device or args.peak_flops is not None:
        result.prediction = result.predict(args.device, peak_flops=args.peak_flops, bandwidth=args.bandwidth)
    progress.done()  # warnings start on a clean line
    _say_what_ran_on(result, loaded)
    progress("writing the report")
    report = _views(result, loaded, model, args) if args.explain is not None or args.compare else render(result, args)
    progress.done()
    _say_cautions(result.cautions, args, on_terminal(report, args))
    fits = None
    if args.train and args.device and args.explain is None and not args.compare:
        from fxflops.cli.fit import fit_line

        progress("fitting the training step in memory")
        fits = fit_line(model, loaded, args)
        progress.done()
    return result, report, fits


_NOT_RUN_ON_ZEROS = ("not run on all-zero inputs: nothing failed on a tensor's value, so a run would fail alike. "
                     "Check --input-shape against the model's forward, and --input-dtype (e.g. long for token "
                     "ids or an nn.Embedding's indices; default floating)")


def _estimate_on_shapes(model, loaded, args: argparse.Namespace, **options):
    """estimate() on the loaded inputs. Inputs made from --input-shape are meta tensors; a model with real
    weights that can be counted only by running it (--method trace, or every static method failed on a
    tensor's value) runs on all-zero tensors made then, and says so (loaded.made_up). A static failure of
    another kind (a dtype, a shape) would fail on zeros alike: it is reported, and nothing is allocated."""
    from fxflops.api import estimate
    from fxflops.capture import CaptureError
    from fxflops.capture.methods import AUTO, TRACE

    if loaded.real_inputs is None or options["method"] not in (AUTO, TRACE.name):
        return estimate(model, loaded.args, loaded.kwargs, **options)
    failed: list = []
    if options["method"] == AUTO:
        try:
            return estimate(model, loaded.args, loaded.kwargs, **options)
        except CaptureError as error:  # (trace was skipped: the inputs hold no values)
            static = [a for a in error.attempts if a.method != TRACE.name]
            if not any(a.reads_values for a in static):
                ops = sorted({a.op for a in static if a.op})
                error.advice = (f"failed at op {', '.join(ops)}; " if ops else "") + _NOT_RUN_ON_ZEROS
                raise
            failed = [(a.method, a.reason) for a in static]
    loaded.args, loaded.kwargs = loaded.real_inputs()
    loaded.made_up = ZERO_INPUTS
    result = estimate(model, loaded.args, loaded.kwargs, **{**options, "method": TRACE.name})
    result.attempts[:0] = failed
    return result


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
            if loaded.real_inputs is not None and loaded.made_up is None:  # the tools run the model: real inputs
                loaded.args, loaded.kwargs = loaded.real_inputs()
            comparison.run_tools(*_real_for_tools(args, loaded, model, result.total_params))
        parts.append(comparison)
    if args.format == "json":
        import json
        from collections.abc import Mapping

        data = [part.to_dict() for part in parts]
        return json.dumps(data[0] if len(data) == 1 else data, indent=2) + "\n"
    return "\n\n".join(str(part) for part in parts) + "\n"


def _real_for_tools(args: argparse.Namespace, loaded, model, params: int) -> tuple:
    """(model, args, kwargs, why_not_real) for --run-tools: fvcore, ptflops and DeepSpeed run a real
    forward, so a model built on the meta device is built again on the CPU with random weights and zero
    inputs when it is at most REAL_PARAMS_LIMIT parameters; otherwise the meta one, and why, in one line."""
    import dataclasses

    from fxflops.report.formats import params_to_string
    from fxflops.tool_runs import REAL_PARAMS_LIMIT, on_meta, real_tools_installed

    if not on_meta(model, loaded.args, loaded.kwargs) or not real_tools_installed():
        return model, loaded.args, loaded.kwargs, ""
    if params > REAL_PARAMS_LIMIT:
        return model, loaded.args, loaded.kwargs, (
            f"--run-tools builds models of at most {params_to_string(REAL_PARAMS_LIMIT)} params with real weights "
            f"({args.model} has {params_to_string(params)}): run the tool from Python on a model you built")
    rebuilt = load(args.model, dataclasses.replace(input_options(args), device="cpu"))
    real = rebuilt.model.train() if args.train else rebuilt.model
    if on_meta(real, rebuilt.args, rebuilt.kwargs):
        return model, loaded.args, loaded.kwargs, (
            f"{args.model} builds its model or inputs on the meta device itself; have it build them on the CPU")
    return real, rebuilt.args, rebuilt.kwargs, ""


def _explain_sweep(model, loaded, sweeps: list, args: argparse.Namespace, progress: StageProgress) -> tuple:
    """--explain with --sweep: the explanation with sizes as formulas in the swept names."""
    from fxflops.sweeps import sweep

    progress("capturing with symbolic sizes")
    swept = sweep(model, loaded.args, loaded.kwargs, dims={name: axes for name, axes, _ in sweeps},
                  method=args.method, conventions=args.conventions, rules=args.rules,
                  backward=args.backward, attention=args.attention, strict=args.fail_on_unknown)
    progress.done()
    try:
        explanation = swept.explain(args.explain)
    except KeyError as error:
        raise ModelSpecError(f"--explain: {error.args[0]}") from None
    if args.format == "json":
        import json
        from collections.abc import Mapping

        return swept, json.dumps(explanation.to_dict(), indent=2) + "\n"
    return swept, str(explanation) + "\n"


def _training_step(args: argparse.Namespace, progress: StageProgress) -> str:
    """One training step's exact FLOPs over the measured --step-time: FLOP/s, MFU, tokens/s and 6N."""
    from fxflops.device import peaks
    from fxflops.timing.meter import StepStats, attention_flops, non_embedding_params
    from fxflops.capture.tensor_walk import tensors_in
    from fxflops.report.mfu import render_step

    progress(f"loading {args.model}")
    loaded = load(args.model, input_options(args))
    model = loaded.model.train() if args.train else loaded.model
    progress("capturing the forward and the backward")
    result = _estimate_on_shapes(model, loaded, args, method=args.method, conventions=args.conventions,
                                 rules=args.rules, backward=True, optimizer=args.optimizer,
                                 strict=args.fail_on_unknown)
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


_STAGE_WORDS = {"capture": "capturing the forward", "count": "counting every op"}


def _hardware_constants(args: argparse.Namespace) -> str:
    """`fxflops explain --cluster NAME` / `--device NAME`: every constant of the time model with its source."""
    from fxflops.predict.hardware import cluster, constants_text, device_model, preset_names

    if not (args.cluster or args.device):
        raise ModelSpecError("explain prints the time model's constants and their sources: give --cluster NAME "
                             f"({', '.join(preset_names('clusters'))}) or --device NAME, or a TOML file's path "
                             "(to explain a model's count: fxflops MODEL --explain PATH)")
    try:
        thing = cluster(args.cluster) if args.cluster else device_model(args.device)
    except ValueError as error:
        raise ModelSpecError(f"{'--cluster' if args.cluster else '--device'}: {error}") from None
    if args.format == "json":
        import json
        from collections.abc import Mapping

        from fxflops.predict.hardware import constants

        rows = [{"name": name, "value": dict(value) if isinstance(value, Mapping) else value, "unit": unit,
                 "source": source}
                for name, value, unit, source in constants(thing)]
        return json.dumps({"name": thing.name, "origin": thing.origin, "constants": rows}, indent=2) + "\n"
    return constants_text(thing)
