"""The memory section of the text summary: the step's peak tensor bytes by kind, where it happens, the
allocator's allowance apart, and whether it fits on the device."""

from __future__ import annotations

from typing import Any

from fxflops.report.text_layout import _row

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
TOP = 3  # modules named for what is alive at the peak (activations and temporaries they made)


def memory_to_string(num: float) -> str:
    """Bytes in binary units, as device memory is sized: `1.5 GiB`, `512 B`."""
    value, unit = float(num), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{int(value)} B" if unit == 0 else f"{value:.2f} {_UNITS[unit]}"


def memory_lines(estimate: Any) -> list[str]:
    """The memory section (none when the estimate was made without memory=); under a plan whose rank roles
    hold different memory (pipeline stages), one per role."""
    roles = [role for role in getattr(estimate, "ranks", None) or () if role.estimate.memory is not None]
    if len(roles) > 1:
        lines = []
        for role in roles:
            lines += [_row(f"memory of rank role '{role.name}':", f"{len(role.ranks):,} ranks"),
                      *_memory_lines(role.estimate.memory)]
        return lines
    memory = getattr(estimate, "memory", None)
    return [] if memory is None else _memory_lines(memory)


def _memory_lines(memory: Any) -> list[str]:
    at = memory.peak_at
    where = f"{at.phase}" + (f", in {at.module}" if at.module else "") + (f" ({at.op})" if at.node != at.phase else "")
    kinds = ", ".join(f"{kind} {memory_to_string(size)}" for kind, size in memory.by_kind.items() if size)
    allowance = memory.allowance_bytes
    lines = [_row("memory peak (tensor bytes, per rank):", f"{memory_to_string(memory.peak_bytes)} at {where}"),
             _row("  alive at the peak:", kinds or "nothing"),
             *([_row("  activations + temporaries by module:", ", ".join(
                 f"{name or '(model)'}: {memory_to_string(size)}"
                 for name, size in list(memory.by_module.items())[:TOP]))] if memory.by_module else []),
             _row("  allowance (apart, adjustable):",
                  f"+{memory_to_string(allowance.total)} (CUDA context {memory_to_string(allowance.context)}, "
                  f"{memory.allowance.block_bytes}-byte blocks {memory_to_string(allowance.rounding)}, "
                  f"collectives {memory_to_string(allowance.collectives)}, "
                  f"fragmentation {memory_to_string(allowance.fragmentation)})")]
    if memory.capacity is not None:
        verdict = (f"yes, {memory_to_string(memory.headroom)} headroom" if memory.fits else
                   f"no: needs {memory_to_string(memory.device_bytes)}, {memory_to_string(-memory.headroom)} over")
        lines.append(_row(f"  fits on {memory.device} ({memory_to_string(memory.capacity)}):", verdict))
    return lines
