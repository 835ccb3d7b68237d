"""A replayed block's backward (capture.replay under backward=True): its copies' backward ops copied from
its reference's, in the order and places a full capture records them.

A copy's outputs come out of one autograd node (`_Copied`) whose inputs are the tensors the block read from
outside that require grad. When autograd reaches it, the reference's backward is run once on the same kind of
gradients (shape, strides, dtype; which are None), with `torch.autograd.grad` into a scratch graph, keeping the
reference's autograd graph for its own backward later (the reference is the first call: its backward runs
last). That run (`Program`) is what the copy's backward is: its ops are copied with the copy's forward nodes,
modules and source lines in place of the reference's, and the gradients it gives the tensors from outside are
handed back to autograd, which carries them on. A leaf's gradient (a parameter's) is accumulated where autograd
would: right after the autograd node that gives it its last part, by the leaf's own AccumulateGrad, run for real
(its ops recorded as a full capture records them).

What is proven before a block's copies are made this way (`refusal`, at the reference): its autograd graph
holds only torch's own nodes (no Python autograd.Function, whose backward is code a copy cannot key), leads
out of the block only to the tensors it read from outside, and its forward neither ran under saved-tensor
hooks (checkpointing, offloading) nor registered hooks or reached grad_fn; its leaves have no hooks. What
can only be seen in the backward makes the whole capture run again without replay (`ReplayRetry`): a
gradient of a copy summed with another (its input used outside it too, a parameter shared), an op the
scratch run records that reads what the copy cannot map, a leaf accumulated twice.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.node import map_arg

from fxflops.capture.backward import (
    AUTOGRAD_NODE,
    BACKWARD,
    DIFFERENTIATES,
    PHASE,
    REPLAYED,
    GradOwners,
    ReplayRetry,
    graph_nodes,
)
from fxflops.capture.block_state import size_key
from fxflops.capture.recorder import SOURCE, OpRecorder

REPLAY_OF = "fxflops_replay_of"  # (capture.replay's) node.meta key: the node a copy copies
_MISSING = object()


class BlockBackward:
    """What a reference call gives its copies' backward: which of the tensors it read from outside take
    gradients (by place), its outputs made in it, and a Program per kind of gradients its outputs get."""

    __slots__ = ("places", "inputs", "outputs", "edges", "nodes_by_name", "programs", "outside", "forward_nodes",
                 "externals")

    def __init__(self, places: list[tuple], inputs: list[torch.Tensor], outputs: list[torch.Tensor],
                 edges: dict[int, Any], forward_nodes: list[torch.fx.Node], externals: dict[torch.fx.Node, tuple],
                 outside: frozenset[int]) -> None:
        self.places = places  # where each input that takes a gradient comes from (capture.block_io.place)
        self.inputs = inputs  # the reference's tensors at those places
        self.outputs = outputs  # the reference's outputs made in the block, in the order of its copies' outputs
        self.edges = edges  # sequence number -> the reference's autograd node (its backward's deliverers)
        self.forward_nodes = set(forward_nodes)  # the reference's forward nodes
        self.nodes_by_name = {node.name: node for node in forward_nodes}  # (a backward op names its forward op's)
        self.externals = externals  # the nodes it read from outside -> their places
        self.outside = outside  # ids of the reference's tensors from outside (a backward may not read them unrecorded)
        self.programs: dict[tuple, Program] = {}


def refusal(outputs: list[torch.Tensor], inputs: list[torch.Tensor], first: int, last: int) -> str | None:
    """Why a reference's backward cannot stand for its copies' (None: it can): its autograd graph, made with
    sequence numbers first..last-1, must hold only torch's own nodes and lead out of the block only to
    `inputs` (the tensors from outside that take gradients), whose leaves carry no hooks."""
    leaves = set()
    exits = set()
    for tensor in inputs:
        if tensor.grad_fn is None:
            leaves.add(id(tensor))
            if tensor._backward_hooks or getattr(tensor, "_post_accumulate_grad_hooks", None):
                return "a tensor it reads from outside has gradient hooks"
        else:
            exits.add((id(tensor.grad_fn), tensor.output_nr))
    for node in graph_nodes(outputs, lambda child, number: (id(child), number) in exits
                            or id(getattr(child, "variable", None)) in leaves):
        if not (first <= node._sequence_nr() < last) or getattr(node, "variable", None) is not None:
            return "its outputs' gradients reach a tensor from outside it that is not one it read"
        if type(node).__module__ != "builtins" or node.metadata:  # a Python autograd.Function, or tagged
            return f"its backward runs {type(node).__name__}, code a copy cannot key"
    return None


def deliverers(outputs: list[torch.Tensor], first: int, last: int) -> dict[int, Any]:
    """The reference's autograd nodes by sequence number (a backward op names the node that ran it)."""
    return {node._sequence_nr(): node for node in graph_nodes(
        outputs, lambda child, _: not first <= child._sequence_nr() < last or hasattr(child, "variable"))}


