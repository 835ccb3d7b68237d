"""A piece's cost expressions compiled once into straight-line Python: a point's totals in microseconds,
its per-module table in about a millisecond, and a grid of points at once on numpy arrays.

`Program` turns a list of outputs (each an integer plus a weighted sum of sympy expressions, or a
conjunction of conditions) into one generated function of the sizes: every distinct sub-expression
is one local variable, computed once, whichever outputs share it. The source is generated from
sympy expression trees only (integer literals, operators, numbered variables): no user text enters
it, and the sizes are its positional arguments. An expression it has no Python for is evaluated
through sympy at the point (exact, slower).

On arrays, the same program runs on int64 when a float64 pass shows no intermediate value can
overflow it, else on Python integers in object arrays: a grid's numbers are exact either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy

from fxflops.capture.dynamic import user_symbol
from fxflops.rules.polynomial import PolyCount

# |value| below which int64 arithmetic on a float64 pass' magnitudes is certainly exact (float64
# rounds by at most 2^-52 relative, far inside this margin)
_INT64_SAFE = 2.0 ** 60

Sum = tuple[int, Mapping[Any, int]]  # constant + sum(weight * expression)
_BINARY_KINDS = (sympy.Eq, sympy.Ne, sympy.Lt, sympy.Le, sympy.Gt, sympy.Ge)
_NARY_KINDS = (sympy.Add, sympy.Mul, sympy.Max, sympy.Min, sympy.And, sympy.Or, sympy.Not)


class Program:
    """Outputs over the named sizes, as one generated function; `__call__` takes the sizes in order
    (ints: exact ints back), `on_arrays` takes numpy arrays of equal shape."""

    def __init__(self, names: Sequence[str], sums: Sequence[Sum] = (), conditions: Sequence[Any] | None = None) -> None:
        self.names = tuple(names)
        self._sums = list(sums)
        self._conditions = None if conditions is None else list(conditions)
        self._scalar = self._build(vector=False, check=False)
        self._vector: Callable | None = None
        self._checked: Callable | None = None

    def __call__(self, *sizes: int) -> Any:
        """A tuple of the sums' values at the point, or (with conditions) whether every condition holds."""
        return self._scalar(*sizes)

    def on_arrays(self, *sizes: Any) -> Any:
        """The same, elementwise over numpy arrays of sizes (each output an array of their shape)."""
        import numpy as np

        if self._vector is None:
            self._vector = self._build(vector=True, check=False)
            self._checked = self._build(vector=True, check=True)
        shape = np.broadcast_shapes(*(np.shape(size) for size in sizes)) if sizes else ()
        largest = [0.0]

        def seen(value: Any) -> None:
            if isinstance(value, np.ndarray) and value.dtype != object and value.size:
                largest[0] = max(largest[0], float(np.max(np.abs(value))))
            elif isinstance(value, int | float):
                largest[0] = max(largest[0], abs(float(value)))

        with np.errstate(all="ignore"):
            self._checked(seen, *(np.asarray(size, dtype=np.float64) for size in sizes))
        exact = largest[0] < _INT64_SAFE
        kind = np.int64 if exact else object
        arrays = [np.asarray(size, dtype=np.int64).astype(kind) for size in sizes]
        found = self._vector(None, *arrays)
        if self._conditions is not None:
            return np.broadcast_to(np.asarray(found, dtype=bool), shape)
        return tuple(np.broadcast_to(np.asarray(value, dtype=kind), shape) for value in found)

    def _build(self, vector: bool, check: bool) -> Callable:
        writer = _Writer(self.names, vector, check)
        if self._conditions is not None:
            names = set(writer.symbols)
            # a condition on a size the point does not fix is false there (as capture.dynamic.holds decides)
            parts = [writer.var(condition) if condition.free_symbols <= names else writer.fallback(condition)
                     for condition in self._conditions] or ["True"]
            result = (" & " if vector else " and ").join(f"({part})" for part in parts)
        else:
            outputs = []
            for constant, weighted in self._sums:
                terms = [str(constant)] if constant or not weighted else []
                terms += [writer.var(expr) if weight == 1 else f"{weight} * {writer.var(expr)}"
                          for expr, weight in weighted.items()]
                outputs.append(" + ".join(terms))
            result = "(" + "".join(f"{output}, " for output in outputs) + ")"
        return writer.function(result)


