"""Named sizes left symbolic: one capture whose shapes, and so whose costs, are formulas in them.

A `SizePlan` says which axis of which input tensor carries which named size, and the value it is
captured at. Under a ShapeEnv those axes become SymInts, so every shape the forward computes and
every rule's cost is an expression in the names. Whatever the forward decided from a size (a branch,
a specialization, a broadcast) is a guard; `SizeSymbols.conditions()` states them in the user's
names, so a formula is never used where the capture that made it would have gone another way.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fxflops.capture.size_one import size_one_shape_env
from fxflops.capture.tensor_walk import tensors_in

if TYPE_CHECKING:
    import sympy

Dims = Mapping[str, int | Sequence[int]]


@dataclass(frozen=True)
class SizePlan:
    """Which input axes carry which named size. Inputs are numbered in `tensors_in((args, kwargs))`
    order, the order every capture walks them in (tensors inside cache objects included)."""

    axes: Mapping[int, Mapping[int, str]]  # input index -> {axis: name}
    hints: Mapping[str, int]  # name -> the value the capture runs at

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.hints)

    def at(self, point: Mapping[str, int]) -> SizePlan:
        """The same axes, captured at `point`."""
        return SizePlan(self.axes, {name: int(point[name]) for name in self.hints})

    def shape_of(self, index: int, shape: Sequence[int], point: Mapping[str, int]) -> tuple[int, ...]:
        """An input's shape at `point` (its example shape with the named axes resized)."""
        sizes = list(shape)
        for axis, name in self.axes.get(index, {}).items():
            sizes[axis] = point[name]
        return tuple(sizes)


def plan_from_dims(args: Any, kwargs: Any, dims: Dims) -> SizePlan:
    """The plan for user-facing `dims` ({"batch": 0, "seq": 1}, {"size": (2, 3)}).

    A name's example size is its first axis in the first input tensor that has that axis; it is then
    carried by that axis of every input tensor whose size there is the same (the ids and their mask,
    not a [1, seq] position tensor under batch 8). Several axes of one name must share one size.
    """
    if not dims:
        raise ValueError("dims is empty: name at least one size, e.g. dims={'seq': 1}")
    inputs = tensors_in((args, kwargs))
    if not inputs:
        raise ValueError("dims names input axes, but the example inputs hold no tensor")
    axes: dict[int, dict[int, str]] = {}
    hints: dict[str, int] = {}
    for name, spec in dims.items():
        _check_name(name)
        wanted = (spec,) if isinstance(spec, int | float) else tuple(spec) if isinstance(spec, tuple | list) else ()
        if not wanted or not all(isinstance(axis, int) and not isinstance(axis, bool) for axis in wanted):
            raise ValueError(f"dims[{name!r}] must be an axis (int) or a tuple of axes, got {spec!r}")
        hint = _example_size(name, wanted, inputs)
        hints[name] = hint
        for index, tensor in enumerate(inputs):
            for axis in wanted:
                if -tensor.dim() <= axis < tensor.dim() and tensor.shape[axis] == hint:
                    owner = axes.setdefault(index, {})
                    axis = axis % tensor.dim()
                    if axis in owner and owner[axis] != name:
                        raise ValueError(f"dims {owner[axis]!r} and {name!r} both name axis {axis} of input {index}")
                    owner[axis] = name
    return SizePlan(axes, hints)


RESERVED_NAMES = frozenset({"quantity", "module"})  # Sweep.formula's own arguments


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"a size's name must be a Python identifier (it appears in formulas), got {name!r}")
    if name in RESERVED_NAMES:
        raise ValueError(f"a size may not be called {name!r} (Sweep.formula takes an argument of that name)")


def _example_size(name: str, axes: tuple[int, ...], inputs: list[torch.Tensor]) -> int:
    for tensor in inputs:
        if all(-tensor.dim() <= axis < tensor.dim() for axis in axes):
            sizes = {int(tensor.shape[axis]) for axis in axes}
            if len(sizes) > 1:
                raise ValueError(f"dims[{name!r}] names axes {axes} of an input of shape {tuple(tensor.shape)}, "
                                 "which differ in size; one name is one size")
            return sizes.pop()
    shapes = ", ".join(str(tuple(t.shape)) for t in inputs[:4])
    raise ValueError(f"dims[{name!r}] = {axes}: no input tensor has that axis (input shapes: {shapes})")


def user_symbol(name: str) -> sympy.Symbol:
    """The symbol a named size has in formulas."""
    import sympy  # symbolic sizes only: estimate() never imports it

    return sympy.Symbol(name, integer=True, positive=True)


