"""Measured beats predicted: fit a device's efficiency constants from measured per-op times, and write them
as a device file the time model then reads (`device_model(path)`, `--device PATH`).

It needs times measured on the GPU itself (a short `fxflops.profile()` run, or your own timings of single
ops): nothing here measures. Three constants are fitted, each from the ops that show it:

- `launch_overhead`: the median time of the tiny ops (at most `tiny_bytes` moved and no MACs), whose
  roofline time is negligible;
- `sustained_bandwidth`: the median of bytes / (time - overhead) over the memory-bound ops, over the
  datasheet bandwidth;
- `gemm_size_correction`: for the compute-bound GEMMs, measured over modelled efficiency, the median per
  octave of size = (M*N*K)**(1/3) (the curve the model multiplies by; 1.0 = the model was right).

Everything else stays as the base device has it. The fitted constants cite the run they came from.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fxflops.predict.hardware import DeviceModel, device_model, with_constant
from fxflops.predict.op_time import GEMM, MEMORY, NONE, dtype_key, gemm_shape, op_kind, op_time
from fxflops.results.captured import FORWARD
from fxflops.results.costs import NodeCost

TINY_BYTES = 64 * 1024


def pairs_from_profile(profile: Any) -> list[tuple[NodeCost, float]]:
    """(op, seconds) pairs from a `fxflops.profile()` result: a module whose forward runs exactly one timed op
    per call (an nn.Linear, a norm, an activation module) gives its op and latency / calls. Modules that
    run several ops are left out: their time cannot be split among them."""
    pairs = []
    by_module: dict[str, list[NodeCost]] = {}
    for node in profile.nodes:
        if node.phase == FORWARD and op_kind(node) != NONE:
            by_module.setdefault(node.module, []).append(node)
    for name, stats in profile.modules.items():
        nodes = by_module.get(name, [])
        calls = stats.latency_calls or stats.calls
        if not stats.latency or not calls or len(nodes) != calls or stats.children:
            continue
        if len({(n.op, n.input_shapes) for n in nodes}) != 1:  # calls of different shapes: no one time each
            continue
        pairs.append((nodes[0], stats.latency / calls))
    return pairs


def calibrate(measured: Iterable[tuple[NodeCost, float]] | Any, base: DeviceModel | str, dtype: Any,
              path: str | Path | None = None, label: str = "a measured run",
              tiny_bytes: int = TINY_BYTES) -> DeviceModel:
    """The base device with launch_overhead, sustained_bandwidth and gemm_size_correction fitted to `measured`
    ((NodeCost, seconds) pairs, or a profile: see pairs_from_profile). With `path`, also written there as a
    device file (`base = ...` plus the fitted constants, each citing `label`)."""
    pairs = pairs_from_profile(measured) if hasattr(measured, "modules") else list(measured)
    pairs = [(node, float(seconds)) for node, seconds in pairs if seconds > 0 and op_kind(node) != NONE]
    if not pairs:
        raise ValueError("calibrate: no measured op to fit (give (NodeCost, seconds) pairs with times > 0, or a "
                         "profile whose modules each run one op)")
    device = device_model(base)
    key = dtype_key(dtype)
    fitted: dict[str, tuple[Any, str]] = {}

    tiny = [s for node, s in pairs if node.bytes <= tiny_bytes and not node.macs]
    if tiny:
        overhead = statistics.median(tiny)
        fitted["launch_overhead"] = (overhead, f"median time of {len(tiny)} tiny ops in {label}")
        device = with_constant(device, "launch_overhead", overhead, fitted["launch_overhead"][1])

    memory = [(node, s) for node, s in pairs if op_kind(node) == MEMORY and node.bytes > tiny_bytes]
    rates = [node.bytes / (s - device.launch_overhead) for node, s in memory if s > device.launch_overhead]
    if rates:
        fraction = min(statistics.median(rates) / device.hbm_bandwidth, 1.0)
        fitted["sustained_bandwidth"] = (fraction, f"median of {len(rates)} memory-bound ops in {label}")
        device = with_constant(device, "sustained_bandwidth", fraction, fitted["sustained_bandwidth"][1])

    ratios: dict[int, list[float]] = {}
    for node, seconds in pairs:
        if op_kind(node) != GEMM:
            continue
        modelled = op_time(node, device, key)
        if modelled.compute < modelled.memory or seconds <= modelled.overhead:
            continue  # memory-bound: it says nothing about the GEMM efficiency
        m, n, k, _ = gemm_shape(node)
        measured_compute = seconds - modelled.overhead  # the launch, and a split-K GEMM's reduction of its parts
        correction_now = _correction(device, m, n, k)
        ratio = modelled.compute / measured_compute * correction_now  # the correction that would make it exact
        octave = round(math.log2((float(m) * n * k) ** (1 / 3)))
        ratios.setdefault(octave, []).append(ratio)
    if ratios:
        curve = [[float(2 ** octave), round(statistics.median(values), 6)] for octave, values in sorted(ratios.items())]
        count = sum(len(values) for values in ratios.values())
        fitted["gemm_size_correction"] = (curve, f"measured / modelled efficiency of {count} compute-bound GEMMs "
                                                 f"in {label}, median per octave of size")
        device = with_constant(device, "gemm_size_correction", curve, fitted["gemm_size_correction"][1])
    if not fitted:
        raise ValueError("calibrate: none of the measured ops shows a constant (no tiny op, no memory-bound op, no "
                         "compute-bound GEMM)")
    if path is not None:
        write_device_file(path, base_reference(base), fitted)
        return device_model(path)
    return device


def _correction(device: DeviceModel, m: int, n: int, k: int) -> float:
    from fxflops.predict.hardware import interpolate

    return interpolate(device.gemm_size_correction, (float(m) * n * k) ** (1 / 3))


def base_reference(base: DeviceModel | str | Path) -> str:
    """How a written device file names its base so that it loads from anywhere: a preset by its name, a file
    by its absolute path (a relative one would be read from wherever the file is loaded). A DeviceModel only
    as a preset or a file gives it: one changed in code (`with_constant`) has nothing a file could name, and
    its constants, which the fit used, would be lost."""
    from fxflops.predict.hardware import _is_path

    if isinstance(base, DeviceModel):
        user_file = base.origin.removeprefix("your file ") if base.origin.startswith("your file ") else None
        named = user_file or base.name
        try:
            same = device_model(named) == base
        except ValueError:
            same = False
        if not same:
            raise ValueError(f"calibrate: base {base.name!r} is not a preset or a file as it stands (changed in "
                             f"code?); give a preset's name or a device file's path as base")
        return str(Path(user_file).resolve()) if user_file else base.name
    text = str(base)
    return str(Path(text).expanduser().resolve()) if _is_path(text, "devices") else text


def write_device_file(path: str | Path, base: str, fitted: dict[str, tuple[Any, str]], name: str | None = None,
                      note: str | None = None) -> None:
    """A device TOML file: `base = "<preset>"` and each fitted constant as {value, source}; `name` makes it
    loadable by that name when shipped beside the presets, `note` a comment line saying how it was made."""
    lines = ["# Written by fxflops.predict.calibrate: the constants below were fitted to measured op times;",
             "# every other constant is the base preset's."]
    lines += [f"# {note}"] if note else []
    lines += [f"name = {_toml(name)}"] if name else []
    lines += [f"base = {_toml(base)}", ""]
    for name, (value, source) in fitted.items():
        lines += [f"[{name}]", f"value = {_toml(value)}", f"source = {_toml(source)}", ""]
    Path(path).write_text("\n".join(lines), encoding="utf-8")


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(float(value)) if isinstance(value, float) else str(value)