class Program:
    """The reference's backward for one kind of output gradients, as a copy replays it: its ops (node, args,
    kwargs, meta; args naming the scratch nodes, the reference's nodes or `Grad`/`Fresh` stand-ins), where
    each leaf's accumulation falls, and what each input's gradient is."""

    __slots__ = ("steps", "sources", "results", "first_copies", "accumulations")

    def __init__(self) -> None:
        self.steps: list[tuple] = []  # ("op", node, args, kwargs, meta) | ("accumulate", input index)
        self.sources: dict[torch.fx.Node, tuple] = {}  # a node read from outside the run -> ("fwd"|"ext"|"grad"|"fresh", ...)
        self.results: list[tuple] = []  # per input: ("none",) | ("grad", j) | ("node", scratch node, tensor)
        self.first_copies: dict[torch.fx.Node, str] | None = None  # scratch node -> its first copy's name
        # (input index, the leaf's layout) -> what its AccumulateGrad recorded the first time (Accumulation), or
        # None where that cannot be copied (it runs every time)
        self.accumulations: dict[tuple, Accumulation | None] = {}


class Accumulation:
    """The ops a leaf's AccumulateGrad recorded (its gradient copied into a new .grad), to copy for the same leaf
    at the same place of another copy: the same op on a gradient of the same layout, into a leaf of the same
    layout whose .grad is None, does the same."""

    __slots__ = ("steps", "grad", "final", "first_module")

    def __init__(self, steps: list[tuple], grad: torch.fx.Node, final: int, first_module: tuple) -> None:
        self.steps = steps  # (node, args, kwargs, meta)
        self.grad = grad  # the node of the gradient it was given
        self.final = final  # id of the tensor it left in .grad (one of the steps' values)
        self.first_module = first_module

    @staticmethod
    def of(nodes: list[torch.fx.Node], grad: torch.fx.Node | None, final: Any) -> Accumulation | None:
        inside = set(nodes)
        values = set()
        for node in nodes:
            value = node.meta.get("val")
            if node.op != "call_function" or not isinstance(value, torch.Tensor) \
                    or any(used not in inside and used is not grad for used in node.all_input_nodes):
                return None
            values.add(id(value))
        if grad is None or not nodes or id(final) not in values:
            return None
        return Accumulation([(node, node.args, node.kwargs, dict(node.meta)) for node in nodes], grad, id(final),
                            nodes[0].meta.get("fxflops_module"))


def gradient_key(grads: tuple) -> tuple:
    """What a block's backward program can depend on of its output gradients (symbolic sizes by expression)."""
    return tuple(None if grad is None else (tuple(map(size_key, grad.shape)), tuple(map(size_key, grad.stride())),
                                            size_key(grad.storage_offset()), grad.dtype, grad.device, type(grad))
                 for grad in grads)


