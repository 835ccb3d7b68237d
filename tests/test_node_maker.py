"""The recorder's NodeMaker appends nodes as Graph.create_node does: the same names, arguments and order."""

from __future__ import annotations

import operator

import torch

from fxflops.capture.recorder import NodeMaker

aten = torch.ops.aten

# names create_name rewrites or numbers in each of its ways: repeats, numeric suffixes taken and free, Python
# keywords and builtins (which no node may take), a base that is another name's numbered form, characters no
# identifier has (left to create_node)
CANDIDATES = ["aten_mm_default", "aten_mm_default", "aten_mm_default_1", "aten_mm_default_7", "aten_mm_default",
              "x_2", "x", "x", "x_2", "for", "for", "max", "max_1", "max", "getitem", "getitem_3", "getitem",
              "aten.add.Tensor", "aten.add.Tensor", "_private", "a_b_10", "a_b", "a_b_10", "print", "x_02", "x_02"]


def _graphs() -> tuple[torch.fx.Graph, torch.fx.Graph]:
    plain, lean = torch.fx.Graph(), torch.fx.Graph()
    for graph in (plain, lean):
        graph.placeholder("x")
    return plain, lean


def test_names_arguments_and_order_are_create_nodes():
    plain, lean = _graphs()
    make = NodeMaker()
    for graph, create in ((plain, lambda g, *a: g.create_node(a[0], a[1], a[2], a[3], name=a[4])), (lean, make)):
        x = next(iter(graph.nodes))
        for index, candidate in enumerate(CANDIDATES):
            args = (x, index) if index % 3 else ()
            kwargs = {"alpha": index} if index % 2 else {}
            create(graph, "call_function", aten.add.Tensor, args, kwargs, candidate)
        create(graph, "call_function", operator.getitem, (x, 0), {}, None)
        graph.output(x)
    assert [n.name for n in lean.nodes] == [n.name for n in plain.nodes]
    assert [(n.op, n.target, n.args[1:] if n.args else n.args, dict(n.kwargs), type(n.kwargs)) for n in lean.nodes] \
        == [(n.op, n.target, n.args[1:] if n.args else n.args, dict(n.kwargs), type(n.kwargs)) for n in plain.nodes]
    x = next(iter(lean.nodes))
    assert len(x.users) == len(next(iter(plain.nodes)).users)
    assert lean._len == plain._len and len(lean.nodes) == len(plain.nodes)
    assert lean.find_nodes(op="call_function", target=aten.add.Tensor) != []
    # the namespace goes on as create_node's would: a later node of the graph's own API is named alike
    assert lean.create_node("call_function", aten.mm.default, name="aten_mm_default").name \
        == plain.create_node("call_function", aten.mm.default, name="aten_mm_default").name
    lean.lint()


def test_a_node_creation_hook_sees_every_node():
    graph = torch.fx.Graph()
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    seen = []
    module._register_create_node_hook(seen.append)
    x = module.graph.placeholder("x")
    made = NodeMaker()(module.graph, "call_function", aten.relu.default, (x,), {}, "aten_relu_default")
    assert seen[-1] is made