class SizeSymbols:
    """The ShapeEnv of one capture, with one SymInt per named size of its plan."""

    def __init__(self, plan: SizePlan) -> None:
        import sympy
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic

        self.plan = plan
        self.env = size_one_shape_env()  # see fxflops.capture.size_one
        self.symints: dict[str, Any] = {}
        self._to_user: dict[sympy.Symbol, sympy.Symbol] = {}
        # a count a formula gave as a float, rounded to int for the sweep's formulas -> its exact float
        # expression: estimate() refuses a non-integer count, so a sweep checks this one at each point
        self.rounded: dict[Any, Any] = {}
        # expression -> the same in the user's names: a count asks it of every size and numel, most of them
        # shared (one xreplace each, ~40 us); a function of the expression and _to_user, set here once
        self._in_user_names: dict[Any, Any] = {}
        self.fixed: dict[str, int] = {}  # names the ShapeEnv made constants (captured at 0)
        for name, hint in plan.hints.items():
            source = ConstantSource(f"fxflops_{name}")
            # 1 not made a constant: whatever the forward decides from a size being 1 is a guard, so a
            # capture at 2 states whether it holds at 1 too (0 still is: the symbols are positive)
            symbol = self.env.create_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC,
                                            do_not_specialize_zero_one=hint != 0)
            if isinstance(symbol, sympy.Symbol):
                self._to_user[symbol] = user_symbol(name)
                self.symints[name] = self.env.create_symintnode(symbol, hint=hint, source=source)
            else:
                self.fixed[name] = hint
                self.symints[name] = hint

    def sizes(self, index: int, tensor: torch.Tensor) -> list[Any] | None:
        """The symbolic shape of input `index`, or None when none of its axes is named."""
        named = self.plan.axes.get(index)
        if not named:
            return None
        return [self.symints[named[axis]] if axis in named else int(size) for axis, size in enumerate(tensor.shape)]

    def translate(self, text: str) -> str:
        """A message with the ShapeEnv's symbol names (s25) replaced by the sizes' names (seq)."""
        names = {symbol.name: user.name for symbol, user in self._to_user.items()}
        return re.sub(r"\b[su]\d+\b", lambda match: names.get(match[0], match[0]), text)

    def expression(self, value: Any) -> Any:
        """An int, or the sympy expression of a SymInt in the user's names (replacements applied)."""
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            return self.in_user_names(value.node.expr)
        return value

    def in_user_names(self, expr: Any) -> Any:
        """A sympy expression in the ShapeEnv's symbols in the user's names (replacements applied); an int
        where it has no symbol left."""
        expr = self.env.replace(expr)
        found = self._in_user_names.get(expr)
        if found is None:
            if not expr.free_symbols:
                found = int(expr) if expr.is_integer else expr
            else:
                found = _renamed(expr, self._to_user, self._in_user_names)
            self._in_user_names[expr] = found
        return found

    def conditions(self) -> list[sympy.Basic]:
        """What must hold for the capture's path to be taken: guards, ranges and fixed names, in user names."""
        import sympy

        # unevaluated: a positive symbol equal to 0 would be False by its assumption alone
        found: list[sympy.Basic] = [sympy.Eq(user_symbol(name), value, evaluate=False)
                                    for name, value in self.fixed.items()]
        for symbol, user in self._to_user.items():
            # a guard equating sizes (height == width) became a replacement, and simplifies to True below
            replaced = self.env.replace(symbol)
            if replaced != symbol:
                found.append(sympy.Eq(user, replaced.xreplace(self._to_user)))
        ranges = _ranges(self.env, self._to_user)
        for guard in self.env.guards:
            if _implied_by_ranges(ranges, guard.expr):
                continue  # stated by the range conditions below (`1 < batch` by `batch >= 2`)
            condition = self.env.simplify(guard.expr).xreplace(self._to_user)
            if condition != sympy.true and condition not in found:
                found.append(condition)
        for symbol, user in self._to_user.items():
            found.extend(_range_conditions(user, ranges[symbol]))
        return found


def _renamed(expr: Any, names: Mapping[Any, Any], done: dict[Any, Any]) -> Any:
    """expr.xreplace(names) (names: symbol -> symbol of the same assumptions), without re-running the `eval`
    of torch's integer functions (FloorDiv, ModularIndexing, ...) on the renamed arguments: their
    arguments were evaluated when the ShapeEnv made them, and a renaming changes no fact eval reads, so it
    would give them back as they are, after asking sympy for facts of every new argument (the first
    sweep capture's most expensive renaming: a strided convolution's output size). Sums, products and
    powers are made as sympy makes them (their argument order is the names')."""
    found = names.get(expr)
    if found is not None:
        return found
    if not expr.args:
        return expr
    found = done.get(expr)
    if found is not None:
        return found
    args = tuple(_renamed(arg, names, done) for arg in expr.args)
    if args == expr.args:
        return expr
    if isinstance(expr, _sympy_function()) and not expr.is_Add and not expr.is_Mul and not expr.is_Pow:
        return expr.func(*args, evaluate=False)
    return expr.func(*args)