def record_program(backward: BlockBackward, recorder: OpRecorder, owners: GradOwners, grads: tuple) -> Program:
    """Run the reference's backward for `grads` into a scratch graph and make it a Program (or ReplayRetry)."""
    roots = [(output, grad) for output, grad in zip(backward.outputs, grads) if grad is not None and output.requires_grad]
    program = Program()
    if not roots:
        program.results = [("none",)] * len(backward.inputs)
        return program
    grad_producers = {}
    for index, grad in enumerate(grads):
        producer = recorder.producer_of(grad) if grad is not None else None
        if producer is not None:
            grad_producers.setdefault(producer, index)
    with recorder.scratch() as (graph, made):
        owners.rerunning = backward.forward_nodes
        try:
            found = torch.autograd.grad([output for output, _ in roots], backward.inputs, [grad for _, grad in roots],
                                        retain_graph=True, allow_unused=True)
        except ReplayRetry:
            raise
        except Exception as error:  # (the reference's graph freed, ...): a full capture knows
            raise ReplayRetry(f"its reference's backward could not run again: {error}") from error
        finally:
            owners.rerunning = None
        made_by = {node: value for node, value in made}
        for position, value in enumerate(found):
            if value is None:
                program.results.append(("none",))
                continue
            same = next((j for j, grad in enumerate(grads) if grad is value), None)
            producer = recorder.producer_of(value)
            if same is not None:
                program.results.append(("grad", same))
            elif producer is not None and producer.graph is graph and producer.op != "placeholder":
                program.results.append(("node", producer, value))
            else:
                raise ReplayRetry("a gradient its backward gives is made where the copy cannot see")
        nodes = [node for node in graph.nodes if node.op != "placeholder"]
        for node in nodes:
            meta = node.meta
            if meta.get(PHASE) != BACKWARD or node.target is not operator.getitem and DIFFERENTIATES not in meta:
                raise ReplayRetry("its backward ran an op no backward node of it owns")
            for used in node.all_input_nodes:
                if used.graph is graph:
                    if used.op == "placeholder" and used not in program.sources:
                        value = made_by[used]
                        same = next((j for j, grad in enumerate(grads) if grad is value), None)
                        if same is None and id(value) in backward.outside:
                            raise ReplayRetry("its backward reads a tensor from outside it unrecorded")
                        program.sources[used] = ("grad", same) if same is not None else ("fresh", value)
                elif used in grad_producers:
                    program.sources[used] = ("grad", grad_producers[used])
                elif used in backward.forward_nodes:
                    program.sources[used] = ("fwd", used)
                elif used in backward.externals:
                    program.sources[used] = ("ext", used)
                else:
                    raise ReplayRetry("its backward reads a node from outside the block")
            program.steps.append(("op", node, node.args, node.kwargs, dict(meta)))
        _place_accumulations(program, backward, nodes)
        for node in nodes:  # the scratch graph's nodes no longer count as users of the main graph's
            node._update_args_kwargs((), {})
    return program


def _place_accumulations(program: Program, backward: BlockBackward, nodes: list[torch.fx.Node]) -> None:
    """Where each input's accumulation falls, if it is a leaf: right after the autograd node that gave its
    gradient's last part has run (AccumulateGrad nodes run first of what is ready), several after one node in
    the order of that node's edges."""
    position = {node: index for index, node in enumerate(nodes)}
    after: dict[int, list[tuple[int, int]]] = {}
    for index, result in enumerate(program.results):
        if result[0] != "node":
            continue
        producer = result[1]
        while producer.target is operator.getitem and producer.args[0].graph is producer.graph:
            producer = producer.args[0]  # (a multi-output op's part: the op's node ran it)
        running = producer.meta.get(AUTOGRAD_NODE)
        if running is None:
            continue
        last = max(position[node] for node in nodes if node.meta.get(AUTOGRAD_NODE) == running)
        while last + 1 < len(nodes) and nodes[last + 1].target is operator.getitem:
            last += 1
        deliverer = backward.edges.get(running[1])
        tensor = backward.inputs[index]
        order = next((rank for rank, (child, number) in enumerate(deliverer.next_functions if deliverer else ())
                      if (getattr(child, "variable", None) is tensor if tensor.grad_fn is None
                          else child is tensor.grad_fn and number == tensor.output_nr)), len(program.results))
        after.setdefault(last, []).append((order, index))
    steps = []
    for index, step in enumerate(program.steps):
        steps.append(step)
        for _, leaf in sorted(after.get(index, ())):
            steps.append(("accumulate", leaf))
    program.steps = steps


