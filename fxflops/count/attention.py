"""Attention readings: dense (every query-key pair) or effective (the pairs the mask keeps).

Each attention node carries both readings; the `attention` option says which one its macs/flops are.
Rules with an `effective` formula read the mask from the op's arguments; attention written as plain
ops (found by fxflops.eager_attention) scales its dense count by the kept fraction.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fxflops.capture.backward import DIFFERENTIATES
from fxflops.count.nodes import call_of, to_count, value_of
from fxflops.eager_attention import EagerAttention, effective_count
from fxflops.results import ROOT_LABEL, NodeCost
from fxflops.rules import Rule, RuleEvaluationError, RuleTable
from fxflops.rules.flex import attention_kept_pairs
from fxflops.rules.kept_pairs import FULL, KeptPairs, attention_grid
from fxflops.rules.polynomial import plain
from fxflops.spelling import did_you_mean

DENSE = "dense"
EFFECTIVE = "effective"
ATTENTION_READINGS = (DENSE, EFFECTIVE)  # how attention ops count: every pair, or the pairs the mask keeps


def check_attention(attention: str) -> None:
    """A ValueError naming the readings for anything but "dense" or "effective"."""
    if attention not in ATTENTION_READINGS:
        raise ValueError(f"attention={attention!r}: say 'dense' (every (query, key) pair, as FlopCounterMode "
                         "counts) or 'effective' (only the pairs the mask keeps)"
                         f"{did_you_mean(attention, ATTENTION_READINGS)}")


def with_effective(cost: NodeCost, graph_module: torch.fx.GraphModule, node: torch.fx.Node, rule: Rule,
                   table: RuleTable, conventions: str, sizes: Any, kept_memo: dict[Any, KeptPairs],
                   attention: str, memo: tuple[dict[Any, tuple[Any, Any]], Any] | None = None,
                   products: dict[str, EagerAttention] | None = None) -> NodeCost:
    """The node's cost with both readings of its attention: effective over the pairs its mask keeps.

    `memo`: (the count's effective counts by (memo key, kept pairs), this node's memo key or None): calls
    with equal keys over the same kept pairs count the same (the layers of a decoder). `products`: a
    forward attention op is entered there by name, with its grid and kept pairs, so the products of a
    backward run as plain ops (SDPA's math backward, taken under dropout) are read as eager attention's
    are: dense x kept / every pair (`attention_of` finds them by the node they differentiate)."""
    args = tuple(value_of(graph_module, a) for a in node.args)
    kwargs = {k: value_of(graph_module, v) for k, v in node.kwargs.items()}
    call = call_of(graph_module, node, args, kwargs, node.meta.get("val"))
    given = call_of(graph_module, node, node.args, node.kwargs, None).names  # the same names, bound to nodes
    kept = attention_kept_pairs(call.key, call.names, given, kept_memo, symbolic=sizes is not None)
    forward = node.meta.get(DIFFERENTIATES)
    if kept is not None and kept.pairs is None and ("node", forward) in kept_memo:
        # a backward kernel reads the mask the autograd graph saved; the forward it differentiates read it
        # as the model built it (same query and key sizes: the same pairs)
        kept = kept_memo[("node", forward)]
    kept_memo[("node", node.name)] = kept
    grid = attention_grid(call.key, call.names) if products is not None and forward is None else None
    if grid is not None:
        products[node.name] = EagerAttention(node.name, node.name, grid, kept or KeptPairs(None, FULL))
    if kept is None:  # no mask: every pair is kept
        kept, macs, flops = KeptPairs(None, FULL), cost.macs, cost.flops
    elif kept.pairs is None:
        macs = flops = None
    else:
        macs, flops = _effective_counts(rule, call, table, conventions, sizes, kept.pairs, cost.module,
                                        *(memo if memo is not None else ({}, None)))
    use = attention == EFFECTIVE and macs is not None
    return dataclasses.replace(
        cost, macs=macs if use else cost.macs, flops=flops if use else cost.flops, attention=kept.pattern,
        dense_macs=cost.macs, dense_flops=cost.flops, effective_macs=macs, effective_flops=flops,
        kept_pairs=to_count(kept.pairs, sizes) if kept.pairs is not None else None,
    )


def _effective_counts(rule: Rule, call: Any, table: RuleTable, conventions: str, sizes: Any, pairs: Any,
                      module: str, memo: dict[Any, tuple[Any, Any]], key: Any) -> tuple[Any, Any]:
    """(MACs, FLOPs) of the call over `pairs` kept pairs, evaluated once per (memo key, pairs)."""
    if key is not None:
        # symbolic pairs by their expression (a SymInt cannot key a dict; the layers of a decoder share it)
        key = (key, type(pairs), pairs.node.expr if isinstance(pairs, torch.SymInt) else pairs)
        try:
            return memo[key]
        except KeyError:
            pass
        except TypeError:  # pairs a key cannot hold (a symbolic size)
            key = None
    try:
        counts = table.effective_cost(rule, call, conventions, pairs, lift=sizes is not None)
    except RuleEvaluationError as error:
        raise error.in_module(module or ROOT_LABEL) from error.__cause__
    counts = to_count(counts[0], sizes), to_count(counts[1], sizes)
    if key is not None:
        memo[key] = counts
    return counts


def with_eager_effective(cost: NodeCost, found: EagerAttention, sizes: Any, attention: str) -> NodeCost:
    """A product of attention written as plain ops, read both ways: effective = dense x kept / all pairs."""
    kept = found.kept
    if kept.pairs is None and kept.pattern == FULL:
        macs, flops = cost.macs, cost.flops
    elif kept.pairs is None:
        macs = flops = None
    else:
        macs, flops = (effective_count(plain(dense), kept.pairs, found.grid, sizes) for dense in (cost.macs, cost.flops))
    use = attention == EFFECTIVE and macs is not None
    return dataclasses.replace(
        cost, macs=macs if use else cost.macs, flops=flops if use else cost.flops, attention=kept.pattern,
        dense_macs=cost.macs, dense_flops=cost.flops, effective_macs=macs, effective_flops=flops,
    )

