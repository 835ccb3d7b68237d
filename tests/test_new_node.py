"""fxflops.capture.recorder.NodeMaker: a node as Graph.create_node makes it, less the raw-SymInt scan."""

from __future__ import annotations

import operator
import warnings

import torch

from fxflops.capture.recorder import NodeMaker


def new_node(*args):
    return NodeMaker()(*args)


def _twin_graphs():
    made = []
    for make in (lambda g, *a: g.create_node(*a[:4], name=a[4]), new_node):
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        y = graph.placeholder("y")
        add = make(graph, "call_function", torch.ops.aten.add.Tensor, (x, y), {"alpha": 2}, "add")
        cat = make(graph, "call_function", torch.ops.aten.cat.default, ([add, x],), {}, None)
        parts = make(graph, "call_function", torch.ops.aten.split.Tensor, (cat, 1), {}, "split")
        first = make(graph, "call_function", operator.getitem, (parts, 0), {}, None)
        bare = make(graph, "call_function", torch.ops.aten.empty.memory_format, (), {}, "empty")
        graph.output((first, bare))
        graph.lint()
        made.append(graph)
    return made


def _described(graph: torch.fx.Graph) -> list:
    return [(node.op, node.name, node.target, str(node.args), str(dict(node.kwargs)),
             sorted(user.name for user in node.users), [n.name for n in node.all_input_nodes])
            for node in graph.nodes]


def test_a_new_node_is_wired_and_named_as_create_node_makes_it():
    through_fx, ours = _twin_graphs()
    assert _described(ours) == _described(through_fx)
    assert str(ours.python_code("self").src) == str(through_fx.python_code("self").src)
    assert ours.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)[0].kwargs == {"alpha": 2}


def test_a_new_node_holding_a_symbolic_size_does_not_warn():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    size = env.create_unbacked_symint()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        node = new_node(graph, "call_function", torch.ops.aten.view.default, (x, [size, 2]), {}, "view")
    assert node.args[1][0] is size and list(x.users) == [node]
