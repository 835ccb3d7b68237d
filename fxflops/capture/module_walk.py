"""Walk a model's modules in pre-order, without recursion (a model nested thousands deep is fine).

A module registered twice is named again but not descended into; a torch.compile'd module stands for
the module it wraps.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module a torch.compile'd model wraps (its `_orig_mod`), or the model itself.

    Calling the compiled model would run dynamo (which compiles, and installs its hooks into torch);
    its original module runs the same forward eagerly, which is what a capture records."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing can have been compiled
    while dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        model = model._orig_mod
    return model


def walk_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str | None]]:
    """(qualified name, module, first name if this is a second registration) in pre-order.

    Iterative, so a model nested thousands deep does not exhaust Python's recursion limit; a module
    registered twice is yielded again under its second name but not descended into. A torch.compile'd
    submodule is its original module under its own name (no `._orig_mod` level: the wrapper runs it).
    """
    first: dict[int, str] = {}
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # (as uncompiled() finds it, once per walk)
    compiled = dynamo.OptimizedModule if dynamo is not None else ()
    while stack:
        name, module = stack.pop()
        seen_as = first.get(id(module))
        yield name, module, seen_as
        if seen_as is not None:
            continue
        first[id(module)] = name
        children = [(f"{name}.{key}" if name else key, uncompiled(child) if isinstance(child, compiled) else child)
                    for key, child in module._modules.items() if child is not None]
        stack.extend(reversed(children))


def unique_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(name, module) for name, module, alias_of in walk_modules(model) if alias_of is None]
