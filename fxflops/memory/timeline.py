"""A captured step read as a timeline of live storages: when each is made, when it is last used.

Every op node of a captured graph carries its fake output (meta["val"]); fake tensors keep storage
identity (a view or an in-place result shares its base's storage), so a storage is counted once, by
its nbytes, from the first node that makes it to the last node that reads or writes it:

- the model's parameters, buffers and inputs, and the optimizer's state, are alive all step;
- a parameter's gradient (its .grad after the backward) from the op that makes it to the step's end;
- a forward value the backward reads is an activation: autograd saved it and frees it when the
  autograd node that reads it returns (what a node reads, its incoming gradient too, lives until
  then); one the forward alone reads is a temporary, freed after its last use;
- a tensor autograd saved inside an op recorded whole (the mask of a dropout recorded as one op)
  first shows up in the backward: it was made by the forward op that backward differentiates;
- the backward's seed gradients live through the backward; the model's output through the step
  (the caller holds it until the step ends);
- the optimizer step adds its temporaries on top of everything still alive after the backward;
- under a parallel plan a sharded (DTensor) parameter, and its gradient, hold their local shard; FSDP2
  frees its all-gathered parameters by resizing their storage to 0 bytes (no op records it) and gathers
  into the same storage again: each copy-out into it (fsdp.split_with_sizes_copy) begins a new life, and
  the storage's size is its tensors' (what the copy-out writes), not the 0 bytes it has at the end.
"""

from __future__ import annotations

import bisect
import operator
import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import torch

from fxflops.capture.backward import AUTOGRAD_NODE, DIFFERENTIATES
from fxflops.capture.inputs import INPUT_INDEX
from fxflops.capture.model_state import MODEL_STATE, ModelState
from fxflops.capture.sharded import is_dtensor
from fxflops.capture.tensor_walk import tensors_in
from fxflops.memory.records import (
    ACTIVATIONS,
    BUFFERS,
    GATHERED,
    GRADIENTS,
    INPUTS,
    KINDS,
    OPTIMIZER,
    OPTIMIZER_STEP,
    PARAMETERS,
    START,
    TEMPORARIES,
    Point,
)
from fxflops.results import BACKWARD, FORWARD, PHASE, RECOMPUTE


@dataclass
class Storage:
    """One storage's life in points of the timeline (inclusive)."""

    nbytes: int
    kind: str
    module: str
    born: int
    last: int


@dataclass(frozen=True)
class _Op:
    node: torch.fx.Node
    phase: str
    module: str


def storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The storage a (fake) tensor's bytes live in, and their number; None for tensors without one."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse, nested and other storage-less tensors: not counted
    nbytes = storage.nbytes()
    if not isinstance(nbytes, int):
        raise ValueError("memory needs concrete sizes: this capture's sizes are symbolic (sweep or sizes=); "
                         "estimate the step at one size instead")
    if nbytes == 0 and tensor.numel():  # resized to 0 since (FSDP2 frees what it gathered so): the bytes it spanned
        nbytes = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    return storage._cdata, nbytes


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes this rank holds: a DTensor's local shard, any other tensor itself."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor


# ops that read a tensor's sizes, not its bytes: FSDP2 reads them of storages it has freed
_METADATA = frozenset({torch.ops.aten.numel.default, torch.ops.aten.size.int, torch.ops.aten.size.default,
                       torch.ops.aten.stride.int, torch.ops.aten.stride.default, torch.ops.aten.sym_size.int,
                       torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int,
                       torch.ops.aten.sym_storage_offset.default})
_FSDP_COPY_IN = "all_gather_copy_in"
_MARKER = re.compile(r"FSDP::(\w+)(?: \((.*)\))?")
_FSDP_COPY_OUT = "split_with_sizes_copy"


def _fsdp_op(node: torch.fx.Node) -> str:
    """The name of FSDP2's own op (namespace fsdp) a node runs, "" for any other."""
    target = node.target
    if getattr(target, "namespace", None) != "fsdp":
        return ""
    packet = getattr(target, "_overloadpacket", None)
    return getattr(packet, "__name__", "")


def _fsdp_markers(ops: list[torch.fx.Node]) -> list[tuple[int, str, str]]:
    """(point, event, FSDP module) of each record_function FSDP2 enters ("FSDP::post_forward (layers.0)";
    the root's carry no module): when it gathers into and frees a module's parameters."""
    found = []
    for point, node in enumerate(ops, start=1):
        if node.target is not torch.ops.profiler._record_function_enter_new.default or not node.args:
            continue
        match = _MARKER.fullmatch(str(node.args[0]))
        if match:
            found.append((point, match.group(1), match.group(2) or ""))
    return found


