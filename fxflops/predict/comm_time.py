"""Time per collective on a cluster: an α-β model per link type, ring and tree algorithms, and a
hierarchical algorithm when a group spans nodes.

A step over one link costs α (its latency) plus bytes / β (its bandwidth). With `n` ranks in one node,
bandwidth B and latency α (the cluster's intra-node link), on a payload of S bytes (the `Collective.bytes`
convention: an all-reduce's buffer, an all-gather's gathered output, a reduce-scatter's full input, an
all-to-all's input, the tensor sent):

| collective | ring | tree |
|---|---|---|
| all-reduce | 2(n-1)/n · S/B + 2(n-1)·α | 2(n-1)/n · S/B + 2⌈log2 n⌉·α |
| all-gather, reduce-scatter | (n-1)/n · S/B + (n-1)·α | (same: no tree) |
| all-to-all | (n-1)/n · S/B + (n-1)·α | (pairwise exchange) |
| broadcast, reduce | S/B + (n-1)·α (pipelined chain) | S/B + ⌈log2 n⌉·α |
| gather, scatter | (n-1)/n · S/B + (n-1)·α | |
| send/recv | S/B + α | |
| barrier | 2⌈log2 n⌉·α | |

B is the bus bandwidth as NCCL-tests defines it (busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for
all-gather and reduce-scatter): a ring all-reduce of S bytes at bus bandwidth B takes 2(n-1)/n · S/B. The
tree's bandwidth term is the ring's: NCCL's double binary tree reaches the same bus bandwidth on large
messages; its gain is the log-depth latency.

A group spanning nodes (g = `ranks_per_node` ranks on each of N nodes, n = g·N):

- ring and tree run over all n ranks as NCCL runs them, one channel per network adapter: the bus bandwidth
  is the slower of the intra-node link and the group's share of its node's adapters, min(B, g·b) with b =
  `Cluster.inter_bandwidth_per_gpu`; every ring step waits for the slowest hop, α_inter, and the tree is
  log2(N) network hops deep plus a chain of g-1 NVLink hops in each node.
- "hierarchical" runs three phases one after the other: an intra-node reduce-scatter, an all-reduce
  among the nodes (each of a node's g ranks on its 1/g of the buffer over its adapter share b), an
  intra-node all-gather (all-gather and reduce-scatter: the network phase and the node phase).
- "auto" takes the fastest, as NCCL's tuner picks among its algorithms.

Every GPU of a node is assumed to talk across nodes at once (data-parallel groups run in lockstep), so a
rank's share of the network is its node's adapters' bandwidth over its GPUs: one rail each on a DGX.
All-to-all sends what it addresses off the node over the network and the rest over the intra-node link
at the same time; a send to another node uses one adapter.
"""

from __future__ import annotations

import math
from typing import Any

from fxflops.predict.hardware import Cluster, cluster as load_cluster

ALGORITHMS = ("auto", "ring", "tree", "hierarchical")
_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather", "scatter",
        "send", "recv", "barrier")


def _log2(n: int) -> int:
    return max(math.ceil(math.log2(n)), 1) if n > 1 else 0


def flat_seconds(op: str, payload_bytes: float, n: int, bandwidth: float, latency: float,
                 algorithm: str = "auto") -> float:
    """One collective over `n` ranks on one kind of link (bandwidth B/s, per-step latency s), by the table
    in this module's docstring."""
    if n <= 1:
        return 0.0
    size = float(payload_bytes)
    steps = n - 1
    share = (n - 1) / n
    if op == "all_reduce":
        ring = 2 * share * size / bandwidth + 2 * steps * latency
        tree = 2 * share * size / bandwidth + 2 * _log2(n) * latency
        return _pick(ring, tree, algorithm)
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return share * size / bandwidth + steps * latency
    if op in ("broadcast", "reduce"):
        return _pick(size / bandwidth + steps * latency, size / bandwidth + _log2(n) * latency, algorithm)
    if op in ("send", "recv"):
        return size / bandwidth + latency
    if op == "barrier":
        return 2 * _log2(n) * latency
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(_OPS)}")


def _pick(ring: float, tree: float, algorithm: str) -> float:
    if algorithm == "ring":
        return ring
    if algorithm == "tree":
        return tree
    return min(ring, tree)


