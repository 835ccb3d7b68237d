"""Save a list's, dict's or set's own contents by reference, and put them back in place.

A container of more than SAVED_WHOLE items is kept only by its size and a sample of its items.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from itertools import islice
from typing import Any


# a container of up to this many items is saved whole, by reference; a larger one only by its size and
# a sample of its items (copying a list of 10^8 items costs seconds and gigabytes)
SAVED_WHOLE = 1 << 16
_SAMPLE = 32


class Saved:
    """One list's, dict's or set's own contents, to be put back in place (never copied deeper).

    A container of more than SAVED_WHOLE items keeps its size and a sample of its items instead: items
    appended to a list and keys added to a dict are taken out again exactly; another change seen in the
    sample is reported, as it cannot be undone.
    """

    __slots__ = ("container", "label", "size", "whole", "sample")

    def __init__(self, container: Any, label: str) -> None:
        self.container = container
        self.label = label
        self.size = len(container)
        self.whole = _contents(container) if self.size <= SAVED_WHOLE else None
        self.sample = None if self.whole is not None else _sample(container, self.size)

    def restore(self) -> str | None:
        """Put the contents back; a message if a change to a container saved by a sample cannot be undone."""
        if self.whole is not None:
            refill(self.container, self.whole)
            return None
        if _undo_growth(self.container, self.size, self.sample):
            return None
        return (f"the forward changed {self.label} in place (a {type(self.container).__name__} of {self.size:,} "
                f"items), which fxflops could not undo: containers over {SAVED_WHOLE:,} items are not copied, "
                "so only items appended to a list or keys added to a dict are taken out again")


def _contents(value: Any) -> Any:
    if isinstance(value, dict):
        return list(_dict_class(value).items(value))
    if isinstance(value, list):
        return list.copy(value)
    return set.copy(value)


def refill(container: Any, contents: Any) -> None:
    """Put a container's saved contents back in place (compared by identity: values may be tensors)."""
    if isinstance(container, dict):
        kind = _dict_class(container)
        if not _same_items(list(kind.items(container)), contents):
            kind.clear(container)
            for key, value in contents:
                kind.__setitem__(container, key, value)
    elif isinstance(container, list):
        if len(container) != len(contents) or not all(map(operator.is_, container, contents)):
            list.__setitem__(container, slice(None), contents)
    elif {id(item) for item in container} != {id(item) for item in contents}:
        set.clear(container)
        set.update(container, contents)


def _dict_class(value: dict) -> type:
    # an OrderedDict keeps its order beside the dict: its own methods, never a subclass's overrides
    return OrderedDict if isinstance(value, OrderedDict) else dict


def _same_items(current: list, saved: list) -> bool:
    return len(current) == len(saved) and all(map(_same, current, saved))


def _same(a: Any, b: Any) -> bool:
    if type(a) is tuple and type(b) is tuple and len(a) == 2 == len(b):  # a dict's item (key, value), unrolled:
        # a capture restores ~1,000 modules' dicts (parameters, submodules), each item compared
        return (a[0] is b[0] or (type(a[0]) is str and a[0] == b[0])) \
            and (a[1] is b[1] or (type(a[1]) is str and a[1] == b[1]))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(x is y or (type(x) is str and x == y) for x, y in zip(a, b))
    return a is b


def _sample(container: Any, size: int) -> Any:
    """What is kept of a large container: some items by position (list), the first and last items (dict),
    the first members (set)."""
    if isinstance(container, list):
        step = max(1, size // _SAMPLE)
        positions = sorted({*range(_SAMPLE), *range(0, size, step), *range(size - _SAMPLE, size)})
        return [(i, list.__getitem__(container, i)) for i in positions]
    if isinstance(container, dict):
        items = _dict_class(container).items(container)
        return list(islice(items, _SAMPLE)), list(islice(reversed(items), _SAMPLE))
    return list(islice(set.__iter__(container), 2 * _SAMPLE))


def _undo_growth(container: Any, size: int, sample: Any) -> bool:
    """Take out what was added to a large container since it was sampled; False if it changed otherwise."""
    now = len(container)
    extra = now - size
    if isinstance(container, list):
        if extra < 0 or not all(list.__getitem__(container, i) is item for i, item in sample):
            return False
        if extra:
            list.__delitem__(container, slice(size, None))
        return True
    if isinstance(container, dict):
        kind = _dict_class(container)
        items = kind.items(container)
        head, tail = sample
        if extra < 0 or not _same_items(list(islice(items, _SAMPLE)), head) \
                or not _same_items(list(islice(reversed(items), extra, extra + _SAMPLE)), tail):
            return False
        for key in list(islice(reversed(kind.keys(container)), extra)):  # added keys come last
            kind.__delitem__(container, key)
        return True
    members = list(islice(set.__iter__(container), 2 * _SAMPLE))
    return extra == 0 and len(members) == len(sample) and all(map(operator.is_, members, sample))