def _regathers(ops: list[torch.fx.Node], point_of: dict[torch.fx.Node, int],
               markers: list[tuple[int, str, str]]) -> dict[int, list[tuple[torch.fx.Node, str]]]:
    """Point -> (out-view, FSDP module) of what FSDP2's copy-out writes whose (re)allocation that point begins:
    each out tensor's life begins at the first view of it made for the copy-out (after alloc_storage resized
    it back); the module is the one the copy-out's own marker names."""
    starts: dict[int, list[tuple[torch.fx.Node, str]]] = {}
    copy_outs = [(point, module) for point, event, module in markers if event == "all_gather_copy_out"]
    for node in ops:
        if _fsdp_op(node) != _FSDP_COPY_OUT:
            continue
        here = point_of[node]
        module = next((module for point, module in reversed(copy_outs) if point < here), "")
        outs = node.kwargs.get("out", node.args[3] if len(node.args) > 3 else ())
        for out in outs if isinstance(outs, list | tuple) else ():
            if isinstance(out, torch.fx.Node):
                first = out  # out is t.view(world_size, -1) (and .view(uint8)): the first of those views
                while first.target is torch.ops.aten.view.default and first.args \
                        and isinstance(first.args[0], torch.fx.Node) and first.args[0].target is torch.ops.aten.view.default:
                    first = first.args[0]
                starts.setdefault(point_of.get(first, here), []).append((out, module))
    return starts


def _freed_by_fsdp(lives: dict[object, list[tuple[Storage, str]]], markers: list[tuple[int, str, str]]) -> None:
    """Each life of a gathered parameter lasts until FSDP2 frees it, not its last read: the module's next
    reshard after that read (post_forward, when gathered again later; else post_backward_reshard)."""
    for found in lives.values():
        for index, (life, module) in enumerate(found):
            events = ("post_forward", "post_backward_reshard") if index + 1 < len(found) else ("post_backward_reshard",)
            life.last = next((point for point, event, where in markers
                              if point >= life.last and where == module and event in events), life.last)


def _storages(value: object, alias: dict[int, int] | None = None) -> Iterable[tuple[int, int]]:
    for tensor in tensors_in(value):
        found = storage_key(tensor)
        if found is not None and found[1]:
            yield (alias.get(found[0], found[0]), found[1]) if alias else found


def stolen_grads(ops: list[torch.fx.Node], grads: set[int], accumulate: bool = False) -> dict[int, int]:
    """Gradient copies the capture made that a real backward does not: storage of the copy -> storage
    of the gradient autograd would keep instead.

    AccumulateGrad keeps the incoming gradient itself as .grad (a detach, no bytes) when nothing else
    holds it and its strides are the parameter's; otherwise it copies it into a new tensor
    (new_empty_strided + copy_). While a capture records, its record holds every value, so the capture
    always sees the copy: where the source has the parameter's strides and nothing reads it after the
    copy, the real step steals it, and the copy's storage is the source's. With `accumulate` (the
    parameter has a .grad already), AccumulateGrad adds the source into it in place: no copy either.
    """
    last_read: dict[int, int] = {}
    for index, node in enumerate(ops):
        for source in node.all_input_nodes:
            for key, _ in _storages(source.meta.get("val")):
                last_read[key] = index
    alias = {}
    for index, node in enumerate(ops):
        if node.target is not torch.ops.aten.copy_.default or DIFFERENTIATES in node.meta \
                or node.meta.get(PHASE, FORWARD) == FORWARD or len(node.args) < 2:
            continue
        target, source = node.args[0], node.args[1]
        if not isinstance(target, torch.fx.Node) or not isinstance(source, torch.fx.Node) \
                or target.target is not torch.ops.aten.new_empty_strided.default:
            continue
        made, given = target.meta.get("val"), source.meta.get("val")
        if not isinstance(made, torch.Tensor) or not isinstance(given, torch.Tensor):
            continue
        made_key, given_key = storage_key(made), storage_key(given)
        if made_key is None or given_key is None or made_key[0] not in grads:
            continue
        if accumulate or made.shape == given.shape and made.stride() == given.stride() \
                and last_read.get(given_key[0]) == index:
            alias[made_key[0]] = given_key[0]
    return alias


