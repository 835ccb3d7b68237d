"""Record every aten op a forward executes as an FX node: its inputs wired to the nodes that produced
them, its output value in meta["val"], the module that ran it and the user's source line.

Shared by the eager method (fake tensors) and the trace method (real tensors, kept as meta values).
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import operator
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from fxflops.capture.block_reads import paused_tracing
from fxflops.capture.attribution import ModuleTracker
from fxflops.capture.backward import AUTOGRAD_NODE, BACKWARD, DIFFERENTIATES, FORWARD, PHASE, GradOwners
from fxflops.capture.branches import both_branches_caution, where
from fxflops.capture.flex import FLEX_HOPS
from fxflops.capture.sharded import propagating_shardings, sharded_types, sharded_values
from fxflops.capture.symbolic_indexing import INDEXING, whole_axis_index
from fxflops.capture.tensor_walk import map_tensors, tensors_in
from fxflops.capture.torch_versions import symbolic_composites
from fxflops.results.costs import FusedCall

SOURCE = "fxflops_source"  # node.meta key: (filename, line) of the user's code that ran the op
# node.meta key: True on a composite op recorded under torch.autocast (its node has the operands as given,
# before autocast cast them to one dtype)
AUTOCAST = "fxflops_autocast"
# node.meta key: the torch.cond branches the op ran in, outermost first, as ((cond, branch index), ...)
COND_BRANCH = "fxflops_cond_branch"
# node.meta key: a FusedCall, on each forward op one call of a FUSED_COMPOSITES composite ran
FUSED_CALL = "fxflops_fused_call"

# code under these is torch's or ours; the first frame outside them is the user's
LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep,
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)
_CAPTURE_ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__init__.py")  # capture() itself
# the built-in examples' models are model code, though fxflops': their forwards are the lines to show
_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cli", "examples.py")


class OpRecorder(TorchDispatchMode):
    """Appends one FX node per aten op executed. `keep` turns an op's output into the value stored on
    its node; `before` sees each op's arguments before it runs; `run` runs it (default: as it is).
    With `owners`, ops also get their phase, and backward ops the module of the forward op they
    differentiate."""

    def __init__(self, tracker: ModuleTracker, root_type: str, keep: Callable[[Any], Any] | None = None,
                 before: Callable[[Any, tuple, dict], None] | None = None,
                 run: Callable[[Any, tuple, dict], Any] | None = None, owners: GradOwners | None = None) -> None:
        super().__init__()
        self.tracker = tracker
        self.owners = owners
        self.graph = torch.fx.Graph()
        self._node_maker = NodeMaker()
        self._root_type = root_type
        self._keep = keep if keep is not None else _same
        self._before = before
        self._run = run
        # which node produced each tensor. Values kept as they are (fake tensors) live on in node.meta
        # anyway, so a plain dict by id is safe and cheap; real tensors (`keep` makes meta copies) are
        # looked up weakly, so the forward's intermediates can be freed
        self._producers: Any = _ProducersById() if keep is None else WeakIdKeyDictionary()
        self._names: dict[Any, str] = {}
        self._inputs = 0
        self._scratch_inputs: list[tuple[torch.fx.Node, Any]] | None = None  # (scratch) placeholders made there
        self.inside_opaque = 0  # > 0 while a function recorded as one op runs its decomposition
        self.cautions: list[str] = []  # what the recorded ops do differently from one run (torch.cond)
        self._branches: list[tuple[int, int]] = []  # the torch.cond branches running now, outermost first
        self._conds = 0
        self._sharded = False  # whether DTensor ops ran (then its sharding propagation's own ops are skipped)
        # (capture.replay under a backward) while a reference records: whether an op ran under saved-tensor hooks
        # (activation checkpointing, offloading), or the forward touched autograd's graph (a tensor hook, retain_grad,
        # grad_fn), both of which make its backward run code a copy cannot prove the same
        self.watching_autograd = False
        self.autograd_touched = False

    supports_higher_order_operators = True  # torch.cond reaches __torch_dispatch__ (the others are refused)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        if sharded_types(types):
            self._sharded = True
            return NotImplemented  # DTensor runs the op on its local shards, which come back here and are recorded
        with paused_tracing():
            if self._before is not None:
                self._before(func, args, kwargs)
            out = func(*args, **kwargs) if self._run is None else self._run(func, args, kwargs)
            if self._sharded and propagating_shardings():
                return out  # DTensor shaping an op's global output on fake tensors: no rank runs it
            # prim::device and prim::layout are metadata queries fake tensors answer through the
            # dispatcher: no arithmetic, no tensor out, and a third of a transformer's calls
            if not self.inside_opaque and func.namespace != "prim":
                self.record(func, args, kwargs, out)
        return out

    def _higher_order(self, func: HigherOrderOperator, args: tuple, kwargs: dict) -> Any:
        """torch.cond runs its branches under this recorder (called with it popped off the mode stack):
        the one a concrete predicate takes, or both (a caution says so) when it is a fake tensor."""
        if self.inside_opaque:  # run by a call recorded whole (flex_attention's autograd): not the model's
            return func(*args, **kwargs)
        if func in FLEX_HOPS:  # flex_attention_backward, which autograd calls past CompositeOps: one node
            out = func(*args, **kwargs)
            self.record(func, args, kwargs, out)
            return out
        if func is not getattr(torch.ops.higher_order, "cond", None) or kwargs:
            raise NotImplementedError(f"the higher-order operator {func.name()} is not recorded op by op; "
                                      "method='export' captures it")
        if self.owners is not None:  # its autograd runs branch graphs of its own, which would go uncounted
            raise NotImplementedError("the backward of torch.cond is not recorded op by op: estimate its forward "
                                      "(backward=False)")
        pred, true_fn, false_fn, operands = args
        with self:
            if not isinstance(pred, torch.Tensor) or not (isinstance(pred, FakeTensor) or pred.is_meta):
                return (true_fn if bool(pred) else false_fn)(*operands)
            cond, self._conds = self._conds, self._conds + 1
            out = self._in_branch(cond, 0, true_fn, operands)
            self._in_branch(cond, 1, false_fn, operands)
        path, type_name = self.tracker.current()
        self.cautions.append(both_branches_caution(where(path, type_name or self._root_type)))
        return out

    def _in_branch(self, cond: int, branch: int, function: Any, operands: Any) -> Any:
        """Run one branch, its ops marked with it (the count stage keeps each op's larger branch)."""
        self._branches.append((cond, branch))
        try:
            return function(*operands)
        finally:
            self._branches.pop()

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        self.inside_opaque += 1  # `keep` may run ops of its own (to meta): they are not the model's
        try:
            self._record(func, args, kwargs, out)
        finally:
            self.inside_opaque -= 1

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        base = self._names.get(func)
        if base is None:
            base = self._names[func] = str(func).replace(".", "_")
        as_arg = self._as_flex_arg if func in FLEX_HOPS and self._keep is not _same else self._as_arg
        node = self._node_maker(self.graph, "call_function", func, map_tensors(args, as_arg),
                                map_tensors(kwargs, as_arg), base)
        meta = node.meta
        meta["val"] = self._keep(out)
        if self._branches:
            meta[COND_BRANCH] = tuple(self._branches)
        phase = FORWARD if self.owners is None else self.owners.phase()
        if phase == BACKWARD or (phase != FORWARD and not self.tracker.stack):
            self._place_backward(node)
        else:
            path, type_name = self.tracker.current()
            meta["fxflops_module"] = (path, type_name or self._root_type)
            meta[SOURCE] = user_frame()
        if self.watching_autograd and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            self.autograd_touched = True
        if self.owners is not None:
            meta[PHASE] = phase
            if phase != FORWARD:
                meta[AUTOGRAD_NODE] = self.owners.running()
            self.owners.claim(node)
        self._register_outputs(node, out)

    def _place_backward(self, node: torch.fx.Node) -> None:
        """A backward op belongs where the forward op it differentiates ran (the root when none)."""
        forward = self.owners.differentiated()
        if not isinstance(forward, torch.fx.Node):  # a parameter's module (accumulating its grad), or none
            path, type_name = forward if forward is not None else ("", "")
            node.meta["fxflops_module"] = (path, type_name or self._root_type)
            node.meta[SOURCE] = None
            return
        node.meta["fxflops_module"] = forward.meta["fxflops_module"]
        node.meta[SOURCE] = forward.meta.get(SOURCE)
        node.meta[DIFFERENTIATES] = forward.meta.get(DIFFERENTIATES, forward.name)

    def _register_outputs(self, node: torch.fx.Node, out: Any) -> None:
        # a multi-output op's tensors are reached through getitem nodes, as in any FX graph
        if isinstance(out, torch.Tensor):
            self._producers[out] = node
        elif isinstance(out, list | tuple):
            for index, item in enumerate(out):
                if isinstance(item, torch.Tensor | list | tuple):
                    element = self._node_maker(self.graph, "call_function", operator.getitem, (node, index), {}, None)
                    element.meta["val"] = self._keep(item)
                    element.meta["fxflops_module"] = node.meta["fxflops_module"]
                    if PHASE in node.meta:
                        element.meta[PHASE] = node.meta[PHASE]
                    self._register_outputs(element, item)

    def _as_flex_arg(self, value: torch.Tensor) -> torch.fx.Node:
        """A flex_attention argument under `keep` (real tensors kept as meta): a BlockMask's block counts
        and indices given from outside stay real (small integer tensors), the only record of which
        blocks it keeps when it has no mask_mod to evaluate (BlockMask.from_kv_blocks)."""
        if value.dtype in (torch.int32, torch.int64) and not value.is_meta and not isinstance(value, FakeTensor):
            return self._as_arg(value, keep=_real_copy)
        return self._as_arg(value)

    def _as_arg(self, value: torch.Tensor, keep: Callable[[Any], Any] | None = None) -> torch.fx.Node:
        producer = self._producers.get(value)
        if producer is None:  # a model input, parameter, buffer or constant: a placeholder
            name = f"input_{self._inputs}"  # (named here: graph.placeholder works the name out from it again)
            producer = self.graph.create_node("placeholder", name, name=name)
            producer.meta["val"] = (keep or self._keep)(value)
            self._inputs += 1
            if self._scratch_inputs is not None:
                self._scratch_inputs.append((producer, value))
            self._producers[value] = producer
        return producer

    # --- for capture.replay: a repeated block's nodes copied from its first call's -----------------

    @property
    def recording_plainly(self) -> bool:
        """Whether ops now recorded are the model's forward ops, one node each (not inside an op recorded
        whole, a torch.cond branch or a backward): only then may a block's nodes stand for its run."""
        return not self.inside_opaque and not self._branches and (self.owners is None or not self.owners.in_backward)

    @contextlib.contextmanager
    def scratch(self) -> Iterator[tuple[torch.fx.Graph, list[tuple[torch.fx.Node, Any]]]]:
        """Ops recorded into a graph of their own (a replayed block's backward run once to be copied:
        capture.block_backward), reading the main graph's nodes: the main graph, its placeholder numbering
        and which node produced each tensor are as before afterwards. Yields the graph and the placeholders
        made in it with their tensors."""
        graph, inputs, producers = self.graph, self._inputs, self._producers
        made: list[tuple[torch.fx.Node, Any]] = []
        self.graph, self._scratch_inputs = torch.fx.Graph(), made
        self._producers = producers.copy()
        try:
            yield self.graph, made
        finally:
            self.graph, self._inputs, self._producers, self._scratch_inputs = graph, inputs, producers, None

    def last_node(self) -> torch.fx.Node | None:
        last = self.graph._root.prev
        return None if last is self.graph._root else last

    def nodes_after(self, mark: torch.fx.Node | None) -> list[torch.fx.Node]:
        """The nodes recorded since `last_node()` returned `mark`, in order."""
        root = self.graph._root
        node = mark.next if mark is not None else root.next
        nodes = []
        while node is not root:
            nodes.append(node)
            node = node.next
        return nodes

    def producer_of(self, tensor: torch.Tensor) -> torch.fx.Node | None:
        return self._producers.get(tensor)

    def input_node(self, tensor: torch.Tensor) -> torch.fx.Node:
        """The node a tensor is read from: its producer, or a new placeholder."""
        return self._as_arg(tensor)

    def produced(self, tensor: torch.Tensor, node: torch.fx.Node) -> None:
        self._producers[tensor] = node

    def copy_node(self, node: torch.fx.Node, args: tuple, kwargs: dict, meta: dict | None = None) -> torch.fx.Node:
        """A node like `node` (same op; a copy of its meta, or of `meta`) reading `args`."""
        base = self._names.get(node.target) if node.target is not operator.getitem else None
        if base is None and node.target is not operator.getitem:
            base = self._names[node.target] = str(node.target).replace(".", "_")
        copy = self._node_maker(self.graph, node.op, node.target, args, kwargs, base)
        copy.meta.update(node.meta if meta is None else meta)  # (assigning .meta would re-index the node)
        return copy

    def unrecorded(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """`function`, running its ops without recording them (they are fxflops', not the model's)."""
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.inside_opaque += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.inside_opaque -= 1
        return wrapped

    def finish(self, output: Any) -> torch.fx.GraphModule:
        self.inside_opaque += 1
        try:
            self.graph.output(tuple(self._as_arg(t) for t in tensors_in(output)))
        finally:
            self.inside_opaque -= 1
        return lazy_graph_module(self.graph)


class NodeMaker:
    """Nodes appended to one graph as `graph.create_node(op, target, args, kwargs, name=name)` appends them,
    named as its namespace names them, less the work create_node repeats on every call: its walk over
    every argument for a raw SymInt, which exists only to warn (a capture keeps such sizes on purpose and
    silences that warning; ~10 us a node), its name's regular expressions (the parts of each name are
    read once), and a second setting of the arguments. A replayed 70B decoder copies ~5,000 nodes: ~3.4 ->
    ~2 us each. Where this torch's Graph lacks a part it uses, or a node-creation hook is installed, it is
    create_node. The graph is given at each call (a recorder records into a scratch graph for a while)."""

    def __init__(self) -> None:
        self._parts: dict[str, tuple[str, int | None, bool] | None] = {}  # a name -> what create_name reads of it
        self._lean: bool | None = None  # whether this torch's Graph has every part used (found at the first node)

    def __call__(self, graph: torch.fx.Graph, op: str, target: Any, args: tuple, kwargs: dict,
                 name: str | None) -> torch.fx.Node:
        if self._lean is None:
            self._lean = _FX_NAMES is not None and _lean_graph(graph)
        if name is None or not self._lean or getattr(graph.owning_module, "_create_node_hooks", None):
            return _created(graph, op, target, args, kwargs, name)
        unique = self._unique(graph._graph_namespace, name)
        if unique is None:
            return _created(graph, op, target, args, kwargs, name)
        node = torch.fx.Node(graph, unique, op, target, args, kwargs)
        graph._graph_namespace._obj_to_name[node] = unique
        graph._insert(node)
        graph._find_nodes_lookup_table.insert(node)
        graph._len += 1
        return node

    def _unique(self, namespace: Any, candidate: str) -> str | None:
        """The name `graph._graph_namespace.create_name(candidate, None)` gives, recorded as it records it;
        None for a candidate whose form it would rewrite (characters no identifier has)."""
        parts = self._parts.get(candidate, _UNREAD)
        if parts is _UNREAD:
            parts = self._parts[candidate] = _name_parts(candidate)
        if parts is None:
            return None
        base, num, illegal = parts
        used = namespace._used_names
        if num is None or candidate in used:
            num = namespace._base_count.get(base, 0)
            if illegal:
                num += 1
                candidate = f"{base}_{num}"
        while candidate in used:
            num += 1
            candidate = f"{base}_{num}"
        used.add(candidate)
        namespace._base_count[base] = num
        return candidate


def _created(graph: torch.fx.Graph, op: str, target: Any, args: tuple, kwargs: dict, name: str | None
             ) -> torch.fx.Node:
    """create_node, the arguments set through the method FX's own `args`/`kwargs` setters call (past its
    walk for raw SymInts)."""
    if not (args or kwargs):
        return graph.create_node(op, target, name=name)
    set_arguments = getattr(torch.fx.Node, "_update_args_kwargs", None)
    if set_arguments is None:  # a torch without it
        return graph.create_node(op, target, args, kwargs, name=name)
    node = graph.create_node(op, target, name=name)
    set_arguments(node, args, kwargs)
    return node


def _lean_graph(graph: torch.fx.Graph) -> bool:
    """Whether `graph` has the parts of create_node NodeMaker does itself."""
    return all(hasattr(graph, name) for name in ("_graph_namespace", "_insert", "_find_nodes_lookup_table", "_len")) \
        and all(hasattr(graph._graph_namespace, name) for name in ("_used_names", "_base_count", "_obj_to_name"))


def _fx_names() -> tuple[Any, Any] | None:
    """FX's name pattern and its names no node may take (keywords, builtins), or None where this torch has other ones."""
    from torch.fx import graph as fx_graph

    pattern, illegal = getattr(fx_graph, "_name_regex", None), getattr(fx_graph, "_illegal_names", None)
    return (pattern, illegal) if pattern is not None and isinstance(illegal, dict) else None


_FX_NAMES = _fx_names()
_UNREAD = object()


def _name_parts(candidate: str) -> tuple[str, int | None, bool] | None:
    """(base, numeric suffix or None, whether the name is one no node may take) as create_name reads a
    candidate; None where it would first rewrite it."""
    pattern, illegal = _FX_NAMES
    match = pattern.match(candidate)
    if match is None:
        return None
    base, suffix = match.group(1, 2)
    return base, (int(suffix) if suffix is not None else None), illegal.get(candidate, None) is not None


def _same(value: Any) -> Any:
    return value


def _real_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone()


class _ProducersById:
    """tensor -> node by identity, holding the tensors (only for values node.meta holds anyway)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[torch.Tensor, torch.fx.Node]] = {}

    def get(self, tensor: torch.Tensor) -> torch.fx.Node | None:
        found = self._by_id.get(id(tensor))
        return None if found is None else found[1]

    def __setitem__(self, tensor: torch.Tensor, node: torch.fx.Node) -> None:
        self._by_id[id(tensor)] = (tensor, node)

    def copy(self) -> _ProducersById:
        copied = _ProducersById()
        copied._by_id = dict(self._by_id)
        return copied


def lazy_graph_module(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule that generates its Python code only if someone calls it: counting never does,
    and code generation costs milliseconds per hundred nodes."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # older torch: the eager GraphModule
        return torch.fx.GraphModule(torch.nn.Module(), graph)
    return _LazyGraphModule(torch.nn.Module(), graph)


def user_frame() -> tuple[str, int] | None:
    """(file, line) of the innermost caller outside torch and fxflops: the code that ran the op. None when
    the walk reaches the capture's entry first: the op ran in torch's modules only (an nn.Sequential), and
    the next frame out is whoever called estimate() (a console script), not a line of the model."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename == _CAPTURE_ENTRY:
            return None
        if not filename.startswith(LIBRARY_DIRS) or filename == _EXAMPLES:
            return (filename, frame.f_lineno)
        frame = frame.f_back
    return None


def source_text(location: tuple[str, int] | None) -> str | None:
    """'File "f.py", line 3: code' for a recorded location (read when a report needs it, not per op)."""
    if location is None:
        return None
    filename, line = location
    return f'File "{filename}", line {line}: {linecache.getline(filename, line).strip()}'


# Composites (CompositeImplicitAutograd: on the fake/meta tensors of a capture they run as the ops they decompose
# into, each counted by its rule) that torch runs on CUDA as ONE fused kernel, forward and backward: the torch
# functions that call them, by the composite's name. The ops one call runs are tagged (FUSED_CALL) so the time
# model times them as that kernel; counts stay the decomposition's.
# - rms_norm: aten/src/ATen/native/layer_norm.cpp's rms_norm_symint calls at::_fused_rms_norm when the input is
#   on CUDA (and MPS/XPU), its backward _fused_rms_norm_backward (torch/_decomp/decompositions.py decomposes both
#   for other devices); added by pytorch/pytorch#153666 (2025), in the torch 2.11 the H100/H200 rows measured and
#   the 2.14 installed here (torch.ops.aten._fused_rms_norm has a CUDA kernel). A Python RMSNorm (Hugging
#   Face's LlamaRMSNorm: pow, mean, rsqrt, mul in the model's code) runs as separate kernels and is not tagged.
FUSED_COMPOSITES: dict[str, tuple[Any, ...]] = {
    "rms_norm": (torch.rms_norm, torch.nn.functional.rms_norm),
}
_FUSED_FUNCTIONS = {function: kind for kind, functions in FUSED_COMPOSITES.items() for function in functions}


def _symbolic_functions() -> frozenset[Any]:
    """capture.symbolic_kernels' SYMBOLIC_FUNCTIONS, imported on use (a capture with named sizes)."""
    from fxflops.capture.symbolic_kernels import SYMBOLIC_FUNCTIONS

    return SYMBOLIC_FUNCTIONS


def _fused_call_items(args: tuple, kwargs: dict, out: Any) -> tuple[int, int, int] | None:
    """(input, weight, output) element sizes of a FUSED_COMPOSITES call (rms_norm's signature: input,
    normalized_shape, weight=None, eps=None; weight 0 without one); None where the input or the output is not
    a tensor (then its ops are timed one by one)."""
    bound = dict(zip(("input", "normalized_shape", "weight", "eps"), args)) | kwargs
    x, weight = bound.get("input"), bound.get("weight")
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    return x.element_size(), weight.element_size() if isinstance(weight, torch.Tensor) else 0, out.element_size()


class CompositeOps(TorchFunctionMode):
    """Records a call of a composite aten op (linear, matmul, conv2d, einsum, scaled_dot_product_attention,
    ... — CompositeImplicitAutograd) as that one op, not as the ops it decomposes into.

    A dispatch-level recorder would otherwise see linear as t + addmm and attention as whichever
    kernel or math fallback the device picks; one node per composite call keeps the graph at the level
    torch.export records (so a rule for aten.linear counts linear under every method), and the count
    the same whatever kernel runs underneath. Only composites `knows_op` accepts (those a rule names) are
    kept whole: one no rule names (linalg.multi_dot, cov, nn.Bilinear's bilinear) is recorded as the
    ops it runs, which rules count, rather than as one unknown op.
    """

    def __init__(self, recorder: OpRecorder, knows_op: Callable[[Any, Any], bool], symbolic: bool = False) -> None:
        super().__init__()
        self._recorder = recorder
        self._knows_op = knows_op
        self._symbolic = symbolic  # the capture has named (symbolic) sizes: see symbolic_composites
        # the functions capture.symbolic_kernels knows at every size; imported on use: a capture without
        # named sizes never reads them (~0.7 ms of a first estimate's imports)
        self._symbolic_functions = _symbolic_functions() if symbolic else frozenset()
        self._composites: dict[Any, tuple[Any, ...]] = {}
        self._fused_calls = 0  # FUSED_COMPOSITES calls seen (each call's number in its FUSED_CALL tags)
        self._in_fused = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._recorder.watching_autograd and _touches_autograd(func):
            self._recorder.autograd_touched = True
        # (on DTensors the call's sizes are global, not the rank's: left to be timed op by op)
        if func in _FUSED_FUNCTIONS and not (self._in_fused or self._recorder.inside_opaque) \
                and not sharded_values(args, kwargs):
            return self._fused(_FUSED_FUNCTIONS[func], func, types, args, kwargs)
        if func in FLEX_HOPS and not self._recorder.inside_opaque:  # one node per call (fxflops.capture.flex)
            return self._whole(func, args, kwargs)
        overloads = self._composites.get(func)
        if overloads is None:
            overloads = self._composites[func] = tuple(op for op in composite_overloads(func) if self._knows_op(op, func))
        # on DTensors, the composite runs as DTensor decomposes it, and the recorder sees the local ops
        whole = overloads and not self._recorder.inside_opaque and not _under_function_transform() \
            and not sharded_values(args, kwargs)
        op = _matching_overload(overloads, args, kwargs) if whole else None
        if op is None:
            if self._symbolic and func in self._symbolic_functions and not self._recorder.inside_opaque:
                known = self._known(func, args, kwargs)
                if known is not NotImplemented:
                    return known
            if self._symbolic and overloads:  # (DTensors: their local ops fold the same matmul)
                with symbolic_composites(overloads[0], args, kwargs):
                    return func(*args, **kwargs)
            if self._symbolic and func in INDEXING:  # a slice of a whole named axis: skipped as at each size
                args = whole_axis_index(func, args)
            return func(*args, **kwargs)
        return self._whole(op, args, kwargs, func)

    def _known(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Named sizes: `func`'s result where capture.symbolic_kernels knows it at every point without running it
        (torch's checks answered from the sizes' assumptions), its aten calls recorded as their dispatch records
        them; else NotImplemented."""
        if _under_function_transform() or sharded_values(args, kwargs):
            return NotImplemented
        # untraced (capture.block_reads) and past the dispatch modes, as an op's dispatch runs its kernel
        from fxflops.capture.symbolic_kernels import symbolic_function  # imported on use: named sizes only

        with paused_tracing(), no_dispatch():
            known = symbolic_function(func, args, kwargs)
        with paused_tracing():
            if known is NotImplemented:
                return NotImplemented
            result, calls = known
            for op, op_args, op_kwargs, out in calls:
                self._recorder.record(op, op_args, op_kwargs, out)
        return result

    def _fused(self, kind: str, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        """Run a FUSED_COMPOSITES call as usual, then tag the forward ops it recorded with one FusedCall."""
        mark = self._recorder.last_node()
        self._in_fused = True  # (F.rms_norm reaches torch.rms_norm only with this mode popped; other paths: once)
        try:
            # the usual path, in __torch_function__ itself: size_one reads the frame that calls `func` there
            out = self.__torch_function__(func, types, args, kwargs)
        finally:
            self._in_fused = False
        items = _fused_call_items(args, kwargs, out)
        if items is not None:
            call, self._fused_calls = self._fused_calls, self._fused_calls + 1
            step = 0
            for node in self._recorder.nodes_after(mark):
                if node.op == "call_function" and node.meta.get(PHASE, FORWARD) != BACKWARD:
                    node.meta[FUSED_CALL] = FusedCall(kind, call, step, *items)
                    step += 1
        return out

    def _whole(self, op: Any, args: tuple, kwargs: dict, func: Any = None) -> Any:
        """Run `func` (default: `op`) with what it runs unrecorded, then record it as one `op` node."""
        self._recorder.inside_opaque += 1
        try:
            with symbolic_composites(op, args, kwargs) if self._symbolic else contextlib.nullcontext():
                out = (func or op)(*args, **kwargs)
        finally:
            self._recorder.inside_opaque -= 1
        self._recorder.record(op, args, kwargs, out)
        if torch._C._is_any_autocast_enabled():  # its operands, as given, are cast as it runs (kernel_checks)
            self._recorder.last_node().meta[AUTOCAST] = True
        return out


_AUTOGRAD_METHODS = frozenset(("register_hook", "retain_grad", "register_post_accumulate_grad_hook"))
_GRAD_FN = torch._C.TensorBase.__dict__["grad_fn"]


def _touches_autograd(func: Any) -> bool:
    """Whether a tensor method registers code for the backward or reaches its graph (a hook, retain_grad,
    grad_fn: the graph's nodes take hooks of their own)."""
    return getattr(func, "__name__", None) in _AUTOGRAD_METHODS or getattr(func, "__self__", None) is _GRAD_FN


def _under_function_transform() -> bool:
    """Whether a torch.func transform (vmap, jvp, grad, ...) is active. A function-level call then sees
    logical values (one vector of a vmapped batch, a primal without its tangent), while the dispatcher
    sees the physical ops the transform runs (the batched matmul, the tangent's too): those are the
    work, and what FlopCounterMode counts, so the composite is recorded as the ops it runs."""
    return torch._C._functorch.peek_interpreter_stack() is not None


_BUILTIN_TYPES = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)

# Python wrappers recorded as the composite they call all the same, because it decomposes into an op of
# another kind: adaptive average pooling to size 1 becomes a mean (a reduction), which a counting
# preset that counts pooling but not reductions (fvcore's) would then miss. Their arguments are the
# aten schema's (input, output_size), and torch.export records them as this one op too.
_WRAPPERS_RECORDED_WHOLE = (torch.nn.functional.adaptive_avg_pool2d, torch.nn.functional.adaptive_avg_pool3d)


def composite_overloads(func: Any) -> tuple[Any, ...]:
    """The CompositeImplicitAutograd overloads of the aten op a builtin torch function binds, if any
    (see _find_composite_overloads); looked up once per function per process (the dispatcher
    queries cost ~0.1 ms per overload)."""
    if not isinstance(func, _BUILTIN_TYPES) and func not in _WRAPPERS_RECORDED_WHOLE:
        return ()  # (decided before the cache, which would keep a user's functions alive)
    return _cached_composite_overloads(func)


@functools.lru_cache(maxsize=4096)
def _cached_composite_overloads(func: Any) -> tuple[Any, ...]:
    return _find_composite_overloads(func)


def _find_composite_overloads(func: Any) -> tuple[Any, ...]:
    """The CompositeImplicitAutograd overloads of the aten op a builtin torch function binds, if any.

    Only builtins (torch.*, torch.nn.functional's C bindings, Tensor methods) are taken: their
    arguments are the aten schema's; Python wrappers' are not, and their inner ops are recorded
    (except _WRAPPERS_RECORDED_WHOLE's)."""
    if not isinstance(func, _BUILTIN_TYPES) and func not in _WRAPPERS_RECORDED_WHOLE:
        return ()
    packet = getattr(torch.ops.aten, getattr(func, "__name__", "").strip("_"), None)
    if packet is None:
        return ()
    found = []
    for name in packet.overloads():
        if name.endswith("out"):
            continue
        try:
            op = getattr(packet, name)
            composite = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
        except (AttributeError, RuntimeError):  # listed overloads that do not exist as operators
            continue
        if composite:
            found.append(op)
    return tuple(found)


def _matching_overload(overloads: tuple[Any, ...], args: tuple, kwargs: dict) -> Any:
    """The overload whose schema takes these arguments (by count, names, tensor-ness and strings)."""
    for op in overloads:
        arguments = op._schema.arguments
        positional = [a for a in arguments if not a.kwarg_only]
        if len(args) > len(positional) or any(key not in {a.name for a in arguments} for key in kwargs):
            continue
        bound = list(zip(positional, args)) + [(a, kwargs[a.name]) for a in arguments if a.name in kwargs]
        if all(_fits(value, str(argument.type)) for argument, value in bound):
            return op
    return None


def _fits(value: Any, type_name: str) -> bool:
    # a tensor never fills a list argument, nor a list a single one: lstm.input and lstm.data (packed
    # sequences) take as many arguments, and only this tells batch_sizes from hx apart
    if isinstance(value, torch.Tensor):
        return "Tensor" in type_name and "List" not in type_name
    if isinstance(value, list | tuple):
        return "List" in type_name
    if isinstance(value, str):
        return "str" in type_name or "Dimname" in type_name
    return value is None or ("Dimname" not in type_name and type_name not in ("Tensor", "str"))