class _Writer:
    """Writes the body of a generated function: one line per distinct sub-expression."""

    def __init__(self, names: Sequence[str], vector: bool, check: bool) -> None:
        self._args = {user_symbol(name): f"a{i}" for i, name in enumerate(names)}
        self._names = tuple(names)
        self._vector, self._check = vector, check
        self._lines: list[str] = []
        self._vars: dict[Any, str] = {}
        self._fallbacks: list[Callable] = []
        self._known: dict[Any, bool] = {}  # expression -> whether it has a Python form

    def function(self, result: str) -> Callable:
        import numpy as np

        arguments = ", ".join(["_seen", *self._args.values()]) if self._vector else ", ".join(self._args.values())
        source = f"def program({arguments}):\n" + "".join(f"    {line}\n" for line in self._lines) + \
            f"    return {result}\n"
        namespace: dict[str, Any] = {"_F": self._fallbacks, "np": np, "__builtins__": {"max": max, "min": min}}
        exec(compile(source, "<fxflops sweep program>", "exec"), namespace)  # noqa: S102 - generated, see module doc
        return namespace["program"]

    def var(self, expr: Any) -> str:
        if type(expr) is int:
            return f"({expr})"
        found = self._vars.get(expr)
        if found is not None:
            return found
        if type(expr) is PolyCount:
            return self._count(expr)
        text = self._text(expr) if self._supported(expr) else self.fallback(expr)
        if isinstance(expr, sympy.Symbol | sympy.Integer | sympy.logic.boolalg.BooleanAtom):
            self._vars[expr] = text
            return text
        name = self._vars[expr] = f"v{len(self._vars)}"
        self._lines.append(f"{name} = {text}")
        if self._check:
            self._lines.append(f"_seen({name})")
        return name

    def _count(self, count: PolyCount) -> str:
        """A count kept as a polynomial: one line per product of its atoms (each checked on the float pass,
        as a sympy product's line is), then their sum; through sympy where an atom has no Python form."""
        terms = count.terms()
        if not all(type(atom) is int or self._supported(atom) for _, factors in terms for atom, _ in factors):
            text = self.fallback(count.sympy())
        else:
            products = []
            for coefficient, factors in terms:
                parts = [f"({coefficient})"] + [self.var(atom) if power == 1 else f"{self.var(atom)} ** {power}"
                                                for atom, power in factors]
                products.append(self._line(" * ".join(parts)))
            text = " + ".join(products)
        name = self._vars[count] = self._line(text)
        return name

    def _line(self, text: str) -> str:
        name = f"v{len(self._vars)}_{len(self._lines)}"
        self._lines.append(f"{name} = {text}")
        if self._check:
            self._lines.append(f"_seen({name})")
        return name

    @property
    def symbols(self) -> tuple[Any, ...]:
        return tuple(self._args)

    def _supported(self, expr: Any) -> bool:
        """Whether every part of `expr` has a Python form (a rational inside a product has none: the
        whole product is evaluated by sympy, never a part of it rounded)."""
        found = self._known.get(expr)
        if found is None:
            from torch.utils._sympy.functions import CeilDiv, FloorDiv, Mod, PythonMod

            if isinstance(expr, sympy.Integer | sympy.logic.boolalg.BooleanAtom):
                found = True
            elif isinstance(expr, sympy.Symbol):
                found = expr in self._args
            elif isinstance(expr, sympy.Pow):
                found = isinstance(expr.exp, sympy.Integer) and expr.exp >= 0 and self._supported(expr.base)
            elif isinstance(expr, _BINARY_KINDS + (FloorDiv, CeilDiv, PythonMod, Mod)):
                found = len(expr.args) == 2 and all(self._supported(arg) for arg in expr.args)
            elif isinstance(expr, _NARY_KINDS):
                found = all(self._supported(arg) for arg in expr.args)
            else:
                found = False
            self._known[expr] = found
        return found

    def _text(self, expr: Any) -> str:
        from torch.utils._sympy.functions import CeilDiv, FloorDiv, Mod, PythonMod

        if isinstance(expr, sympy.Integer):
            return f"({int(expr)})"
        if isinstance(expr, sympy.logic.boolalg.BooleanAtom):
            return "True" if bool(expr) else "False"
        if isinstance(expr, sympy.Symbol) and expr in self._args:
            return self._args[expr]
        kind = type(expr)
        if isinstance(expr, sympy.Pow) and isinstance(expr.exp, sympy.Integer) and expr.exp >= 0:
            return f"{self.var(expr.base)} ** {int(expr.exp)}"
        binary = {FloorDiv: "{} // {}", CeilDiv: "-(-{} // {})", PythonMod: "{} % {}", Mod: "{} % {}",
                  sympy.Eq: "({} == {})", sympy.Ne: "({} != {})", sympy.Lt: "({} < {})", sympy.Le: "({} <= {})",
                  sympy.Gt: "({} > {})", sympy.Ge: "({} >= {})"}
        for kind, form in binary.items():
            if isinstance(expr, kind) and len(expr.args) == 2:
                return form.format(*(self.var(arg) for arg in expr.args))
        parts = [self.var(arg) for arg in expr.args] if expr.args else None
        if isinstance(expr, sympy.Add):
            return " + ".join(parts)
        if isinstance(expr, sympy.Mul):
            return " * ".join(parts)
        if isinstance(expr, sympy.Max | sympy.Min):
            if not self._vector:
                return f"{'max' if isinstance(expr, sympy.Max) else 'min'}({', '.join(parts)})"
            function = "np.maximum" if isinstance(expr, sympy.Max) else "np.minimum"
            text = parts[0]
            for part in parts[1:]:
                text = f"{function}({text}, {part})"
            return text
        if isinstance(expr, sympy.And | sympy.Or):
            joiner = (" & " if isinstance(expr, sympy.And) else " | ") if self._vector else \
                (" and " if isinstance(expr, sympy.And) else " or ")
            return "(" + joiner.join(f"({part})" for part in parts) + ")"
        if isinstance(expr, sympy.Not):
            return f"(~{parts[0]})" if self._vector else f"(not {parts[0]})"
        return self.fallback(expr)

    def fallback(self, expr: Any) -> str:
        """An expression evaluated by sympy at each point (exact; what the generator has no Python for).
        A condition sympy cannot decide there (it names another size) is false."""
        symbols = [user_symbol(name) for name in self._names]

        def value(*sizes: int) -> Any:
            found = expr.xreplace({symbol: sympy.Integer(int(size)) for symbol, size in zip(symbols, sizes)})
            if isinstance(found, sympy.logic.boolalg.Boolean):
                try:
                    return bool(found)
                except TypeError:
                    return False
            return int(found)

        if self._vector:
            import numpy as np

            scalar = value
            value = np.frompyfunc(scalar, len(symbols), 1) if symbols else scalar  # noqa: F811 - per element
        self._fallbacks.append(value)
        return f"_F[{len(self._fallbacks) - 1}]({', '.join(self._args.values())})"