class CopyBackward:
    """One replayed call's backward: its Program copied with its own nodes, when autograd reaches it."""

    __slots__ = ("backward", "recorder", "owners", "path", "reference", "copies", "wired", "inputs", "moved",
                 "fresh", "accumulators")

    def __init__(self, backward: BlockBackward, recorder: OpRecorder, owners: GradOwners, path: str, reference: str,
                 inputs: list[torch.Tensor], fresh: Callable[[torch.Tensor], torch.Tensor],
                 moved: Callable[[str, str, str], str]) -> None:
        self.backward, self.recorder, self.owners = backward, recorder, owners
        self.path, self.reference = path, reference
        self.inputs = inputs
        self.fresh, self.moved = fresh, moved
        self.copies: dict[torch.fx.Node, torch.fx.Node] = {}  # the reference's forward node -> this call's
        self.wired: dict[torch.fx.Node, torch.fx.Node] = {}  # a node read from outside -> this call's
        self.accumulators: list[Any] = []  # each input's gradient edge's node (a leaf's AccumulateGrad)

    def run(self, grads: tuple) -> tuple:
        key = gradient_key(grads)
        program = self.backward.programs.get(key)
        if program is None:
            program = self.backward.programs[key] = record_program(self.backward, self.recorder, self.owners, grads)
        recorder = self.recorder
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        results: dict[torch.fx.Node, torch.Tensor] = {}  # a scratch node whose value is a gradient given out -> this call's
        for result in program.results:
            if result[0] == "node":
                results[result[1]] = self.fresh(result[2])
        first = program.first_copies is None
        names: dict[torch.fx.Node, str] = {} if first else program.first_copies

        def source(node: torch.fx.Node) -> torch.fx.Node:
            found = env.get(node)
            if found is not None:
                return found
            kind = program.sources[node]
            if kind[0] == "fwd":
                found = self.copies[kind[1]]
            elif kind[0] == "ext":
                found = self.wired[kind[1]]
            elif kind[0] == "grad":
                found = recorder.input_node(grads[kind[1]])
            else:  # a tensor the reference's forward made unrecorded (inside a composite op): this call's own
                found = recorder.input_node(self.fresh(kind[1]))
            env[node] = found
            return found

        given: list[Any] = [None] * len(self.inputs)
        accumulated = set()
        for step in program.steps:
            if step[0] == "accumulate":
                if self._accumulate(step[1], program, results):
                    accumulated.add(step[1])
                continue
            _, node, args, kwargs, meta = step
            meta = dict(meta)
            forward = self.backward.nodes_by_name.get(meta.get(DIFFERENTIATES)) if DIFFERENTIATES in meta else None
            if forward is not None:
                mine = self.copies[forward]
                meta["fxflops_module"] = mine.meta["fxflops_module"]
                meta[SOURCE] = mine.meta.get(SOURCE)
                meta[DIFFERENTIATES] = mine.meta.get(DIFFERENTIATES, mine.name)
            elif "fxflops_module" in meta:
                where = meta["fxflops_module"]
                meta["fxflops_module"] = (self.moved(where[0], self.reference, self.path), where[1])
            if node in results:
                meta["val"] = results[node]
            if not first:
                meta[REPLAY_OF] = names[node]
            copy = recorder.copy_node(node, map_arg(args, source), map_arg(kwargs, source) if kwargs else {}, meta)
            env[node] = copy
            if first:
                names[node] = copy.name
            if node in results:
                recorder.produced(results[node], copy)
        if first:
            program.first_copies = names
        for index, result in enumerate(program.results):
            if self.inputs[index].grad_fn is None:  # a leaf: accumulated in its place above
                if result[0] != "none" and index not in accumulated:
                    raise ReplayRetry("a leaf's gradient whose accumulation the copy cannot place")
                continue
            if result[0] == "grad":
                given[index] = grads[result[1]]
            elif result[0] == "node":
                given[index] = results[result[1]]
        return tuple(given)

    def _accumulate(self, index: int, program: Program, results: dict) -> bool:
        """A leaf's gradient accumulated by its own AccumulateGrad, as autograd would at this point."""
        leaf = self.inputs[index]
        if leaf.grad_fn is not None:  # not a leaf in this call: autograd carries its gradient on
            return False
        if leaf.grad is not None:  # a second part: a full capture sums the parts before accumulating once
            raise ReplayRetry("a leaf a replayed block reads takes gradients from elsewhere too")
        owners, recorder = self.owners, self.recorder
        grad = results[program.results[index][1]]
        owner = owners.leaf_owner(leaf)
        key = (index, tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.layout, type(leaf))
        done = program.accumulations.get(key, _MISSING)
        if done is not _MISSING and done is not None and owner is not None:
            self._copy_accumulation(done, leaf, grad, owner)
        else:
            mark = recorder.last_node()
            owners.accumulating = leaf
            try:
                self.accumulators[index](grad)
            finally:
                owners.accumulating = None
            if done is _MISSING:
                program.accumulations[key] = Accumulation.of(recorder.nodes_after(mark), recorder.producer_of(grad),
                                                             leaf.grad) if owner is not None else None
        owners.accumulated.add(id(leaf))
        return True

    def _copy_accumulation(self, done: Accumulation, leaf: torch.Tensor, grad: torch.Tensor, owner: tuple) -> None:
        """What the leaf's AccumulateGrad would record, copied from the first one's (its module the leaf's own)."""
        recorder = self.recorder
        env = {done.grad: recorder.producer_of(grad)}
        fresh: dict[int, torch.Tensor] = {}
        for node, args, kwargs, meta in done.steps:
            meta = dict(meta)
            value = meta["val"]
            made = fresh.get(id(value))
            if made is None:
                made = fresh[id(value)] = self.fresh(value)
            meta["val"] = made
            meta["fxflops_module"] = (owner[0], owner[1] or done.first_module[1])
            copy = recorder.copy_node(node, map_arg(args, env.__getitem__), map_arg(kwargs, env.__getitem__), meta)
            env[node] = copy
            recorder.produced(made, copy)
        leaf.grad = fresh[done.final]


