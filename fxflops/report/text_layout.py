"""The text report's layout: section rules, label-and-value rows, "per GPU" or "per device", and
whether latency lines and columns show (exactly when the estimate carries measurements).
"""

from __future__ import annotations

from typing import Any

from fxflops.results import Estimate, Measurements

LABEL_WIDTH = 60


def _rule_line(title: str, width: int = 78) -> str:
    """`----- title -----` centred in `width` dashes, as DeepSpeed separates its sections."""
    if not title:
        return "-" * width
    return title.center(width, "-")


def _row(label: str, value: Any) -> str:
    return f"{label:<{LABEL_WIDTH}}  {value}"


def _device_word(measurements: Measurements | None) -> str:
    """DeepSpeed says "per GPU"; on any other device we say "per device"."""
    if measurements is None:
        return ""
    return "GPU" if measurements.device.startswith("cuda") else "device"


def _per(measurements: Measurements | None) -> str:
    word = _device_word(measurements)
    return f" per {word}" if word else ""


def _is_measured(estimate: Estimate) -> bool:
    return estimate.measurements is not None or any(
        stats.latency is not None for stats in estimate.modules.values()
    )