def build_timeline(graph_module: torch.fx.GraphModule, *, optimizer_state: int = 0, optimizer_step: int = 0,
                   optimizer_label: str = "", grads_at_start: bool = False, nodes: Collection[str] | None = None,
                   state: ModelState | None = None,
                   output_held: bool = True) -> tuple[list[Point], dict[object, Storage]]:
    """The live bytes at each op of the captured step, and each storage's life.

    Points: 0 is the step's start; one per op node in order; then, with a backward, the optimizer
    step (its temporaries, `optimizer_step` bytes, on top of what is alive) when `optimizer_label`.
    `grads_at_start`: every parameter's .grad exists when the step starts (a micro-batch after the first
    under gradient accumulation, or zero_grad(set_to_none=False)): the backward's gradients are added
    into them and freed.
    `nodes`: the op nodes one pipeline stage runs (the others run on other ranks), with `state` the
    parameters and buffers it holds. A value another stage made is received when this stage first reads
    it, and what this stage's forward receives or sends is held until its backward ends (a pipeline stage
    keeps a micro-batch's inputs and outputs for its backward, as torch.distributed.pipelining's does).
    `output_held`: the caller holds the model's output until the step ends; False: it lives as autograd and the
    ops reading it keep it (a loop that keeps only the loss).
    """
    state = state or graph_module.meta.get(MODEL_STATE) or ModelState()
    every = [node for node in graph_module.graph.nodes if node.op == "call_function"]
    ops = every if nodes is None else [node for node in every if node.name in nodes]
    infos = [_Op(node, node.meta.get(PHASE, FORWARD), node.meta.get("fxflops_module", ("", ""))[0]) for node in ops]
    point_of = {node: index + 1 for index, node in enumerate(ops)}
    first_backward = next((point_of[i.node] for i in infos if i.phase != FORWARD), None)
    last_op = len(ops)
    end = last_op + (1 if optimizer_label else 0)

    storages: dict[object, Storage] = {}

    def persistent(tensors: Iterable[torch.Tensor], kind: str) -> None:
        for key, nbytes in _storages(list(tensors)):
            storages.setdefault(key, Storage(nbytes, kind, "", 0, end))

    persistent(map(local, state.parameters.values()), PARAMETERS)
    persistent(map(local, state.buffers.values()), BUFFERS)
    read = None if nodes is None else {source for node in ops for source in node.all_input_nodes}
    inputs = [node.meta.get("val") for node in graph_module.graph.find_nodes(op="placeholder")
              if INPUT_INDEX in node.meta and (read is None or node in read)]
    received, sent = _stage_edges(every, ops) if nodes is not None else (set(), set())
    persistent(inputs, INPUTS)
    grads = {key for key, _ in _storages([local(grad) for grad in state.grads.values()])}
    alias = stolen_grads(ops, grads, accumulate=grads_at_start)
    grads = {alias.get(key, key) for key in grads}
    if grads_at_start:  # the .grad tensors, there all step; what the backward makes is added into them
        for index, grad in enumerate(state.grads.values()):
            storages[-1 - index] = Storage(local(grad).untyped_storage().nbytes(), GRADIENTS, "", 0, end)
        grads = set()
    input_grads = {key for key, _ in _storages(state.input_grads)}  # an input's .grad: made, then kept
    alias.update(stolen_grads(ops, input_grads))
    grads |= {alias.get(key, key) for key in input_grads}
    seeds = {key for key, _ in _storages(state.seeds)}
    node_by_name = {node.name: node for node in ops}

    held = _autograd_node_ends(infos)
    markers = _fsdp_markers(ops)
    regathers = _regathers(ops, point_of, markers)
    lives: dict[object, list[tuple[Storage, str]]] = {}  # storage -> each life FSDP2 gathered into it, its module
    for info in infos:
        here = point_of[info.node]
        reads_until = held.get(here, here)
        for out, fsdp_module in regathers.get(here, ()):  # FSDP2 gathers into it (again): a new life
            for key, nbytes in _storages(out.meta.get("val"), alias):
                found = storages.get(key)
                if found is None or found.kind == GATHERED:
                    found = storages[key] = Storage(nbytes, GATHERED, info.module, here, here)
                found.kind = GATHERED  # (the first life began at the allocation, a temporary until now)
                lives.setdefault(key, []).append((found, fsdp_module))
        if _fsdp_op(info.node) == _FSDP_COPY_IN:  # the flat all-gather buffer it fills
            for key, _ in _storages(info.node.meta.get("val"), alias):
                if key in storages:
                    storages[key].kind = GATHERED
        metadata = info.node.target in _METADATA
        for source in info.node.all_input_nodes:
            for key, nbytes in _storages(source.meta.get("val"), alias):
                found = storages.get(key)
                if metadata and found is not None and found.kind == GATHERED:
                    continue  # FSDP2 reads the sizes of what it freed: the bytes are not held for it
                if found is None and key in received:  # made by another stage: received here
                    found = storages[key] = Storage(nbytes, TEMPORARIES, info.module, here, here)
                if found is None:  # a placeholder first read here: a constant, a seed, or saved inside an op
                    found = storages[key] = _first_read(key, nbytes, info, seeds, first_backward, node_by_name,
                                                        point_of, end)
                # a recomputed value is handed to the node by checkpoint's unpack hook, not held by it
                recomputed = 0 < found.born <= len(infos) and infos[found.born - 1].phase == RECOMPUTE
                # (FSDP2's gathered bytes are freed by FSDP2 when it reshards, not by an autograd node)
                found.last = max(found.last, here if recomputed or found.kind == GATHERED else reads_until)
                if info.phase != FORWARD and found.kind == TEMPORARIES and found.born < (first_backward or 0):
                    found.kind = ACTIVATIONS  # made in the forward, read by the backward: saved for it
        for key, nbytes in _storages(info.node.meta.get("val"), alias):  # after its inputs: a view is no birth
            found = storages.get(key)
            if found is None:
                storages[key] = Storage(nbytes, GRADIENTS if key in grads else TEMPORARIES, info.module, here, here)
            else:
                found.last = max(found.last, here)

    spans = _reentrant_recomputes(infos)
    if spans:
        by_birth = sorted(storages.values(), key=lambda storage: storage.born)
        births = [storage.born for storage in by_birth]
        for start, stop in spans:  # the recomputed outputs, held by the checkpoint's backward
            for storage in by_birth[bisect.bisect_left(births, start):bisect.bisect_right(births, stop)]:
                if storage.last == storage.born:
                    storage.last = stop

    held_to = end  # the caller holds the output (and autograd's seeds hold through the backward)
    output = next(iter(graph_module.graph.find_nodes(op="output")), None) if output_held else None
    if output is not None:
        for source in output.all_input_nodes:
            for key, _ in _storages(source.meta.get("val"), alias):
                if key in storages and storages[key].kind not in (PARAMETERS, BUFFERS, INPUTS):
                    storages[key].last = held_to
                    if storages[key].kind == TEMPORARIES:
                        storages[key].kind = ACTIVATIONS
    for key in seeds:  # autograd.backward's caller holds its seeds until the backward returns
        if key in storages:
            storages[key].last = max(storages[key].last, last_op)
    for key in grads:
        if key in storages:
            storages[key].kind = GRADIENTS
            storages[key].last = end
    if first_backward is not None:  # a stage's forward inputs and outputs, held for its backward
        for key in received | {key for node in sent for key, _ in _storages(node.meta.get("val"), alias)}:
            found = storages.get(key)
            if found is not None and found.born < first_backward and found.kind in (TEMPORARIES, ACTIVATIONS):
                found.kind, found.last = ACTIVATIONS, max(found.last, last_op)

    _freed_by_fsdp(lives, markers)
    for key, found in lives.items():  # the ended lives under keys of their own
        for index, (life, _) in enumerate(found[:-1]):
            storages[(key, index)] = life
    points = _points(storages, infos, end, optimizer_state, optimizer_step, optimizer_label)
    return points, storages


