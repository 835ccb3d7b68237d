"""Time per collective on a cluster: an α-β model per link type, ring and tree algorithms, hierarchical
collectives when a group spans nodes.

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
messages, its gain is the log-depth latency. `algorithm="auto"` takes the faster of the two.

A group spanning nodes (`ranks_per_node` < group size) runs hierarchically, as NCCL does: an intra-node
reduce-scatter, then an all-reduce among the nodes (each of a node's g ranks on its 1/g of the buffer, over
its share of the node's adapters), then an intra-node all-gather. All-gather and reduce-scatter are the
inter-node step and the intra-node step; all-to-all sends the share addressed off the node over the
network and the rest over the intra-node link at the same time. Every GPU of a node is assumed to talk
across nodes at once (data-parallel groups run in lockstep), so a rank gets its node's network bandwidth
divided by its GPUs (`Cluster.inter_bandwidth_per_gpu`): one rail each on a DGX.
"""

from __future__ import annotations

import math
from typing import Any

from fxflops.predict.hardware import Cluster, cluster as load_cluster

ALGORITHMS = ("auto", "ring", "tree")
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
    (the rest on other nodes, as many per node). `algorithm`: "auto" (the faster), "ring" or "tree"."""
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
        return flat_seconds(op, payload_bytes, n, spec.intra_bandwidth, spec.intra_latency, algorithm)
    nodes = math.ceil(n / g)
    inter_bw, inter_lat = spec.inter_bandwidth_per_gpu, spec.inter_latency
    intra_bw, intra_lat = spec.intra_bandwidth, spec.intra_latency
    size = float(payload_bytes)
    if op == "all_reduce":
        return (flat_seconds("reduce_scatter", size, g, intra_bw, intra_lat)
                + flat_seconds("all_reduce", size / g, nodes, inter_bw, inter_lat, algorithm)
                + flat_seconds("all_gather", size, g, intra_bw, intra_lat))
    if op in ("all_gather", "reduce_scatter", "gather", "scatter"):
        return (flat_seconds(op, size / g, nodes, inter_bw, inter_lat)
                + flat_seconds(op, size, g, intra_bw, intra_lat))
    if op == "all_to_all":
        off_node = size * (n - g) / n  # what this rank addresses to ranks on other nodes
        on_node = size * (g - 1) / n
        return max(off_node / inter_bw + (nodes - 1) * inter_lat,
                   on_node / intra_bw + (g - 1) * intra_lat)
    if op in ("broadcast", "reduce"):
        return (flat_seconds(op, size, nodes, inter_bw, inter_lat, algorithm)
                + flat_seconds(op, size, g, intra_bw, intra_lat, algorithm))
    if op in ("send", "recv"):  # the peer is on another node: one adapter
        return size / spec.inter_bandwidth + inter_lat
    return flat_seconds("barrier", 0, nodes, inter_bw, inter_lat) + flat_seconds("barrier", 0, g, intra_bw, intra_lat)


def collective_record_seconds(c: Any, cluster: Cluster | str, ranks_per_node: int, algorithm: str = "auto") -> float:
    """collective_seconds() of a recorded `fxflops.results.parallel.Collective` (its op, bytes and group size)."""
    return collective_seconds(c.op, c.bytes, c.group_size, cluster, ranks_per_node, algorithm)
