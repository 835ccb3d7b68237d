"""'Did you mean ...?': the closest valid spelling to a misspelt option, keyword or value, for error messages."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

_Function = TypeVar("_Function", bound=Callable[..., Any])


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """"; did you mean 'torch'?" for the valid spelling closest to `word`, or "" when none is close."""
    if not isinstance(word, str):
        return ""
    import difflib  # only when a message is made

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def spelled_keywords(function: _Function, also: Iterable[str] = ()) -> _Function:
    """`function` whose keyword it does not take is a TypeError naming the closest one it does
    (convention= for conventions=). A function taking **options passes them on: `also` names what the
    callee takes, checked with its own; without `also` such a function is returned as it is."""
    parameters = inspect.signature(function).parameters
    forwards = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    if forwards and not also:
        return function
    takes = frozenset(name for name, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    takes |= frozenset(also)

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        for name in kwargs:
            if name not in takes:
                raise TypeError(f"{function.__qualname__.replace('.__init__', '')}() got an unexpected keyword "
                                f"argument {name!r}{did_you_mean(name, sorted(takes))}")
        return function(*args, **kwargs)

    return checked  # type: ignore[return-value]