def _sympy_function() -> type:
    import sympy

    return sympy.Function


def _ranges(env: Any, symbols: Mapping[Any, Any]) -> dict[Any, Any]:
    """Each named size's range: the ShapeEnv's, from 1 (the symbols are positive: a question on a size
    being 0 was answered "no" without a guard), raised past the least values a guard rules out
    (`batch != 1`, `2*seq != 2`, `batch*seq != batch`)."""
    import sympy
    from torch.utils._sympy.value_ranges import ValueRanges

    ranges = {}
    for symbol in symbols:
        found = env.var_to_range.get(symbol) or ValueRanges.unknown_int()
        least = max(int(found.lower), 1) if isinstance(found.lower, sympy.Integer) else 1  # not the infinities
        # a guard false at `least` whatever the other sizes are (`batch*seq != batch` at seq 1) rules it out
        own = [guard.expr for guard in env.guards if symbol in guard.expr.free_symbols]
        for _ in range(_MOST_VALUES_RULED_OUT):
            if found.upper < least or all(guard.xreplace({symbol: sympy.Integer(least)}) != sympy.false
                                          for guard in own):
                break
            least += 1
        ranges[symbol] = ValueRanges(least, found.upper)
    return ranges


_MOST_VALUES_RULED_OUT = 64  # past that, the guards are conditions of their own (the range stays lower)


def _implied_by_ranges(ranges: Mapping[Any, Any], expr: sympy.Basic) -> bool:
    """Whether a guard holds wherever each size is in its range (which the conditions state), so it
    need not be checked on its own: `1 < batch` where batch >= 2, and (the two sides' difference
    bounded) `batch*seq != batch` where seq >= 2."""
    import sympy
    from torch.utils._sympy.value_ranges import bound_sympy

    def bound(value: sympy.Basic) -> Any:
        return bound_sympy(value, {symbol: ranges.get(symbol) for symbol in value.free_symbols})

    found = bound(expr)
    if found.is_singleton() and found.lower == sympy.true:
        return True
    kinds = {sympy.Ne: lambda low, high: low > 0 or high < 0, sympy.Gt: lambda low, high: low > 0,
             sympy.Ge: lambda low, high: low >= 0, sympy.Lt: lambda low, high: high < 0,
             sympy.Le: lambda low, high: high <= 0}
    decide = kinds.get(type(expr))
    if decide is None or any(symbol not in ranges for symbol in expr.free_symbols):
        return False
    difference = bound(sympy.factor(_small_remainders(bound, expr.lhs - expr.rhs)))
    return bool(decide(difference.lower, difference.upper))


def _small_remainders(bound: Any, expr: sympy.Basic) -> sympy.Basic:
    """`expr` with each remainder a % b whose ranges say 0 <= a < b written as a (batch % (batch*seq))."""
    import sympy
    from torch.utils._sympy.functions import Mod, PythonMod

    def small(remainder: sympy.Basic) -> bool:
        a, b = remainder.args
        return bool(bound(a).lower >= 0 and bound(sympy.factor(b - a)).lower > 0)

    return expr.replace(lambda e: isinstance(e, Mod | PythonMod) and small(e), lambda e: e.args[0])


def _range_conditions(symbol: sympy.Symbol, value_range: Any) -> list[sympy.Basic]:
    import sympy

    # unevaluated: `batch >= 1` is True by the symbol's own assumption, and must still be checked
    conditions = [sympy.Ge(symbol, int(value_range.lower), evaluate=False)]
    if isinstance(value_range.upper, sympy.Integer):  # the infinities are not sympy Integers
        conditions.append(sympy.Le(symbol, int(value_range.upper)))
    return conditions


def holds(conditions: Sequence[sympy.Basic], point: Mapping[str, int]) -> bool:
    """Whether every condition is true at `point`."""
    import sympy

    values = {user_symbol(name): sympy.Integer(value) for name, value in point.items()}
    for condition in conditions:
        decided = condition.xreplace(values)
        if decided is not sympy.true:
            try:
                if not bool(decided):
                    return False
            except TypeError:  # still symbolic: it names something the point does not fix
                return False
    return True
