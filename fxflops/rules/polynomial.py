"""Symbolic sizes as exact integer polynomials while a sweep's rule formulas are evaluated.

Under a sweep's named sizes a rule's formula multiplies and adds symbolic sizes. Done on torch.SymInts,
every step builds a new sympy expression through torch's symbolic layer (and a first capture pays
sympy's first-use work for each), then `to_count` rewrites the result in the user's names: another
expression. Most of that work is products and sums of sizes, which a plain polynomial does exactly:

- `Poly`: an integer polynomial over opaque sympy atoms ({monomial: coefficient}, a monomial a frozenset
  of (atom, power)). An atom is whatever is not a product, an integer or a positive integer power: a
  symbol, a sum, a floor division (a strided convolution's output size), so a size expression is taken
  apart no further than sympy's own Mul is; `in_user_names` builds the sympy expression once, from
  the atoms in the user's names.
- `SizeValue`: a symbolic size inside a formula: its polynomial, and the SymInt it stands for, made
  only when something other than +, -, * needs it (a comparison, a floor division, min/max, int()).
  That SymInt is made by the same operations, in the same order, on the same SymInts, as the formula
  would have applied without this module, so whatever torch records of it (a guard, a condition of
  the sweep) is what it records without it.

Only counts opt in (`Formula.evaluate(lift=True)`, see `fxflops.rules.entries`): every other reader of
a formula sees SymInts as before. sympy is imported only where a polynomial is written as sympy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

Monomial = frozenset  # of (atom, power)
_ONE: Monomial = frozenset()


class Poly:
    """An exact integer polynomial over opaque sympy atoms: {monomial: non-zero coefficient}."""

    __slots__ = ("terms", "_hash")

    def __init__(self, terms: dict[Monomial, int]) -> None:
        self.terms = terms
        self._hash: int | None = None

    @staticmethod
    def of(expr: Any) -> Poly:
        """The polynomial of an int or of a sympy integer expression, taken apart only as far as a product
        of powers of atoms with an integer coefficient (anything else is one atom)."""
        if type(expr) is int:
            return Poly({_ONE: expr} if expr else {})
        if expr.is_Integer:
            value = int(expr)
            return Poly({_ONE: value} if value else {})
        if expr.is_Mul:
            coefficient, powers = 1, {}
            for factor in expr.args:
                if factor.is_Integer:
                    coefficient *= int(factor)
                    continue
                base, power = _power(factor)
                if base is None:
                    return Poly({frozenset({(expr, 1)}): 1})  # a rational coefficient: the product whole
                powers[base] = powers.get(base, 0) + power
            return Poly({frozenset(powers.items()): coefficient} if coefficient else {})
        base, power = _power(expr)
        if base is None:
            return Poly({frozenset({(expr, 1)}): 1})
        return Poly({frozenset({(base, power)}): 1})

    def constant(self) -> int | None:
        """Its value where it has no atom, else None."""
        if not self.terms:
            return 0
        if len(self.terms) == 1 and _ONE in self.terms:
            return self.terms[_ONE]
        return None

    def __add__(self, other: Poly) -> Poly:
        terms = dict(self.terms)
        for monomial, coefficient in other.terms.items():
            total = terms.get(monomial, 0) + coefficient
            if total:
                terms[monomial] = total
            else:
                terms.pop(monomial, None)
        return Poly(terms)

    def __neg__(self) -> Poly:
        return Poly({monomial: -coefficient for monomial, coefficient in self.terms.items()})

    def __sub__(self, other: Poly) -> Poly:
        return self + (-other)

    def __mul__(self, other: Poly) -> Poly:
        terms: dict[Monomial, int] = {}
        for left, a in self.terms.items():
            for right, b in other.terms.items():
                monomial = _times(left, right)
                total = terms.get(monomial, 0) + a * b
                if total:
                    terms[monomial] = total
                else:
                    terms.pop(monomial, None)
        return Poly(terms)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Poly) and self.terms == other.terms

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self.terms.items()))
        return self._hash

    def in_user_names(self, user: Callable[[Any], Any]) -> Any:
        """The polynomial as an int, or as one sympy expression with each atom written by `user` (an
        atom of the ShapeEnv's symbols -> the same in the sweep's names)."""
        found = self.constant()
        if found is not None:
            return found
        import sympy  # symbolic sizes only

        terms = []
        for monomial, coefficient in self.terms.items():
            factors = [user(atom) if power == 1 else user(atom) ** power for atom, power in monomial]
            terms.append(sympy.Mul(coefficient, *factors))
        expr = sympy.Add(*terms)
        return int(expr) if expr.is_Integer else expr

    def __repr__(self) -> str:
        return " + ".join(f"{c}*" + "*".join(f"({a})**{p}" for a, p in m) if m else str(c)
                          for m, c in self.terms.items()) or "0"


class UserNames:
    """One count's polynomials in a sweep's names (`sizes`: its SizeSymbols): each distinct polynomial
    written as sympy once (the same count or bytes recurs across a model's ops), or with `lazy` kept as a
    `PolyCount`, written only when something reads it as sympy (a sweep's Piece compiles its programs
    from the polynomials themselves)."""

    def __init__(self, sizes: Any, lazy: bool = False) -> None:
        self.atom = sizes.in_user_names  # an atom in the ShapeEnv's symbols -> the same in the sweep's names
        self._lazy = lazy
        self._found: dict[Poly, Any] = {}
        self._written: dict[Poly, Any] = {}

    def __call__(self, poly: Poly) -> Any:
        found = self._found.get(poly)
        if found is None:
            constant = poly.constant()
            if constant is not None:
                found = constant
            elif self._lazy:
                found = PolyCount(poly, self)
            else:
                found = self.written(poly)
            self._found[poly] = found
        return found

    def written(self, poly: Poly) -> Any:
        """The polynomial as sympy in the sweep's names (an int where no symbol is left), made once."""
        found = self._written.get(poly)
        if found is None:
            found = self._written[poly] = poly.in_user_names(self.atom)
        return found


class PolyCount:
    """A count (MACs, FLOPs, bytes) of a sweep's node as a polynomial, written as sympy on first need
    (`sympy()`); its `terms` in the sweep's names are what a compiled program evaluates."""

    __slots__ = ("poly", "names", "_terms")

    def __init__(self, poly: Poly, names: UserNames) -> None:
        self.poly = poly
        self.names = names
        self._terms: list[tuple[int, list[tuple[Any, int]]]] | None = None

    def sympy(self) -> Any:
        return self.names.written(self.poly)

    def terms(self) -> list[tuple[int, list[tuple[Any, int]]]]:
        """[(coefficient, [(atom in the sweep's names, power), ...]), ...]: the value is the sum of the products."""
        if self._terms is None:
            atom = self.names.atom
            self._terms = [(coefficient, [(atom(base), power) for base, power in monomial])
                           for monomial, coefficient in self.poly.terms.items()]
        return self._terms

    @property
    def free_symbols(self) -> set[Any]:
        found: set[Any] = set()
        for _, factors in self.terms():
            for atom, _ in factors:
                if type(atom) is not int:
                    found |= atom.free_symbols
        return found

    def __eq__(self, other: object) -> bool:
        return type(other) is PolyCount and other.names is self.names and other.poly == self.poly

    def __hash__(self) -> int:
        return hash(self.poly)

    def __repr__(self) -> str:
        return f"PolyCount({self.sympy()})"


def plain(value: Any) -> Any:
    """A count as the rest of fxflops reads it: a PolyCount written as sympy, anything else as it is."""
    return value.sympy() if type(value) is PolyCount else value


def _power(expr: Any) -> tuple[Any, int]:
    """(base, exponent) of a positive integer power, (expr, 1) of any other atom; (None, 0) for a
    number that is not an integer (a rational coefficient)."""
    if expr.is_Pow and expr.exp.is_Integer and expr.exp > 0:
        return expr.base, int(expr.exp)
    if expr.is_Number:
        return None, 0
    return expr, 1


def _times(left: Monomial, right: Monomial) -> Monomial:
    if not left:
        return right
    if not right:
        return left
    powers = dict(left)
    for atom, power in right:
        powers[atom] = powers.get(atom, 0) + power
    return frozenset(powers.items())


class SizeValue:
    """A symbolic size inside a formula: its polynomial (`poly`, in the ShapeEnv's symbols) and the SymInt
    it stands for, made on first need by the operations that made it (see the module's doc)."""

    __slots__ = ("poly", "_sym", "_make")

    def __init__(self, poly: Poly, sym: torch.SymInt | None = None,
                 make: Callable[[], Any] | None = None) -> None:
        self.poly = poly
        self._sym = sym
        self._make = make

    def sym(self) -> Any:
        """The SymInt (or whatever the SymInt operations give) this value stands for."""
        if self._sym is None:
            self._sym = self._make()  # type: ignore[misc]
            self._make = None
        return self._sym

    # +, -, *: polynomial; with anything but an int or another SizeValue, the SymInt's own operator
    def __add__(self, other: Any) -> Any:
        poly = _poly_of(other)
        if poly is None:
            return self.sym() + other
        return SizeValue(self.poly + poly, make=lambda: self.sym() + _sym_of(other))

    def __radd__(self, other: Any) -> Any:
        poly = _poly_of(other)
        if poly is None:
            return other + self.sym()
        return SizeValue(poly + self.poly, make=lambda: _sym_of(other) + self.sym())

    def __sub__(self, other: Any) -> Any:
        poly = _poly_of(other)
        if poly is None:
            return self.sym() - other
        return SizeValue(self.poly - poly, make=lambda: self.sym() - _sym_of(other))

    def __rsub__(self, other: Any) -> Any:
        poly = _poly_of(other)
        if poly is None:
            return other - self.sym()
        return SizeValue(poly - self.poly, make=lambda: _sym_of(other) - self.sym())

    def __mul__(self, other: Any) -> Any:
        poly = _poly_of(other)
        if poly is None:
            return self.sym() * other
        return SizeValue(self.poly * poly, make=lambda: self.sym() * _sym_of(other))

    def __rmul__(self, other: Any) -> Any:
        poly = _poly_of(other)
        if poly is None:
            return other * self.sym()
        return SizeValue(poly * self.poly, make=lambda: _sym_of(other) * self.sym())

    def __neg__(self) -> SizeValue:
        return SizeValue(-self.poly, make=lambda: -self.sym())

    def __pos__(self) -> SizeValue:
        return self

    # everything else: the SymInt's (a SymInt result lifted again, so that what a formula compares it
    # with is compared as the SymInts would be, in the same order)
    def __floordiv__(self, other: Any) -> Any:
        return lifted(self.sym() // _sym_of(other))

    def __rfloordiv__(self, other: Any) -> Any:
        return lifted(_sym_of(other) // self.sym())

    def __truediv__(self, other: Any) -> Any:
        return self.sym() / _sym_of(other)

    def __rtruediv__(self, other: Any) -> Any:
        return _sym_of(other) / self.sym()

    def __mod__(self, other: Any) -> Any:
        return lifted(self.sym() % _sym_of(other))

    def __rmod__(self, other: Any) -> Any:
        return lifted(_sym_of(other) % self.sym())

    def __pow__(self, other: Any) -> Any:
        return lifted(self.sym() ** _sym_of(other))

    def __rpow__(self, other: Any) -> Any:
        return lifted(_sym_of(other) ** self.sym())

    def __eq__(self, other: Any) -> Any:  # type: ignore[override]
        return self.sym() == _sym_of(other)

    def __ne__(self, other: Any) -> Any:  # type: ignore[override]
        return self.sym() != _sym_of(other)

    def __lt__(self, other: Any) -> Any:
        return self.sym() < _sym_of(other)

    def __le__(self, other: Any) -> Any:
        return self.sym() <= _sym_of(other)

    def __gt__(self, other: Any) -> Any:
        return self.sym() > _sym_of(other)

    def __ge__(self, other: Any) -> Any:
        return self.sym() >= _sym_of(other)

    def __bool__(self) -> bool:
        return bool(self.sym())

    def __int__(self) -> int:
        return int(self.sym())

    def __float__(self) -> float:
        return float(self.sym())

    def __index__(self) -> int:
        return self.sym().__index__()

    def __abs__(self) -> Any:
        return lifted(abs(self.sym()))

    def __ceil__(self) -> Any:
        return math.ceil(self.sym())

    def __floor__(self) -> Any:
        return math.floor(self.sym())

    def __hash__(self) -> int:
        return hash(self.sym())

    def __repr__(self) -> str:
        return repr(self.sym())


def _poly_of(value: Any) -> Poly | None:
    if type(value) is SizeValue:
        return value.poly
    if type(value) is int:
        return Poly({_ONE: value} if value else {})
    return None


def _sym_of(value: Any) -> Any:
    return value.sym() if type(value) is SizeValue else value


def lifted(value: Any) -> Any:
    """A SymInt as a SizeValue; a tuple or list holding SymInts with each lifted; anything else as it is."""
    kind = type(value)
    if kind is torch.SymInt:
        return SizeValue(Poly.of(value.node.expr), sym=value)
    if (kind is tuple or kind is list or kind is torch.Size) and torch.SymInt in map(type, value):
        return tuple(lifted(item) for item in value) if kind is not list else [lifted(item) for item in value]
    return value


def unlifted(value: Any) -> Any:
    """A SizeValue as its SymInt (tuples and lists walked)."""
    kind = type(value)
    if kind is SizeValue:
        return value.sym()
    if (kind is tuple or kind is list) and SizeValue in map(type, value):
        return kind(unlifted(item) for item in value)
    return value


def lifted_numel(tensor: torch.Tensor) -> Any:
    """A tensor's element count as numel() gives it, as a SizeValue where its sizes are symbolic (the product
    of its sizes' polynomials; the SymInt, if needed, is the tensor's own numel())."""
    shape = tensor.shape
    if torch.SymInt not in map(type, shape):
        return tensor.numel()
    poly = Poly({_ONE: 1})
    for size in shape:
        poly = poly * (Poly.of(size.node.expr) if type(size) is torch.SymInt else Poly.of(int(size)))
    return SizeValue(poly, make=tensor.numel)