def _stage_edges(every: list[torch.fx.Node], ops: list[torch.fx.Node]) -> tuple[set[int], set[torch.fx.Node]]:
    """What crosses into and out of a stage running `ops` of the graph's op nodes `every`: the storages the
    other ops make (received when the stage reads them), and the stage's forward nodes another stage's
    forward reads (sent)."""
    mine = set(ops)
    received: set[int] = set()
    sent: set[torch.fx.Node] = set()
    for node in every:
        if node in mine:
            continue
        received.update(key for key, _ in _storages(node.meta.get("val")))
        if node.meta.get(PHASE, FORWARD) == FORWARD:
            sent.update(source for source in node.all_input_nodes
                        if source in mine and source.meta.get(PHASE, FORWARD) == FORWARD)
    return received, sent


def _autograd_node_ends(infos: list[_Op]) -> dict[int, int]:
    """Point of a backward op -> the last point of the autograd node running it (the run of ops the
    capture saw under the same autograd node). Autograd holds a node's incoming gradient and its saved tensors
    until the node returns, so what any of its ops reads stays alive until then."""
    ends: dict[int, int] = {}
    point_of = {info.node: index for index, info in enumerate(infos, start=1)}
    run: list[int] = []
    current: object = None

    def close() -> None:
        # the engine adds a node's output into a gradient another node gave before (an add reading a
        # value from before the node) after the node returned and released what it held
        while run and _accumulates(infos[run[-1] - 1].node, run[0], point_of):
            run.pop()
        for point in run:
            ends[point] = run[-1]

    for index, info in enumerate(infos, start=1):
        node = info.node
        while node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            node = node.args[0]  # a multi-output op's element: the op's own autograd node
        owner = node.meta.get(AUTOGRAD_NODE) or node.meta.get(DIFFERENTIATES) if info.phase == BACKWARD else None
        if owner is None or owner != current:
            close()
            run = []
        current = owner
        if owner is not None:
            run.append(index)
    close()
    return ends


