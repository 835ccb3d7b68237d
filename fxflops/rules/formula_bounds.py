"""Bounded arithmetic for formulas: every value a formula makes stays within limits, and errors quote it
readably.

A hostile or mistaken rule file must not stall or exhaust the process, nor compute on a tensor (real
weights under annotate()): the operators a formula applies are these checked ones, and every result
passes `_bounded`. `FormulaError` is the one error a formula raises; `clip` cuts text for one-line
messages.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch

from fxflops.rules.polynomial import SizeValue


class FormulaError(ValueError):
    """A formula that does not parse, uses something not allowed, or fails on its inputs."""


# Bounds that keep a hostile or mistaken formula from stalling or exhausting the process. Each is
# checked before the operation that could exceed it (a power's size is estimated from its operands'
# bit lengths, a repetition's from the sequence's length), so refusing costs microseconds.
MAX_INT_BITS = 256  # bits of any integer a formula makes (2**256 ~ 1e77; a count is below 2**80)
MAX_EXPONENT = 64  # the right operand of **
MAX_LENGTH = 10_000  # characters of a string, items of a list or tuple a formula makes


def _bounded_pow(base: Any, exponent: Any) -> Any:
    # a rule file must not be able to stall the process with 10 ** 10 ** 10: sizes are checked first
    _refuse_tensor(base, exponent)
    if _plain_int(exponent):
        if abs(exponent) > MAX_EXPONENT:
            raise FormulaError(f"exponent {_short(exponent)} is too large (at most {MAX_EXPONENT})")
        if _plain_int(base) and exponent > 0 and (base.bit_length() - 1) * exponent + 1 > MAX_INT_BITS:
            raise FormulaError(
                f"{_short(base)} ** {exponent} would have about {base.bit_length() * exponent} bits "
                f"(at most {MAX_INT_BITS})"
            )
    return _bounded(base**exponent)


def _multiply(left: Any, right: Any) -> Any:
    _refuse_tensor(left, right)
    for sequence, count in ((left, right), (right, left)):
        if isinstance(sequence, _SEQUENCES):
            if _symbolic(count):
                raise FormulaError("repeating a sequence a symbolic number of times is not allowed")
            if _plain_int(count) and len(sequence) * count > MAX_LENGTH:
                raise FormulaError(
                    f"a {type(sequence).__name__} of length {len(sequence)} repeated {count} times would have "
                    f"length {len(sequence) * count} (at most {MAX_LENGTH})"
                )
    if _plain_int(left) and _plain_int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
        raise FormulaError(
            f"{_short(left)} * {_short(right)} would have about {left.bit_length() + right.bit_length()} bits "
            f"(at most {MAX_INT_BITS})"
        )
    return _bounded(left * right)


def _add(left: Any, right: Any) -> Any:
    _refuse_tensor(left, right)
    if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES) and len(left) + len(right) > MAX_LENGTH:
        raise FormulaError(f"concatenating would make length {len(left) + len(right)} (at most {MAX_LENGTH})")
    return _bounded(left + right)


def _modulo(left: Any, right: Any) -> Any:
    if isinstance(left, str | bytes):
        raise FormulaError("string formatting with % is not allowed")
    return _arithmetic(operator.mod)(left, right)


def _arithmetic(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def checked(left: Any, right: Any) -> Any:
        _refuse_tensor(left, right)
        return _bounded(op(left, right))
    return checked


def _plain_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_SEQUENCES = (str, bytes, list, tuple)


def _bounded(value: Any) -> Any:
    """The value, if within the bounds every value a formula makes must keep."""
    kind = type(value)
    if kind is int:
        if value.bit_length() > MAX_INT_BITS:
            raise FormulaError(f"an integer of {value.bit_length()} bits (at most {MAX_INT_BITS})")
    elif kind is float:
        if not math.isfinite(value):
            raise FormulaError(f"float overflow ({value})")
    elif kind is complex:
        raise FormulaError(f"complex result {_short(value)}")
    elif kind in _SEQUENCES and len(value) > MAX_LENGTH:
        raise FormulaError(f"a {kind.__name__} of length {len(value)} (at most {MAX_LENGTH})")
    return value


def _refuse_tensor(*values: Any) -> None:
    # arithmetic on a tensor would compute on it (real weights under annotate()): formulas take sizes
    if any(isinstance(value, torch.Tensor) for value in values):
        raise FormulaError("arithmetic on a tensor is not allowed: use its .shape, .ndim or numel()")


def _short(value: Any, limit: int = 60) -> str:
    """repr() cut to a readable length: error messages quote values and formulas."""
    return clip(repr(value), limit)


def clip(text: str, limit: int = 200) -> str:
    """Text cut to a readable length for a one-line message."""
    return text if len(text) <= limit else f"{text[: limit - 30]}...{text[-10:]} ({len(text)} characters)"


def _symbolic(value: Any) -> bool:
    return isinstance(value, torch.SymInt | torch.SymFloat | SizeValue)
