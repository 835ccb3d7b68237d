"""Where a replayed block's tensors come from and go: the place of each tensor it read from outside
(input n, a tensor of the block by its place, or the same tensor every call), whether an op wrote into
one of them, and its output rebuilt for another call (`capture.replay`)."""

from __future__ import annotations

import operator
from typing import Any

import torch

from fxflops.capture.block_hooks import LOCAL, SHARDED, local_of, sharded_like
from fxflops.capture.block_state import BlockState, CallKey


def swapped(value: Any, fresh: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fresh.get(id(value), value)
    if type(value) in (tuple, list):
        return type(value)(swapped(item, fresh) for item in value)
    return value


def rebuild(spec: Any, fresh: dict[int, torch.Tensor], call: CallKey, modules: dict[str, torch.nn.Module]) -> Any:
    """The output of a replayed call, from its reference's output spec."""
    kind = spec[0]
    if kind == "node":
        return fresh[id(spec[2])]
    if kind == "plain":
        return spec[1]
    if kind in ("input", "state"):
        return resolve(spec, call, modules)
    if kind == SHARDED:  # a DTensor made in the block: the copy's local tensor under the reference's spec
        return sharded_like(rebuild(spec[1], fresh, call, modules), spec[2], spec[3])
    if kind is dict:
        return {key: rebuild(item, fresh, call, modules) for key, item in spec[1]}
    return kind(rebuild(item, fresh, call, modules) for item in spec[1])


def node_specs(spec: Any) -> list[tuple]:
    kind = spec[0]
    if kind == "node":
        return [spec]
    if kind == SHARDED:
        return node_specs(spec[1])
    if kind is dict:
        return [found for _, item in spec[1] for found in node_specs(item)]
    if kind in (tuple, list):
        return [found for item in spec[1] for found in node_specs(item)]
    return []


def place(node: torch.fx.Node, call: CallKey, state: BlockState) -> tuple:
    """Where a tensor the block read from outside comes from in any call: input n, a tensor of the block
    by place, or (neither) the same tensor for every call."""
    value = node.meta.get("val")
    found = place_of(value, call, state) if isinstance(value, torch.Tensor) else None
    return found if found is not None else ("same",)


def place_of(value: torch.Tensor, call: CallKey, state: BlockState) -> tuple | None:
    position = call.position(value)
    if position is not None:
        return ("input", position)
    position = call.local_position(value)
    if position is not None:
        return ("input", position, LOCAL)
    held = state.tensors.get(id(value))
    return None if held is None else ("state", *held)


def resolve(place: tuple, call: CallKey, modules: dict[str, torch.nn.Module]) -> torch.Tensor:
    if place[0] == "input":
        found = call.tensors[place[1]]
        return local_of(found) if place[2:] == (LOCAL,) else found
    relative, table, name = place[1:4]
    state = modules[relative].__dict__
    found = state[name] if table == "__dict__" else state[table][name]
    return local_of(found) if place[4:] == (LOCAL,) else found


def written_outside(node: torch.fx.Node, inside: set[torch.fx.Node]) -> str | None:
    """The argument an op writes into if it is, or views, a tensor from outside the block."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for position, argument in enumerate(schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = node.kwargs.get(argument.name) if argument.kwarg_only or position >= len(node.args) \
            else node.args[position]
        for written in nodes_in(value):
            if root(written, inside) not in inside:
                return argument.name
    return None


def root(node: torch.fx.Node, inside: set[torch.fx.Node]) -> torch.fx.Node:
    """The node whose tensor `node`'s tensor views (through views, getitems and in-place ops inside)."""
    while node in inside and node.op != "placeholder":
        if node.target is operator.getitem:
            node = node.args[0]
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            return node
        viewed = aliased_argument(node, schema)
        if viewed is None:
            return node
        node = viewed
    return node


def aliased_argument(node: torch.fx.Node, schema: Any) -> torch.fx.Node | None:
    sets = schema.returns[0].alias_info.before_set
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.before_set & sets:
            value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, torch.fx.Node):
                return value
    return None


def nodes_in(value: Any) -> list[torch.fx.Node]:
    if isinstance(value, torch.fx.Node):
        return [value]
    if isinstance(value, list | tuple):
        return [node for item in value for node in nodes_in(item)]
    return []
