"""One rank's work per micro-batch, read from one capture as per-layer costs: what a step's simulation needs.

A model's repeated blocks (its transformer layers) run the same ops, so one capture under a tensor-parallel
degree (and sequence parallelism) tells the time, FLOPs, collectives, parameters and saved activations of
one layer, and of what runs before the first layer (the embedding: the first pipeline stage carries it)
and after the last (final norm, output head, loss: the last stage carries them). Every pipeline depth,
virtual-stage split, data-parallel degree and recomputation choice is then derived from these numbers
without capturing again; a model built at a shallower depth (the same blocks, fewer of them) gives the
same per-layer numbers, which is how the plan search stays fast.

Times are predicted: each node by `op_time.node_seconds`, each collective by `comm_time`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fxflops.parallel.plan import repeated_blocks
from fxflops.predict.comm_time import collective_record_seconds
from fxflops.predict.hardware import Cluster
from fxflops.predict.op_time import node_seconds
from fxflops.results import FORWARD

PRE = "pre"  # before the first block: the embedding
POST = "post"  # after the last block: final norm, output head, loss


@dataclass(frozen=True)
class Part:
    """Costs of one part of the model (one block, or what runs before / after the blocks) for one micro-batch
    on one rank: seconds predicted per pass, FLOPs counted per pass, parameters held."""

    forward: float = 0.0  # s, compute of the forward's ops
    backward: float = 0.0  # s, compute of the backward's ops
    comm_forward: float = 0.0  # s, collectives in the forward (tensor parallel: on the critical path)
    comm_backward: float = 0.0
    attention_forward: float = 0.0  # s, the attention kernels of the forward (selective recomputation)
    forward_flops: int = 0
    backward_flops: int = 0
    attention_flops: int = 0  # FLOPs of those attention kernels
    params: int = 0  # parameter elements this rank holds of the part (sharded by tp)
    saved_bytes: int = 0  # activation bytes the forward leaves for the backward
    kernels: int = 0  # ops counted (forward + backward)


@dataclass(frozen=True)
class LayerCosts:
    """One rank's work for one micro-batch under a tensor-parallel degree: a block (the mean of the captured
    blocks) and the parts before and after the blocks."""

    tp: int
    sequence_parallel: bool
    micro_batch: int
    tokens: int  # tokens per micro-batch (batch x sequence)
    layers: int  # the model's depth these costs stand for
    block: Part
    pre: Part
    post: Part
    boundary_bytes: int  # activation bytes one pipeline stage hands the next per micro-batch
    param_bytes: int  # bytes per parameter element (the model's dtype)
    dtype: str
    device: str
    captured_layers: int  # depth of the model that was captured
    notes: tuple[str, ...] = ()
    # temporaries alive at the capture's memory peak (workspaces of the op running there, gradients in
    # flight between ops): one layer's worth whatever the depth, so the search adds it once per rank
    transient_bytes: int = 0

    @property
    def params(self) -> int:
        """Parameter elements of one tp rank of the whole model."""
        return self.layers * self.block.params + self.pre.params + self.post.params

    def at_depth(self, layers: int) -> LayerCosts:
        """The same costs standing for a model of `layers` blocks."""
        return dataclasses.replace(self, layers=layers)


def layer_costs(estimate: Any, model: torch.nn.Module, cluster: Cluster, dtype: torch.dtype,
                ranks_per_node: Callable[[str], int], tp: int = 1, sequence_parallel: bool = False,
                micro_batch: int = 1, tokens: int = 0, layers: int | None = None) -> LayerCosts:
    """Per-layer costs from an estimate of `model` (backward=True; memory=True for the saved activations).

    `ranks_per_node(group_desc)` says how many ranks of a collective's group share a node (the plan's
    placement); `layers` is the depth the costs stand for (default: the captured model's)."""
    blocks = [name for name, _ in repeated_blocks(model)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no repeated blocks (a ModuleList of same-class layers): "
                         "a step prediction splits the model into layers; give a model built from such blocks")
    device = cluster.device
    of_module = _part_of(blocks)
    nodes = list(estimate.nodes)
    # what runs before the first block goes with the embedding; a module seen there keeps its backward there
    first_block = next((i for i, n in enumerate(nodes) if n.phase == FORWARD and of_module(n.module) >= 0), len(nodes))
    pre_nodes = {n.name for n in nodes[:first_block] if n.phase == FORWARD}
    pre_modules = {nodes[i].module for i in range(first_block) if nodes[i].module}
    forward_part: dict[str, str] = {}

    def part(node: Any) -> int | str:
        index = of_module(node.module)
        if index >= 0:
            return index
        if node.phase == FORWARD:
            where = PRE if node.name in pre_nodes else POST
            forward_part[node.name] = where
            return where
        if node.differentiates in forward_part:
            return forward_part[node.differentiates]
        return PRE if node.module in pre_modules else POST

    sums: dict[Any, dict[str, float]] = {}
    for node in nodes:
        key = part(node)
        seconds = node_seconds(node, device, dtype)
        entry = sums.setdefault(key, {})
        forward = node.phase == FORWARD
        _add(entry, "forward" if forward else "backward", seconds)
        _add(entry, "forward_flops" if forward else "backward_flops", node.flops)
        _add(entry, "kernels", 1 if node.status == "counted" else 0)
        if forward and _is_attention(node.op):
            _add(entry, "attention_forward", seconds)
            _add(entry, "attention_flops", node.flops)
    by_name = {n.name: n for n in nodes}
    for record in estimate.collectives:
        node = by_name.get(record.node)
        key = part(node) if node is not None else of_module(record.module)
        key = POST if key == -1 else key
        seconds = collective_record_seconds(record, cluster, ranks_per_node(record.group_desc))
        _add(sums.setdefault(key, {}), "comm_forward" if record.phase == FORWARD else "comm_backward", seconds)
    params = _params(estimate, of_module, pre_modules)
    memory = getattr(estimate, "memory", None)
    saved = {}
    if memory is not None:
        for name, size in memory.saved_by_module.items():
            key = of_module(name)
            key = key if key >= 0 else (PRE if name in pre_modules else POST)
            saved[key] = saved.get(key, 0) + size
    count = len(blocks)
    block = Part(**{f: _mean(sums, range(count), f) for f in ("forward", "backward", "comm_forward", "comm_backward",
                                                                "attention_forward")},
                 **{f: int(round(_mean(sums, range(count), f))) for f in ("forward_flops", "backward_flops",
                                                                           "attention_flops", "kernels")},
                 params=params["block"], saved_bytes=int(round(sum(saved.get(i, 0) for i in range(count)) / count)))
    pre = _whole(sums.get(PRE, {}), params[PRE], saved.get(PRE, 0))
    post = _whole(sums.get(POST, {}), params[POST], saved.get(POST, 0))
    element = torch.empty((), dtype=dtype).element_size()
    boundary = _boundary_bytes(nodes, of_module, element)
    notes: list[str] = []
    transient = memory.by_kind.get("temporaries", 0) if memory is not None else 0
    return LayerCosts(tp, sequence_parallel, micro_batch, tokens, layers or count, block, pre, post, boundary, element,
                      str(dtype).removeprefix("torch."), device.name, count, tuple(notes), transient)


def _part_of(blocks: list[str]) -> Callable[[str], int]:
    """module name -> the index of the block it is in, or -1."""
    index = {name: i for i, name in enumerate(blocks)}
    cache: dict[str, int] = {}

    def of(module: str) -> int:
        found = cache.get(module)
        if found is None:
            found = -1
            name = module
            while name:
                if name in index:
                    found = index[name]
                    break
                name = name.rpartition(".")[0]
            cache[module] = found
        return found

    return of


def _add(entry: dict[str, float], key: str, value: float) -> None:
    entry[key] = entry.get(key, 0.0) + value


def _mean(sums: dict[Any, dict[str, float]], keys: range, field: str) -> float:
    return sum(sums.get(k, {}).get(field, 0.0) for k in keys) / len(keys)


def _whole(entry: dict[str, float], params: int, saved: int) -> Part:
    floats = {f: entry.get(f, 0.0) for f in ("forward", "backward", "comm_forward", "comm_backward", "attention_forward")}
    ints = {f: int(entry.get(f, 0)) for f in ("forward_flops", "backward_flops", "attention_flops", "kernels")}
    return Part(**floats, **ints, params=params, saved_bytes=saved)


def _is_attention(op: str) -> bool:
    return "attention" in op or "flash" in op


def _params(estimate: Any, of_module: Callable[[str], int], pre_modules: set[str]) -> dict[str, int]:
    """Parameter elements this rank holds (the capture's own count: local shards under tp, a shared parameter
    once): in the first block, before the blocks and after them."""
    found = {"block": 0, PRE: 0, POST: 0}
    modules = estimate.modules
    for name, stats in modules.items():
        own = stats.params - sum(modules[child].params for child in stats.children if child in modules)
        if own <= 0:
            continue
        index = of_module(name)
        if index == 0:
            found["block"] += own
        elif index < 0:
            found[PRE if name in pre_modules else POST] += own
    return found


def _boundary_bytes(nodes: list[Any], of_module: Callable[[str], int], element: int) -> int:
    """Bytes of the first block's output, as this rank holds it (sequence-sharded under sequence parallelism):
    what a pipeline stage sends the next per micro-batch, and receives back as a gradient."""
    last = None
    for node in nodes:
        if node.phase == FORWARD and of_module(node.module) == 0 and node.output_shapes:
            last = node
    if last is None:
        return 0
    numel = 1
    for size in last.output_shapes[0]:
        numel *= int(size)
    return numel * element  # the residual stream is in the model's dtype