class _Copied(torch.autograd.Function):
    """The autograd node of a replayed call: its outputs (made fresh, like the reference's) depend on the tensors
    from outside that take gradients, and its backward is the reference's, copied (CopyBackward)."""

    @staticmethod
    def forward(ctx: Any, copy: CopyBackward, make: Callable[[], list[torch.Tensor]], *inputs: torch.Tensor) -> Any:
        ctx.copy = copy
        ctx.set_materialize_grads(False)
        outputs = make()
        ctx.mark_non_differentiable(*[out for out, like in zip(outputs, copy.backward.outputs) if not like.requires_grad])
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        copy = ctx.copy
        owners = copy.owners
        if owners.accumulating is not None or owners.rerunning is not None:
            raise ReplayRetry("a replayed block's backward inside another's")
        return (None, None, *copy.run(grads))


def attached(copy: CopyBackward, make: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """The copy's fresh outputs, made by `make`, as outputs of its autograd node."""
    outputs = _Copied.apply(copy, make, *copy.inputs)
    grad_fn = next((out.grad_fn for out in outputs if out.grad_fn is not None), None)
    if grad_fn is not None:
        grad_fn.metadata[REPLAYED] = True
        copy.accumulators = [child for child, _ in grad_fn.next_functions]
    return list(outputs)
