"""Every collective a rank calls, as a record: kind, module, phase, process group, payload and wire bytes.

The capture records a collective as a node like any op (the zero list "collective" in
rules/collectives.toml keeps it out of the FLOPs and out of the unknown ops); this stage reads those
nodes. Functional collectives (DTensor redistribution) name their group; torch.distributed's own ops
(FSDP2, pipelining, plain dist.* calls) carry it. torch.distributed is only touched when a graph holds
a collective, which it cannot without torch.distributed loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from fxflops.results import FORWARD, NodeCost
from fxflops.results.collective_kinds import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BARRIER, BROADCAST, GATHER, RECV,
                                              REDUCE, REDUCE_SCATTER, SCATTER, SEND)

if TYPE_CHECKING:
    from fxflops.results.parallel import Collective

# op packet name (namespace.name, as rules key ops) -> kind
_FUNCTIONAL = {
    "all_reduce": ALL_REDUCE, "all_reduce_": ALL_REDUCE, "all_reduce_coalesced": ALL_REDUCE,
    "all_reduce_coalesced_": ALL_REDUCE, "all_gather_into_tensor": ALL_GATHER,
    "all_gather_into_tensor_out": ALL_GATHER, "all_gather_into_tensor_coalesced": ALL_GATHER,
    "reduce_scatter_tensor": REDUCE_SCATTER, "reduce_scatter_tensor_coalesced": REDUCE_SCATTER,
    "all_to_all_single": ALL_TO_ALL, "broadcast": BROADCAST, "broadcast_": BROADCAST,
}
_C10D = {
    "allreduce_": ALL_REDUCE, "allreduce_coalesced_": ALL_REDUCE, "allgather_": ALL_GATHER,
    "_allgather_base_": ALL_GATHER, "allgather_coalesced_": ALL_GATHER, "allgather_into_tensor_coalesced_": ALL_GATHER,
    "reduce_scatter_": REDUCE_SCATTER, "_reduce_scatter_base_": REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced_": REDUCE_SCATTER, "alltoall_": ALL_TO_ALL, "alltoall_base_": ALL_TO_ALL,
    "broadcast_": BROADCAST, "gather_": GATHER, "scatter_": SCATTER, "reduce_": REDUCE, "send": SEND,
    "recv_": RECV, "recv_any_source_": RECV, "barrier": BARRIER, "monitored_barrier_": BARRIER,
}
KINDS: dict[str, str] = {
    **{f"{namespace}.{name}": kind for namespace in ("_c10d_functional", "c10d_functional")
       for name, kind in _FUNCTIONAL.items()},
    **{f"_c10d_functional_autograd.{name}": _FUNCTIONAL[name]
       for name in ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor")},
    **{f"c10d.{name}": kind for name, kind in _C10D.items()},
}


def wire_bytes(kind: str, payload: int, group_size: int) -> int:
    """Bytes one rank sends for a collective of `payload` bytes over `group_size` ranks (ring algorithms)."""
    n = group_size
    if n <= 1 or kind in (BARRIER, RECV):
        return 0
    if kind == ALL_REDUCE:  # reduce-scatter then all-gather: 2(n-1) steps of payload/n
        return 2 * (n - 1) * payload // n
    if kind in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, GATHER, SCATTER, REDUCE):
        return (n - 1) * payload // n
    return payload  # broadcast (pipelined chain: each rank forwards the buffer once), send


def collectives(graph_module: torch.fx.GraphModule, costs: Iterable[NodeCost]) -> list[Collective]:
    """One record per collective node of a captured graph, in execution order."""
    by_name: dict[str, NodeCost] | None = None  # made at the first collective: most graphs have none
    found = []
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        key = _packet_key(node.target)
        kind = KINDS.get(key) if key is not None else None
        if kind is None:
            continue
        if by_name is None:
            from fxflops.results.parallel import Collective  # imported on use: most graphs hold no collective

            by_name = {cost.name: cost for cost in costs}
        cost = by_name.get(node.name)
        name, desc, size = _group(node)
        payload, dtype = _payload(node)
        wire = wire_bytes(kind, payload, size)
        if kind == ALL_TO_ALL and "functional" in key:
            payload, wire = _all_to_all_v(node, payload, wire)
        found.append(Collective(
            op=kind, target=str(node.target), module=cost.module if cost else "", phase=cost.phase if cost else FORWARD,
            group=name, group_desc=desc, group_size=size, dtype=dtype, bytes=payload, wire_bytes=wire, node=node.name))
    return found


def _all_to_all_v(node: torch.fx.Node, payload: int, wire: int) -> tuple[int, int]:
    """A functional all_to_all_single(input, output_split_sizes, input_split_sizes, group): its payload is the
    input this rank sends (the rows it receives may be more or fewer), and what goes on the wire is all of
    it but the split it keeps (all-to-all-v: the splits need not be equal)."""
    tensors = _tensors(node.args[0]) if node.args else []
    if not tensors:
        return payload, wire
    sent = tensors[0].numel() * tensors[0].element_size()
    splits = node.args[2] if len(node.args) > 2 else None
    distributed = sys.modules.get("torch.distributed")
    group = _as_group(node.args[3], distributed) if len(node.args) > 3 else None
    if not splits or group is None:
        return sent, wire_bytes(ALL_TO_ALL, sent, group.size() if group is not None else 1)
    rows = sum(int(size) for size in splits)
    kept = int(splits[distributed.get_group_rank(group, distributed.get_rank())])
    return sent, sent - (sent * kept // rows if rows else 0)


def _packet_key(target: Any) -> str | None:
    namespace = getattr(target, "namespace", None)
    packet = getattr(target, "_overloadpacket", None)
    if namespace is None or packet is None or "c10d" not in namespace:
        return None
    return f"{namespace}.{packet.__name__}"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


def _payload(node: torch.fx.Node) -> tuple[int, str]:
    """The largest buffer among the collective's tensor arguments and its output (each list summed):
    the gathered output of an all-gather, the full input of a reduce-scatter, the tensor otherwise."""
    best: list[torch.Tensor] = []
    best_bytes = 0
    for value in (*node.args, *node.kwargs.values(), node.meta.get("val")):
        tensors = _tensors(value)
        size = sum(t.numel() * t.element_size() for t in tensors)
        if size > best_bytes:
            best, best_bytes = tensors, size
    dtype = str(best[0].dtype).removeprefix("torch.") if best else ""
    return int(best_bytes), dtype


def _group(node: torch.fx.Node) -> tuple[str, str, int]:
    """(name, description, size) of the process group a collective node names or carries."""
    distributed = sys.modules.get("torch.distributed")
    for value in (*node.args, *node.kwargs.values()):
        group = _as_group(value, distributed)
        if group is not None:
            return group.group_name, getattr(group, "group_desc", "") or "", group.size()
    return "", "", 1


def _as_group(value: Any, distributed: Any) -> Any:
    if distributed is None:
        return None
    c10d = distributed.distributed_c10d
    if isinstance(value, str):
        try:
            return c10d._resolve_process_group(value)
        except (ValueError, RuntimeError, KeyError):
            return None
    if isinstance(value, torch.ScriptObject):
        try:
            return distributed.ProcessGroup.unbox(value)
        except (RuntimeError, TypeError):
            return None
    return value if isinstance(value, distributed.ProcessGroup) else None
