"""Control flow a graph holds as higher-order ops: torch.cond keeps both branches, torch.while_loop its
body once. Counting every node of such a graph is not one run's cost, so each gets a caution.

A run takes one branch, decided by values a capture does not have. Where both branches are captured,
each op counts in the branch where it costs more (fxflops.count.branches), as FlopCounterMode counts a cond:
an upper bound of either branch. (FlopCounterMode itself adds both branches of an op in a module it
had already counted something in before the cond: its per-branch copies of the counts are shallow.)
"""

from __future__ import annotations

import torch


def control_flow_cautions(graph_module: torch.fx.GraphModule) -> list[str]:
    """One sentence per torch.cond / torch.while_loop node in the graph or its subgraphs."""
    higher_order = getattr(torch.ops, "higher_order", None)
    cond = getattr(higher_order, "cond", None)
    loop = getattr(higher_order, "while_loop", None)
    cautions = []
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function" or node.target not in (cond, loop):
                continue
            place = _where(node)
            if node.target is cond:
                cautions.append(both_branches_caution(place))
            else:
                cautions.append(f"torch.while_loop {place}: its body is counted once, however many times a run "
                                "repeats it")
    return cautions


def _where(node: torch.fx.Node) -> str:
    # (no source line: export records a cond's call in code dynamo generated, not the user's line)
    path, type_name = node.meta.get("fxflops_module", ("", ""))
    return where(path, type_name)


def where(path: str, type_name: str) -> str:
    return f"in module '{path}' ({type_name})" if path else f"in the model ({type_name})"


def both_branches_caution(place: str) -> str:
    return (f"torch.cond {place}: both branches are captured and each op counts where its branch costs more (as "
            "FlopCounterMode counts a cond), so the totals are an upper bound (a run takes one branch). "
            "method='trace' counts the branch the example inputs take")