def collective_seconds(op: str, payload_bytes: int, group_size: int, cluster: Cluster | str, ranks_per_node: int,
                       algorithm: str = "auto") -> float:
    """Predicted seconds of one collective: `op` a `Collective.op` kind ("all_reduce", "all_gather", ...),
    `payload_bytes` its `Collective.bytes`, over `group_size` ranks of which `ranks_per_node` share a node
    (the rest on other nodes, as many per node). `algorithm`: "auto" (the fastest), "ring", "tree" or
    "hierarchical" (across nodes; on one node it is "auto")."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if op not in _OPS:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(_OPS)}")
    spec = load_cluster(cluster)
    n = int(group_size)
    if n <= 1 or payload_bytes < 0:
        return 0.0
    g = max(1, min(int(ranks_per_node), n, spec.gpus_per_node))
    if g >= n:  # one node
        return flat_seconds(op, payload_bytes, n, spec.intra_bandwidth, spec.intra_latency,
                            "auto" if algorithm == "hierarchical" else algorithm)
    nodes = math.ceil(n / g)
    size = float(payload_bytes)
    per_gpu, inter_lat = spec.inter_bandwidth_per_gpu, spec.inter_latency
    intra_bw, intra_lat = spec.intra_bandwidth, spec.intra_latency
    bus = min(intra_bw, g * per_gpu)  # the group's bottleneck: its NVLink or its share of the node's adapters
    if op in ("send", "recv"):  # the peer is on another node: one adapter
        return size / spec.inter_bandwidth + inter_lat
    if op == "all_to_all":
        off_node, on_node = size * (n - g) / n, size * (g - 1) / n
        return max(off_node / per_gpu + (nodes - 1) * inter_lat, on_node / intra_bw + (g - 1) * intra_lat)
    if op == "barrier":
        return 2 * (_log2(nodes) * inter_lat + _log2(g) * intra_lat)
    chain = (g - 1) * intra_lat  # the tree's hops inside a node
    if op == "all_reduce":
        ring = 2 * (n - 1) / n * size / bus + 2 * (n - 1) * inter_lat
        tree = 2 * (n - 1) / n * size / bus + 2 * (_log2(nodes) * inter_lat + chain)
        hierarchical = (flat_seconds("reduce_scatter", size, g, intra_bw, intra_lat)
                        + flat_seconds("all_reduce", size / g, nodes, per_gpu, inter_lat)
                        + flat_seconds("all_gather", size, g, intra_bw, intra_lat))
    elif op in ("all_gather", "reduce_scatter", "gather", "scatter"):
        ring = tree = (n - 1) / n * size / bus + (n - 1) * inter_lat
        hierarchical = (flat_seconds(op, size / g, nodes, per_gpu, inter_lat)
                        + flat_seconds(op, size, g, intra_bw, intra_lat))
    else:  # broadcast, reduce
        ring = size / bus + (n - 1) * inter_lat
        tree = size / bus + _log2(nodes) * inter_lat + chain
        hierarchical = (flat_seconds(op, size, nodes, per_gpu * g, inter_lat)
                        + flat_seconds(op, size, g, intra_bw, intra_lat))
    if algorithm == "auto":
        return min(ring, tree, hierarchical)
    return {"ring": ring, "tree": tree, "hierarchical": hierarchical}[algorithm]


def ranks_per_node(group_size: int, stride: int, cluster: Cluster | str) -> int:
    """How many ranks of a group share a node when its members are `stride` apart in the global rank order
    and ranks fill nodes in order (Megatron's layout: tensor-parallel ranks adjacent, stride 1; a
    data-parallel group of a tp x pp plan, stride tp): gpus_per_node / stride of them, at least 1, at most
    the group."""
    spec = load_cluster(cluster)
    if stride <= 0 or group_size <= 0:
        raise ValueError(f"group_size and stride must be positive, got {group_size} and {stride}")
    return max(1, min(group_size, spec.gpus_per_node // stride))


def collective_record_seconds(c: Any, cluster: Cluster | str, ranks_per_node: int, algorithm: str = "auto") -> float:
    """collective_seconds() of a recorded `fxflops.results.parallel.Collective` (its op, bytes and group size)."""
    return collective_seconds(c.op, c.bytes, c.group_size, cluster, ranks_per_node, algorithm)
