"""Options checked before the model is built, so a mistake costs one line instead of an estimate.

Sweep grids, option combinations (--device, --roofline, --format, --explain, --compare,
--step-time, --sweep), the folders --output and --roofline write into, and the user's rule files
(loaded once here, so a bad file is a usage error and its warnings reach stderr) are each refused
with a `ModelSpecError` naming the option and what to give instead.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from fxflops.cli.options import MAX_SWEEP_POINTS, ModelSpecError


def check_sweeps(sweeps: list[tuple[str, tuple[int, ...], list[int]]]) -> None:
    names = [name for name, _, _ in sweeps]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ModelSpecError(f"--sweep {', '.join(repeated)} given twice; give each size once, with all its values")
    points = 1
    for _, _, values in sweeps:
        points *= len(values)
    if points > MAX_SWEEP_POINTS:
        raise ModelSpecError(f"the --sweep grid has {points} points; at most {MAX_SWEEP_POINTS}")


def load_rules(paths: list[str]) -> list | None:
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
    from fxflops.cli.output import say

    for warning in caught:
        say(f"warning: {warning.message}")
    return entries


def check_writable(path: str | None, option: str) -> None:
    """Before the model is built: a report that cannot be written should not cost the estimate first."""
    if path is None:
        return
    folder = Path(path).absolute().parent  # the path as it will be written, not expanded
    if not folder.is_dir():
        raise ModelSpecError(f"{option} {path!r}: the folder {str(folder)!r} does not exist")
    if Path(path).is_dir():
        raise ModelSpecError(f"{option} {path!r} is a folder: give a file name")


def check_device(args: argparse.Namespace, sweeps: list) -> None:
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


def check_step_time(args: argparse.Namespace, sweeps: list) -> None:
    if args.step_time != args.step_time or args.step_time == float("inf"):  # NaN passes "<= 0": asked apart
        raise ModelSpecError(f"--step-time is a step's seconds, a finite number; got {args.step_time:g}")
    if args.step_time <= 0:
        raise ModelSpecError(f"--step-time is a step's seconds, more than 0; got {args.step_time:g}")
    if sweeps or args.output or args.roofline or args.format != "text":
        raise ModelSpecError("--step-time prints one step's FLOPs and MFU as text; it does not combine with "
                             "--sweep, --output, --roofline or --format")
