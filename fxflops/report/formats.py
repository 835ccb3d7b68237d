"""Human formatting of counts, rates and durations in the DeepSpeed style (`590.59 k`, `1.21 GMACs`).

Values are scaled by powers of 1000, rounded to `precision` decimals and printed without
trailing zeros (`44.7 GMACs`, `0 MACs`), as DeepSpeed's profiler prints them, so its users
read our reports the same way.
"""

from __future__ import annotations

import re

PRECISION = 2

# How every writer of ours encodes what the encoding cannot hold (a module named with a lone surrogate,
# "a\udcff", which Python allows): as a backslash escape, never an error.
ENCODING_ERRORS = "backslashreplace"


def encodable(text: str, encoding: str | None) -> str:
    """`text` as a stream of `encoding` (a stream we did not open, such as stdout) can take it: what it
    cannot hold becomes a backslash escape, as files we write get it."""
    encoding = encoding or "utf-8"
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        return text.encode(encoding, ENCODING_ERRORS).decode(encoding)
    return text

# What a terminal acts on instead of showing (C0 and C1 controls: ESC starts an escape sequence, CSI is one,
# CR and BS overwrite what was shown) and the bidirectional overrides that reorder what is shown. Names in a
# report come from the user's model (module, class and op names, extra_repr, source paths): a report shows
# them, it never lets them drive the terminal.
# (the bidirectional controls are the Trojan Source list, CVE-2021-42574: the Arabic letter mark too)
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, keep: str = "\n") -> str:
    """`text` with each control character but those in `keep` as a visible escape (ESC as `\\x1b`)."""
    return _CONTROLS.sub(lambda found: found[0] if found[0] in keep else _escape(found[0]), text)


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


# What a spreadsheet runs as a formula when a cell starts with it (OWASP's CSV-injection list).
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: object) -> object:
    """A CSV cell a spreadsheet shows as written: text starting like a formula gets a leading `'` (OWASP's
    advice; csv quotes the cell as needed), control characters are escaped; numbers stay numbers, negative
    ones too (a spreadsheet reads `-5` as the number, not a formula)."""
    if not isinstance(value, str):
        return value
    if value.startswith(_FORMULA_STARTS):
        value = "'" + value
    return printable(value, keep="")


# Decimal prefixes from the largest down; the first whose magnitude fits the value is used.
_LARGE = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))
_SMALL = ((1.0, ""), (1e-3, "m"), (1e-6, "u"), (1e-9, "n"))


def _trimmed(value: float, precision: int) -> str:
    """`round` then drop trailing zeros, but never fall back to exponent notation."""
    text = f"{round(value, precision):.{precision}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def scaled(num: float, precision: int = PRECISION, thousands: str = "K") -> tuple[str, str]:
    """(number text, prefix) for `num`; `thousands` is the prefix used for 1e3 (`k` for params)."""
    if num == 0:
        return "0", ""
    magnitude = abs(num)
    for factor, prefix in _LARGE:
        if magnitude >= factor:
            return _trimmed(num / factor, precision), thousands if prefix == "K" else prefix
    for factor, prefix in _SMALL:
        if magnitude >= factor:
            return _trimmed(num / factor, precision), prefix
    return _trimmed(num / 1e-9, precision), "n"


def _joined(num: float, unit: str, precision: int, thousands: str = "K") -> str:
    text, prefix = scaled(num, precision, thousands)
    suffix = prefix + unit
    return f"{text} {suffix}" if suffix else text


def shared_to_string(shared: dict[str, str]) -> str:
    """`weight = transformer.wte.weight`: the tied parameters a module's params leave out (name relative
    to the module = the first owner's qualified name, where they are counted)."""
    return ", ".join(f"{name} = {owner}" for name, owner in shared.items())


def params_to_string(params: float, precision: int = PRECISION) -> str:
    """Parameter count: `61.71 k`, `336.23 M`, `156`, `0`."""
    if abs(params) < 1000:
        return _trimmed(params, precision)
    return _joined(params, "", precision, thousands="k")


def macs_to_string(macs: float, precision: int = PRECISION) -> str:
    """Multiply-accumulate count: `439.55 MMACs`, `860.16 KMACs`, `0 MACs`."""
    if abs(macs) < 1000:
        return f"{_trimmed(macs, precision)} MACs"
    return _joined(macs, "MACs", precision)


def number_to_string(num: float, precision: int = PRECISION) -> str:
    """A plain count such as FLOPs: `89.45 G`, `5.71 M`, `0`."""
    if abs(num) < 1000:
        return _trimmed(num, precision)
    return _joined(num, "", precision)


def bytes_to_string(num: float, precision: int = PRECISION) -> str:
    """A memory amount in decimal units: `1.23 GB`, `512 B`."""
    if abs(num) < 1000:
        return f"{_trimmed(num, precision)} B"
    return _joined(num, "B", precision)


def flops_to_string(flops_per_second: float, precision: int = PRECISION) -> str:
    """A rate: `660.07 GFLOPS`, `0 FLOPS`."""
    if abs(flops_per_second) < 1000:
        return f"{_trimmed(flops_per_second, precision)} FLOPS"
    return _joined(flops_per_second, "FLOPS", precision)


def duration_to_string(seconds: float, precision: int = PRECISION) -> str:
    """A duration given in seconds: `135.52 ms`, `34.09 us`, `1.89 s`."""
    if seconds >= 1 or seconds == 0:
        return f"{_trimmed(seconds, precision)} s"
    return _joined(seconds, "s", precision)


def percent(part: float | None, whole: float | None) -> str:
    """`28.49%`; a share of nothing is `0.00%` rather than a division error."""
    if not part or not whole:
        return "0.00%"
    return f"{100.0 * part / whole:.2f}%"
