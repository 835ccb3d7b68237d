"""The summary lines of a measured profile: parallel sizes, latency, FLOPS and utilization, throughput,
and a profiled generation's prefill and decode.

In DeepSpeed's words, each line only when what it is computed from was measured.
"""

from __future__ import annotations

from typing import Any

from fxflops.report.formats import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
)
from fxflops.report.text_layout import _device_word, _row, _rule_line
from fxflops.results import Estimate, Measurements


def _counted(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def generation_lines(info: dict[str, Any]) -> list[str]:
    """Prefill vs decode of a profiled generation (fxflops.timing.generate): summed and per step."""
    lines = ["", _rule_line(" Generation "), _row("forward calls per generation:", info["calls"])]
    for phase in ("prefill", "decode"):
        p = info[phase]
        if not p["calls"]:
            continue
        lines += [
            _row(f"{phase} calls:", p["calls"]),
            _row(f"{phase} MACs (summed / per step):",
                 f"{macs_to_string(p['macs'])} / {macs_to_string(p['macs_per_step'])}"),
            _row(f"{phase} flops (summed / per step):",
                 f"{number_to_string(p['flops'])} / {number_to_string(p['flops_per_step'])}"),
            _row(f"{phase} latency (summed / per step):",
                 f"{duration_to_string(p['latency'])} / {duration_to_string(p['latency_per_step'])}"),
        ]
    return lines


def _parallel_lines(m: Measurements | None) -> list[str]:
    if m is None:
        return []
    lines = []
    for label, value in (
        ("world size:", m.world_size),
        ("data parallel size:", m.dp_size),
        ("model parallel size:", m.mp_size),
    ):
        if value is not None:
            lines.append(_row(label, value))
    if m.batch_size is not None:
        lines.append(_row(f"batch size per {_device_word(m)}:", m.batch_size))
    return lines


def _latency_lines(estimate: Estimate, m: Measurements) -> list[str]:
    """DeepSpeed's latency/FLOPS/throughput lines, each only when its inputs were measured."""
    word = _device_word(m)
    flops = estimate.fwd_flops
    lines = [_row("device:", f"{m.device} ({m.device_name})" if m.device_name else m.device)]
    lines.append(_row("timer:", f"{m.timer}, {_counted(m.warm_up, 'warm-up')} + {_counted(m.steps, 'timed step')}"))
    lines.append(_row("fwd latency:", duration_to_string(m.fwd_latency)))
    lines.append(
        _row(
            "fwd latency min / median / max:",
            " / ".join(
                duration_to_string(value)
                for value in (m.fwd_latency_min, m.fwd_latency_median, m.fwd_latency_max)
            ),
        )
    )
    if m.fwd_latency:
        lines.append(
            _row(
                f"fwd FLOPS per {word} = fwd flops per {word} / fwd latency:",
                flops_to_string(flops / m.fwd_latency),
            )
        )
    lines += _utilization_lines("fwd", flops / m.fwd_latency if m.fwd_latency else None, m)
    plain_host, hooked_host = m.extra.get("host_launch_plain"), m.extra.get("host_launch_hooked")
    if m.hook_overhead is not None and plain_host and hooked_host:
        # on a GPU the hooked pass ran with the host queued ahead (fxflops.timing.clocks.QueueAhead): its latency
        # is device time, the plain one's is host-paced, so their ratio is not the hooks' cost; the host's is
        lines.append(_row("fwd latency with per-module hooks (device time, host queued ahead):",
                          duration_to_string(m.hooked_fwd_latency)))
        lines.append(_row("host time to launch a fwd, plain / with per-module hooks:",
                          f"{duration_to_string(plain_host)} / {duration_to_string(hooked_host)} "
                          f"({hooked_host / plain_host:.2f}x)"))
    elif m.hook_overhead is not None:
        lines.append(
            _row(
                "fwd latency with per-module hooks:",
                f"{duration_to_string(m.hooked_fwd_latency)} ({m.hook_overhead:.2f}x)",
            )
        )
    lines += _bwd_latency_lines(estimate, m)
    lines += _throughput_lines(m)
    return lines


def _bwd_latency_lines(estimate: Estimate, m: Measurements) -> list[str]:
    """bwd latency and FLOPS: from the counted backward, or DeepSpeed's factor x forward FLOPs."""
    word = _device_word(m)
    flops = estimate.fwd_flops
    extra = m.extra.get("recompute_fwd_factor", 0)  # a recomputation the user declares (FlopsProfiler)
    if estimate.backward:
        bwd_flops = estimate.bwd_flops + extra * flops
        added = f" + {extra:g} * fwd flops per {word}" if extra else ""
        bwd_label = f"(bwd flops per {word}{added})" if extra else f"bwd flops per {word}"
        both_label = f"(fwd+bwd flops per {word}{added})"
    else:  # DeepSpeed's rule: 2 x forward FLOPs, plus the declared recomputation
        factor = 2 + extra
        bwd_flops, bwd_label = factor * flops, f"{factor:g} * fwd flops per {word}"
        both_label = f"{1 + factor:g} * fwd flops per {word}"
    lines = []
    if m.bwd_latency is not None:
        lines.append(_row("bwd latency:", duration_to_string(m.bwd_latency)))
        if m.bwd_latency:
            lines.append(_row(f"bwd FLOPS per {word} = {bwd_label} / bwd latency:",
                              flops_to_string(bwd_flops / m.bwd_latency)))
        fwd_bwd = m.fwd_latency + m.bwd_latency
        if fwd_bwd:
            rate = (flops + bwd_flops) / fwd_bwd
            lines.append(_row(f"fwd+bwd FLOPS per {word} = {both_label} / (fwd+bwd latency):", flops_to_string(rate)))
            lines += _utilization_lines("fwd+bwd", rate, m)
    if m.step_latency is not None:
        lines.append(_row("step latency:", duration_to_string(m.step_latency)))
    if m.iter_latency is not None:
        lines.append(_row("iter latency:", duration_to_string(m.iter_latency)))
        if m.iter_latency:
            lines.append(_row(f"FLOPS per {word} = {both_label} / iter latency:",
                              flops_to_string((flops + bwd_flops) / m.iter_latency)))
    return lines


def _utilization_lines(what: str, rate: float | None, m: Measurements) -> list[str]:
    if rate is None or not m.peak_flops:
        return []
    lines = []
    if what == "fwd":
        source = f" ({m.peak_flops_source})" if m.peak_flops_source else ""
        lines.append(_row("peak FLOPS:", flops_to_string(m.peak_flops) + source))
    lines.append(_row(f"{what} FLOPS utilization = {what} FLOPS / peak FLOPS:", utilization_text(rate, m.peak_flops)))
    return lines


def utilization_text(rate: float, peak: float) -> str:
    """`41.27%`; tiny shares keep two significant digits (`0.0035%`) instead of reading 0.00%."""
    share = 100.0 * rate / peak
    return f"{share:.2f}%" if share >= 0.01 or share == 0 else f"{share:.2g}%"


def _throughput_lines(m: Measurements) -> list[str]:
    """samples/second as DeepSpeed: batch per device * dp_size / iter latency."""
    if m.batch_size is None:
        return []
    samples = m.batch_size * (m.dp_size or 1)
    if m.iter_latency:
        return [_row("samples/second:", f"{samples / m.iter_latency:.2f}")]
    if m.fwd_latency:
        return [_row("fwd samples/second:", f"{samples / m.fwd_latency:.2f}")]
    return []