def _reentrant_recomputes(infos: list[_Op]) -> list[tuple[int, int]]:
    """(first, last) point of each reentrant checkpoint's backward: its recomputed forward and the inner
    backward it runs, which autograd records under nodes made by the recompute (or accumulating grads).

    CheckpointFunction.backward holds the recomputed outputs in a local until its inner backward returns;
    nothing in the graph reads them (autograd reads only their grad_fn)."""
    spans = []
    index = 0
    while index < len(infos):
        info = infos[index]
        running = info.node.meta.get(AUTOGRAD_NODE)
        if info.phase != RECOMPUTE or not running or "Checkpoint" not in running[0]:
            index += 1
            continue
        start = index
        recomputed = set()
        while index < len(infos):
            here = infos[index]
            differentiates = here.node.meta.get(DIFFERENTIATES)
            node = here.node.meta.get(AUTOGRAD_NODE)
            if here.phase == RECOMPUTE:
                recomputed.add(here.node.name)
            elif not (differentiates in recomputed or node == running or node and node[0] == "AccumulateGrad"):
                break
            index += 1
        spans.append((start + 1, index))
    return spans


def _accumulates(node: torch.fx.Node, start: int, point_of: dict[torch.fx.Node, int]) -> bool:
    return node.target is torch.ops.aten.add.Tensor and any(
        point_of.get(source, 0) < start for source in node.all_input_nodes)


def _first_read(key: int, nbytes: int, info: _Op, seeds: set[int], first_backward: int | None,
                node_by_name: dict[str, torch.fx.Node], point_of: dict[torch.fx.Node, int], end: int) -> Storage:
    if key in seeds:
        return Storage(nbytes, TEMPORARIES, info.module, first_backward or point_of[info.node], point_of[info.node])
    if info.phase == FORWARD:  # a tensor the forward met without making it (a plain attribute): all step
        return Storage(nbytes, BUFFERS, info.module, 0, end)
    # saved inside a forward op recorded whole: made when that op ran
    forward = node_by_name.get(info.node.meta.get(DIFFERENTIATES) or "")
    born = point_of[forward] if forward is not None else point_of[info.node]
    module = forward.meta.get("fxflops_module", ("", ""))[0] if forward is not None else info.module
    return Storage(nbytes, ACTIVATIONS, module, born, point_of[info.node])


def _points(storages: dict[object, Storage], infos: list[_Op], end: int, optimizer_state: int, optimizer_step: int,
            optimizer_label: str) -> list[Point]:
    """Sweep births and deaths into live bytes per point, by kind."""
    born: dict[int, list[Storage]] = {}
    dies: dict[int, list[Storage]] = {}
    for storage in storages.values():
        born.setdefault(storage.born, []).append(storage)
        dies.setdefault(storage.last, []).append(storage)
    live = dict.fromkeys(KINDS, 0)
    live[OPTIMIZER] = optimizer_state
    points = []
    labels = [(START, START, "", START)] + [(i.node.name, str(i.node.target), i.module, i.phase) for i in infos]
    if optimizer_label:
        labels.append((OPTIMIZER_STEP, optimizer_label, "", OPTIMIZER_STEP))
    for index, (node, op, module, phase) in enumerate(labels):
        for storage in born.get(index, ()):
            live[storage.kind] += storage.nbytes
        by_kind = dict(live)
        if phase == OPTIMIZER_STEP:
            by_kind[TEMPORARIES] += optimizer_step
        points.append(Point(index, node, op, module, phase, sum(by_kind.values()), by_kind))
        for storage in dies.get(index, ()):
            if storage.last < end:
                live[storage.kind] -= storage.nbytes
    return points


def live_at(storages: dict[object, Storage], index: int,
            keep: Callable[[Storage], bool] = lambda storage: True) -> list[Storage]:
    """The storages alive at point `index`."""
    return [s for s in storages.values() if s.born <= index <= s.last and keep(s)]


__all__ = ["Storage", "build_timeline", "live_at", "local", "stolen_grads", "storage_key"]
