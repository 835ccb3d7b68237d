"""'Did you mean ...?': the closest valid spelling to a misspelt option, keyword or value, for error messages."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """"; did you mean 'torch'?" for the valid spelling closest to `word`, or "" when none is close."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
