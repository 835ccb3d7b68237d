"""Repeated blocks: a module call that provably runs the program an earlier call ran is not run again;
the earlier call's nodes are copied in its place.

Calls reach `_call` through torch's own per-instance slot `_compiled_call_impl` (nothing of the model
is swapped: class, `forward` and attributes stay as they are; a `forward()` called directly runs as it
is). A block's first call (the reference) runs and is recorded as usual while `block_reads.Tracer`
notes the lines of code it runs. A later call of a module of the same class replays the reference when:

- its arguments are equal: tensors by shape, strides, dtype, device and flags (fake tensors hold no
  values; a real one's values are keyed), plain values by value (floats by their bits), the same
  tensor in the same places, an object of Python classes (a cache) by identity, and nothing else; and
  torch's global settings are equal (grad, inference mode, autocast per device and
  its dtype, determinism, default dtype and device, attention kernels: `block_state.torch_state`);
- its state is equal (`BlockState`): every module of the block by class, training flag, name and
  submodules, parameters and buffers by metadata, attributes as deep as they go (`Keyer`), except
  attributes whose names occur on no line the reference ran (a layer index that only picks a cache
  slot when no cache is given) — unless it read attributes by computed names (`vars`, `__dict__`);
- what the reference read outside its modules and arguments holds what it held: the globals its code
  read, and the attributes (by the names it read) of the modules and classes it reached;
- the reference was self-contained and keyable: it wrote into no tensor from outside the block, changed
  no module attribute nor an argument's contents, wrote no global nor an enclosing function's variable,
  read no object identity, frame or whole namespace, may not have changed a mutable global it read,
  ran no torch.cond and no module counted whole, had no hook, and returned tensors (made in the block,
  or its inputs or its own tensors) and plain values in tuples, lists and dicts.

A block handed an object (a cache) makes each call it made on it again, for real, at each copy, with the
copy's tensors and attributes, and goes on only where the call returned and ran what it did at the reference
(`capture.block_calls`, which says what is proven first; else the capture runs again without replay).

The block's program is then a function of what was compared, so the call would run the same ops on
the same shapes: the reference's nodes are copied with their module paths moved to this call's and
their inputs wired to this call's tensors, the module calls it made are counted again, and fresh fake
tensors shaped like the reference's outputs are returned. What cannot be proven is left to the plain
path: the call runs. With FXFLOPS_VERIFY_REPLAY=1 every call that would be replayed runs as well, and a
difference from the copy warns (`ReplayMismatch`). Under a backward the copies' backward ops are copied too
(`capture.block_backward`): the fresh outputs come out of an autograd node that copies the reference's backward;
verification then captures twice, with and without replay, and compares every node (`verified_backward`).
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.node import map_arg
from torch.utils._mode_utils import no_dispatch

from fxflops.capture.attribution import ModuleTracker
from fxflops.capture.backward import DIFFERENTIATES, PHASE, GradOwners, ReplayRetry
from fxflops.capture.block_calls import (Marks, Through, build, check, handed_calls, remake, result_tensors,
                                         tensor_keys, value_at, writes_elsewhere)
from fxflops.capture.block_backward import REPLAY_OF, BlockBackward, CopyBackward, attached, deliverers, refusal
from fxflops.capture.block_hooks import LOCAL, SHARDED, is_sharded, local_of
from fxflops.capture.block_io import node_specs, place, place_of, rebuild, resolve, swapped, written_outside
from fxflops.capture.block_reads import ReadLog, Tracer, paused_tracing
from fxflops.capture.block_state import MODULE_INTERNALS, BlockState, CallKey, Keyer, Unsupported, structure_ids
from fxflops.capture.input_values import reads_values
from fxflops.capture.module_walk import unique_modules
from fxflops.capture.recorder import SOURCE, OpRecorder, user_frame
from fxflops.capture.symbolic_pooling import contiguous_as_expressions

_MAX_TEMPLATES = 4  # programs kept per (structure, arguments); a block whose every call differs stops trying
_MAX_UNMATCHED = 2  # blocks recorded at their first call and not yet matched, beyond which first calls only run
_MAX_OUTSIDE = 4096  # globals and namespace entries a reference may read and still be replayed
_MISSING = object()
VERIFY_ENV = "FXFLOPS_VERIFY_REPLAY"  # set (not "0"): every matched call runs too, and a difference warns


class Template:
    """A reference call: its state, what it read, and how to copy its nodes; or why it cannot be copied."""

    __slots__ = ("state", "free", "refused", "path", "site", "nodes", "externals", "output", "produced", "calls",
                 "log", "outside", "plan", "backward", "sequence", "throughs", "passed", "made_in_calls",
                 "shapes")

    def __init__(self, state: BlockState, path: str, site: tuple[str, int] | None) -> None:
        self.state = state
        self.path = path
        self.site = site  # the user's line that called the block: the source of ops run in library code
        self.free: frozenset[tuple[str, str]] = frozenset()  # attributes its code never read
        self.log = ReadLog()
        self.outside: list[tuple[Any, str, Any, Any]] = []  # (namespace, name, value, key): globals and the like
        self.refused: str | None = None
        self.nodes: list[torch.fx.Node] = []
        self.externals: list[tuple[torch.fx.Node, tuple]] = []
        self.output: Any = None  # the output's structure: ("node", producer, tensor), ("input", n), ...
        # (node, output tensor it produced): the reference's output tensors made in it, each once
        self.produced: list[tuple[torch.fx.Node, torch.Tensor]] = []
        self.calls: list[tuple[Any, int]] = []
        self.plan: list[tuple] | None = None  # (Replays._plan) how to copy each node, made at the first copy
        self.backward: BlockBackward | None = None  # under a backward: how its copies' backward is copied
        self.sequence = (0, 0)  # the autograd sequence numbers its forward handed out (first, past the last)
        self.throughs: list[Through] = []  # its calls on objects it was handed, made again at each copy
        self.passed: frozenset[tuple[str, str]] = frozenset()  # attributes read only as arguments of those calls
        self.made_in_calls: frozenset[torch.fx.Node] = frozenset()  # its nodes those calls recorded
        # the keys of its outputs as it returned them: code after it may change them in place (`t_()`), and a
        # copy's fresh outputs are made like them
        self.shapes: list | None = None

    def intact(self) -> bool:
        """Whether its outputs are still as it returned them (nothing changed their shape in place since)."""
        return self.shapes is None or tensor_keys([like for _, like in self.produced]) == self.shapes

    def matches(self, state: BlockState) -> bool:
        mine, theirs = self.state.entries, state.entries
        if mine == theirs:
            return True
        if mine.keys() != theirs.keys():
            return False
        return all(entry == mine[relative] or self._differ_where_free(relative, mine[relative], entry)
                   for relative, entry in theirs.items())

    def outside_same(self, slots: dict[type, tuple[str, ...]]) -> bool:
        """Whether every global (and module or class attribute) the reference read holds what it held."""
        keyer = Keyer(slots=slots)
        for namespace, name, value, key in self.outside:
            now = namespace.get(name, _MISSING)
            if not (now is value and Keyer.by_identity(value)) and keyer.key(now) != key:
                return False
        return True

    def _differ_where_free(self, relative: str, mine: tuple, theirs: tuple) -> bool:
        """Whether two states of a module differ only in attributes the reference never read."""
        if mine[0] != theirs[0] or [key for key, _ in mine[1]] != [key for key, _ in theirs[1]]:
            return False
        return all(a == b or (relative, key) in self.free or (relative, key) in self.passed
                   for (key, a), (_, b) in zip(mine[1], theirs[1]))


class Replays:
    """Wraps each module's forward (in its instance dict, which `isolation` restores) to replay repeats."""

    def __init__(self, model: torch.nn.Module, recorder: OpRecorder, tracker: ModuleTracker,
                 mode: FakeTensorMode, owners: GradOwners | None = None, verify: bool | None = None) -> None:
        self._recorder = recorder
        self._owners = owners  # under a backward: copies' backward ops are copied too (capture.block_backward)
        self._tracker = tracker
        self._mode = mode
        modules = [module for _, module in unique_modules(model)]
        self._structures = structure_ids(modules)
        counts = Counter(self._structures.values())
        self._modules = modules[1:]  # not the root: it runs once
        self._with_siblings = {id(module) for module in modules if counts[self._structures[id(module)]] > 1}
        self._calls: dict[int, int] = {}
        self._templates: dict[tuple, list[Template]] = {}
        self._tracer = Tracer(Marks(recorder.last_node, recorder.producer_of, tracker.call_log, self._read_now,
                                    self._changed_since))
        self._states: list[tuple[torch.nn.Module, str, BlockState]] = []  # the references recording, outermost first
        self._torch_classes: dict[type, bool] = {}
        self._slots: dict[type, tuple[str, ...]] = {}  # (Keyer's) each type's slot names
        self._recording = 0  # > 0 while a first reference of its kind runs
        self._references = 0  # > 0 while any reference runs (under a backward, blocks inside it run: its autograd
        # graph must be torch's own, capture.block_backward)
        self._given_up: set[tuple] = set()
        self._refused_handed: set[int] = set()  # ids of objects handed to a block whose reference was refused
        # structure -> the templates of a block recorded at its first call of a kind, until one is matched
        self._unmatched: dict[int, list[Template]] = {}
        self._verify = verifying() if verify is None else verify
        self.mismatches: list[str] = []  # with verification on: each call whose replay would have differed

    def install(self) -> None:
        """Route each module's calls through `_call`, by the slot `Module.__call__` reads first
        (`_compiled_call_impl`, torch's, None unless the module was compiled; `isolation` takes it out of
        the instance again): the class, the model's attributes and `forward` stay as they are, and a
        `forward()` called directly is not seen (its ops are its caller's, as it runs them)."""
        for module in self._modules:
            state = module.__dict__
            if isinstance(module, torch.jit.ScriptModule) or state.get("_compiled_call_impl") is not None:
                continue
            state["_compiled_call_impl"] = self._entry(module)

    def _entry(self, module: torch.nn.Module) -> Callable[..., Any]:
        run = module._call_impl

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(module, run, args, kwargs)
        return call

    # --- a call ------------------------------------------------------------------------------------

    def _call(self, module: torch.nn.Module, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if not self._recorder.recording_plainly or self._owners is not None and (self._references
                                                                                 or saved_tensor_hooks()):
            return original(*args, **kwargs)
        calls = self._calls[id(module)] = self._calls.get(id(module), 0) + 1
        path = self._tracker.name_of(module)
        if path is None or (calls == 1 and id(module) not in self._with_siblings):
            return original(*args, **kwargs)
        try:
            with torch._C.DisableTorchFunction():
                call = CallKey(args, kwargs)
        except Unsupported:
            return original(*args, **kwargs)
        key = (self._structures[id(module)], call.key)
        templates = self._templates.get(key)
        if templates is None:  # a first call of its kind
            templates = self._templates[key] = []
            # a leaf may well be called once, and runs in less than a reference takes to record: its second
            # call is the reference. A block of modules with siblings is recorded at once: a decoder's first
            # layer is then the reference and the second a copy, one layer fewer run. Not while a block of
            # its structure recorded so is still unmatched, nor while _MAX_UNMATCHED of any are: calls may
            # each differ (DenseNet's layers, each given one more feature map), and first calls then only run
            if not module._modules or self._recording or key[0] in self._unmatched \
                    or len(self._unmatched) >= _MAX_UNMATCHED:
                return original(*args, **kwargs)
            self._unmatched[key[0]] = templates
        if key in self._given_up or not templates and self._recording:
            # nothing to match, and no reference taken: inside a first reference a block is not taken
            # as one (when the enclosing block repeats it is replayed whole, and its parts' references
            # would never be used)
            return original(*args, **kwargs)
        try:
            with torch._C.DisableTorchFunction():
                state = BlockState(module, self._tracker.name_of, path, self._slots)
        except Unsupported:
            return original(*args, **kwargs)
        for template in templates:
            if template.matches(state) and (template.refused is not None or template.outside_same(self._slots)):
                if template.refused is not None or not template.intact():
                    return original(*args, **kwargs)
                if self._unmatched.get(key[0]) is templates:
                    del self._unmatched[key[0]]
                if self._verify:
                    return self._verified(template, original, path, args, kwargs)
                with torch._C.DisableTorchFunction():
                    inputs = self._gradient_inputs(template, call, state)
                    if inputs is not None:
                        return self._replay(template, path, call, state, inputs)
                return original(*args, **kwargs)
        if self._recording or not self._tracer.available():
            return original(*args, **kwargs)
        if any(id(handed) in self._refused_handed for handed in call.handed.values()):
            return original(*args, **kwargs)
        if len(templates) == _MAX_TEMPLATES:  # a block whose calls all differ: no longer tried
            self._given_up.add(key)
            return original(*args, **kwargs)
        return self._record(module, original, path, call, state, templates, args, kwargs)

    # --- the reference ------------------------------------------------------------------------------

    def _record(self, module: torch.nn.Module, original: Callable[..., Any], path: str, call: CallKey,
                state: BlockState, templates: list[Template], args: tuple, kwargs: dict) -> Any:
        recorder, tracker = self._recorder, self._tracker
        site = user_frame()
        mark = recorder.last_node()
        first_call = len(tracker.call_log)
        wholes, cautions = len(tracker.whole_calls), len(recorder.cautions)
        exclusive = not templates  # the first of its kind: its parts wait (see _call); a second one may not repeat
        self._recording += exclusive
        backward = self._owners is not None
        if backward:
            watching, touched = recorder.watching_autograd, recorder.autograd_touched
            recorder.watching_autograd, recorder.autograd_touched = True, False
        first = torch.autograd._get_sequence_nr()
        self._references += 1
        before = {key: set(vars(handed)) for key, handed in call.handed.items()}  # (its data names, as it ran)
        self._tracer.start(call.handed)
        self._states.append((module, path, state))
        try:
            out = original(*args, **kwargs)
        finally:
            self._states.pop()
            log = self._tracer.stop()
            self._recording -= exclusive
            self._references -= 1
            if backward:
                touched, recorder.autograd_touched = recorder.autograd_touched, touched or recorder.autograd_touched
                recorder.watching_autograd = watching
        template = Template(state, path, site)
        template.sequence = (first, torch.autograd._get_sequence_nr())
        templates.append(template)
        with torch._C.DisableTorchFunction():
            template.log = log
            if not log.reflective:
                template.free = frozenset(key for key in self._watched(state) if key[1] not in log.names)
            template.refused = log.refused
            if template.refused is None:
                template.refused = self._outside(template, state)
            if template.refused is not None:
                pass
            elif len(tracker.whole_calls) != wholes or len(recorder.cautions) != cautions:
                template.refused = "a module counted whole, or torch.cond, ran in it"
            elif backward and touched:
                template.refused = "its forward ran under saved-tensor hooks, or reached autograd's graph"
            elif backward and call.handed:
                template.refused = "it is handed an object, under a backward"
            else:
                template.refused = self._fill(template, module, call, recorder.nodes_after(mark), out,
                                              args, kwargs, before)
            template.calls = _moved_calls(tracker.call_log[first_call:], path)
            if template.refused is not None and call.handed:
                # the other blocks handed the same object (the next layers, their parts) run the same code with
                # it: refused alike, each further reference would only be traced (the dearest way to run a
                # block) and refused again
                self._refused_handed.update(id(handed) for handed in call.handed.values())
        return out

    def _watched(self, state: BlockState) -> set[tuple[str, str]]:
        """The attributes whose reads the trace sees: those of modules of the user's classes (torch's own
        modules read theirs in torch's code, which is not traced: all of theirs count as read)."""
        watched = set()
        for relative, module in state.modules:
            if not self._torch_class(type(module)):
                watched.update((relative, key) for key in module.__dict__ if key not in MODULE_INTERNALS)
        return watched

    def _torch_class(self, cls: type) -> bool:
        found = self._torch_classes.get(cls)
        if found is None:
            found = self._torch_classes[cls] = any(
                base.__module__.startswith("torch.") for base in cls.__mro__ if base not in (torch.nn.Module, object))
        return found

    def _closures(self, log: ReadLog, state: BlockState, classes: set[type], pending: list) -> str | None:
        """Find the function of each closure that ran and was not made during the call (a decorator's
        wrapper, a function a global holds): its variables are then keyed with it (pending gets it).
        Says why not, where one cannot be found."""
        ran = log.codes
        # (a method's only free variable `__class__`, for super(), is its class for good)
        kept = [code for code in ran if code.co_freevars not in ((), ("__class__",))
                and not any(code in outer.co_consts for outer in ran)]
        if not kept:
            return None
        found: dict[types.CodeType, Any] = {}
        values = [value for cls in classes for value in vars(cls).values()]
        values += [module.__dict__[key] for _, module in state.modules for key in module.__dict__
                   if key not in MODULE_INTERNALS]
        values += [namespace.get(name) for namespace, name in pending]
        objects = [value for value in values if not isinstance(value, type | types.ModuleType | types.FunctionType)]
        values += [item for value in objects for cls in type(value).__mro__[:-1] for item in vars(cls).values()]
        values += [item for value in objects if type(getattr(value, "__dict__", None)) is dict
                   for item in value.__dict__.values()]  # an object's methods and the functions it holds
        while values:
            value = values.pop()
            value = getattr(value, "__func__", None) or getattr(value, "fget", None) or value
            if isinstance(value, types.FunctionType) and value.__code__ not in found:
                found[value.__code__] = value
                values.append(getattr(value, "__wrapped__", None))
        for code in kept:
            if code not in found:
                return f"it runs {code.co_qualname}, a closure whose variables cannot be compared"
            pending.append(({code.co_qualname: found[code]}, code.co_qualname))
        return None

    def _outside(self, template: Template, state: BlockState) -> str | None:
        """Key what the reference read outside its modules and arguments: the globals its code read, and
        the attributes (by the names its code read) of the modules and classes it reached, its modules'
        classes included. Says why not, where one cannot be keyed or may have been changed by the call."""
        log = template.log
        pending = self._read_outside(log, state)
        if isinstance(pending, str):
            return pending
        first, again = Keyer(slots=self._slots), Keyer(slots=self._slots)
        mutates = log.mutates and writes_elsewhere(log)
        for namespace, name in pending:
            value = namespace.get(name, _MISSING)
            key = first.key(value)
            if key != again.key(value):
                return f"it reads {name}, which cannot be compared between calls"
            if isinstance(value, types.ModuleType | type) and name in log.stored \
                    or mutates and _mutable(value):
                return f"it may change {name}, which it reads"
            template.outside.append((namespace, name, value, key))
        return None

    def _read_now(self) -> Any:
        """What the references recording now have read from outside so far, keyed, with their modules' state:
        before each call on an object handed to them (`_changed_since` compares after it)."""
        with torch._C.DisableTorchFunction():
            return self._read_outside_now()

    def _read_outside_now(self) -> Any:
        log = self._tracer.so_far()
        read: dict[tuple[int, str], tuple] = {}
        for _, _, state in self._states:
            pending = self._read_outside(log, state)
            if isinstance(pending, str):  # (the reference is refused for it at its end)
                continue
            keyer = Keyer(slots=self._slots)
            for namespace, name in pending:
                if (id(namespace), name) not in read:
                    value = namespace.get(name, _MISSING)
                    read[(id(namespace), name)] = (namespace, name, value, keyer.key(value))
        return list(read.values()), list(self._states)

    def _changed_since(self, before: Any) -> str | None:
        """What of `before` (`_read_now`) differs now: a global's name, or a block's modules' state."""
        read, states = before
        keyer = Keyer(slots=self._slots)
        with torch._C.DisableTorchFunction():
            for namespace, name, value, key in read:
                now = namespace.get(name, _MISSING)
                if not (now is value and Keyer.by_identity(value)) and keyer.key(now) != key:
                    return f"{name}, which the block read before it"
        for module, path, state in states:
            if not self._same_state(module, path, state):
                return f"the state of {path}"
        return None

    def _same_state(self, module: torch.nn.Module, path: str, state: BlockState) -> bool:
        try:
            with torch._C.DisableTorchFunction():
                return BlockState(module, self._tracker.name_of, path, self._slots).entries == state.entries
        except Unsupported:
            return False

    def _read_outside(self, log: ReadLog, state: BlockState) -> list[tuple[dict, str]] | str:
        """Where the code of `log` read from outside its modules and arguments: (namespace, name) of each
        global, and of the attributes of the modules and classes it reached by the names it read, its
        closures' functions; or why it cannot be known."""
        names = log.names
        pending = list(log.outside.values())
        spaces: set[int] = set()

        def reach(space: Any) -> None:
            if id(space) not in spaces:
                spaces.add(id(space))
                namespace = vars(space)
                pending.extend((namespace, name) for name in names if name in namespace)

        classes = {cls for _, module in state.modules for cls in type(module).__mro__
                   if not self._torch_class(cls) and cls not in (torch.nn.Module, object)}
        for cls in classes:
            reach(cls)
        index = 0
        while index < len(pending):
            namespace, name = pending[index]
            index += 1
            value = namespace.get(name, _MISSING)
            if isinstance(value, types.ModuleType | type):
                reach(value)
            if len(pending) > _MAX_OUTSIDE:
                return "it reads too many globals to compare"
        why = self._closures(log, state, classes, pending)
        return why if why is not None else pending

    def _fill(self, template: Template, module: torch.nn.Module, call: CallKey, nodes: list[torch.fx.Node],
              out: Any, args: tuple, kwargs: dict, before: dict[int, set[str]]) -> str | None:
        """Fill in how to copy the reference; or say why it cannot stand for another call."""
        try:
            after = BlockState(module, self._tracker.name_of, template.path, self._slots)
            again = CallKey(args, kwargs)
        except Unsupported as why:
            return str(why)
        if not template.matches(after):
            return "its forward changed its modules' state"
        if again.key != call.key or any(a is not b for a, b in zip(again.tensors, call.tensors)):
            return "its forward changed its arguments"
        if any(node.op == "call_function" and reads_values(node.target) for node in nodes):
            return "it read tensor values (capture.input_values), which another call's tensors need not share"
        made: frozenset[torch.fx.Node] = frozenset()  # nodes the calls on objects it was handed recorded
        if call.handed or template.log.handed:
            found = handed_calls(template.log, call, template.state, before, nodes, self._watched(template.state))
            if isinstance(found, str):
                return found
            template.throughs, template.passed, made = found
            template.made_in_calls = made
        inside = set(nodes)
        externals: dict[torch.fx.Node, tuple] = {}
        for node in nodes:
            if node.op == "placeholder" and node not in made:
                externals[node] = place(node, call, template.state)
        # a tensor first read in the block (an argument, a global tensor) has its placeholder among the
        # block's nodes: it is from outside all the same; the block's own parameters and buffers are its own
        # (what a call on a handed object recorded runs again at each copy: not read, nor written, by the copy)
        own = {node for node in nodes if node.op != "placeholder" or node in made or externals[node][0] == "state"}
        for node in nodes:
            if node.op == "placeholder" or node in made:
                continue
            for used in node.all_input_nodes:
                if used not in inside and used not in externals:
                    externals[used] = place(used, call, template.state)
            written = written_outside(node, own)
            if written is not None:
                return f"{node.target} writes into {written}, from outside the block"
        template.nodes = [node for node in nodes if node.op != "placeholder"]
        template.externals = list(externals.items())
        try:
            template.output = self._output_spec(out, inside, call, template.state)
        except Unsupported as why:
            return str(why)
        specs = {id(spec[2]): spec for spec in node_specs(template.output)}
        template.produced = [(spec[1], spec[2]) for spec in specs.values()]
        template.shapes = tensor_keys([like for _, like in template.produced])
        if any(producer in made for producer, _ in template.produced):
            return "it returns a tensor a call on an object handed to it made"
        return self._fill_backward(template, inside) if self._owners is not None else None

    def _fill_backward(self, template: Template, inside: set[torch.fx.Node]) -> str | None:
        """How the reference's backward stands for its copies' (capture.block_backward); or why it cannot."""
        outputs = [like for _, like in template.produced]
        if any(like._is_view() for like in outputs):  # a copy's fresh output is no view: autograd would differ
            return "an output that is a view, under a backward"
        if any(like.is_inference() for like in outputs):  # (which autograd refuses to save: a copy's would not be)
            return "an output made in inference mode, under a backward"
        if not template.state.modules[0][1]._modules:
            # a leaf (a Linear): the module holding its weight is often called again (a loop in its parent), whose
            # gradients autograd sums before one accumulation: the capture would have to run again
            return "a leaf module, under a backward"
        places, inputs, seen = [], [], set()
        for node, where in template.externals:
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor) or not value.requires_grad or id(value) in seen:
                continue
            if where[0] == "same" or where[-1] == LOCAL or is_sharded(value):
                return "it reads a tensor that takes gradients and is not its argument nor its own, under a backward"
            if value.grad_fn is None and any(user not in inside for user in node.users):
                return "a leaf it reads that takes gradients is read outside it too, under a backward"
            seen.add(id(value))
            places.append(where)
            inputs.append(value)
        if any(kind[0] == SHARDED for kind in _specs(template.output)):
            return "a sharded output, under a backward"
        first, last = template.sequence
        why = refusal(outputs, inputs, first, last)
        if why is not None:
            return why
        outside = frozenset(id(node.meta.get("val")) for node, _ in template.externals) | frozenset(template.state.tensors)
        template.backward = BlockBackward(places, inputs, outputs, deliverers(outputs, first, last), template.nodes,
                                          dict(template.externals), outside)
        return None

    def _output_spec(self, value: Any, inside: set[torch.fx.Node], call: CallKey, state: BlockState) -> Any:
        kind = type(value)
        if is_sharded(value) and place_of(value, call, state) is None:  # a DTensor made in the block (sequence
            return (SHARDED, self._output_spec(local_of(value), inside, call, state),  # parallelism's stream)
                    value._spec, value.requires_grad)
        if isinstance(value, torch.Tensor):
            producer = self._recorder.producer_of(value)
            if producer in inside and producer.op != "placeholder":
                if kind is not FakeTensor or value.constant is not None:
                    raise Unsupported("an output that is not a plain fake tensor")
                if value._is_view() and self._recorder.producer_of(value._base) not in inside:
                    raise Unsupported("an output that views a tensor from outside the block")
                if type(value.storage_offset()) is not int:  # (compared with 0 it would add a guard)
                    raise Unsupported("an output at a symbolic offset")
                return ("node", producer, value)
            found = place_of(value, call, state)
            if found is None:
                raise Unsupported("an output from outside the block")
            return found
        if kind is tuple or kind is list:
            return (kind, tuple(self._output_spec(item, inside, call, state) for item in value))
        if kind is dict:
            return (dict, tuple((key, self._output_spec(item, inside, call, state)) for key, item in value.items()))
        if value is None or kind in (bool, int, float, str) or id(value) in call.handed:
            return ("plain", value)  # (a handed object: the same object at each call)
        raise Unsupported(f"an output of type {kind.__name__}")

    # --- a repeat -------------------------------------------------------------------------------------

    def _gradient_inputs(self, template: Template, call: CallKey, state: BlockState) -> list[torch.Tensor] | None:
        """Under a backward, the tensors this call reads from outside that take gradients (none without one);
        None where a leaf among them was read before: its gradients are summed before autograd accumulates
        them once, which a copy's accumulation cannot place (the call runs)."""
        if template.backward is None:
            return []
        modules = dict(state.modules)
        inputs = [resolve(where, call, modules) for where in template.backward.places]
        for tensor in inputs:
            if tensor.grad_fn is None:
                read = self._recorder.producer_of(tensor)
                if read is not None and read.users:
                    return None
        return inputs

    def _replay(self, template: Template, path: str, call: CallKey, state: BlockState,
                inputs: list[torch.Tensor]) -> Any:
        recorder = self._recorder
        modules = dict(state.modules)
        wired = {node: self._tensor_at(place, node, call, modules) for node, place in template.externals}
        # the reference's outputs live on in its caller (as this call's input, say): the copies get tensors
        # of their own in their place, so no op sees one tensor where the full capture has two
        backward = None
        if template.backward is not None:  # made as outputs of the autograd node that copies the block's backward
            backward = CopyBackward(template.backward, recorder, self._owners, path, template.path, inputs,
                                    self._fresh, _moved)
            made = self._recorder.unrecorded(self._made_like)
            outputs = attached(backward, lambda: [made(like, False) for _, like in template.produced]) \
                if template.produced else []
            fresh = {id(like): out for (_, like), out in zip(template.produced, outputs)}
        else:
            fresh = {id(like): self._fresh(like) for _, like in template.produced}
        copies: dict[torch.fx.Node, torch.fx.Node] = {}
        site = user_frame()
        modules_moved: dict[str, tuple[str, str]] = {}  # a reference node's module -> this call's

        def source(node: torch.fx.Node) -> torch.fx.Node:
            copy = copies.get(node)
            return copy if copy is not None else wired[node]

        throughs, made_in_calls = template.throughs, template.made_in_calls
        called = 0  # the calls on handed objects made again so far
        results: dict[int, torch.Tensor] = {}  # id(a tensor such a call returned at the reference) -> at this copy
        for index, (node, meta, where, library, outputs) in enumerate(template.plan or self._plan(template)):
            while called < len(throughs) and throughs[called].first == index:
                self._call_through(throughs[called], template, path, call, modules, copies, fresh, results, site,
                                   state)
                called += 1
            if node in made_in_calls:
                continue
            kwargs = node.kwargs
            copy = recorder.copy_node(node, map_arg(node.args, source), map_arg(kwargs, source) if kwargs else {}, meta)
            meta = copy.meta
            if where is not None:
                moved = modules_moved.get(where[0])
                if moved is None:
                    moved = modules_moved[where[0]] = (_moved(where[0], template.path, path), where[1])
                meta["fxflops_module"] = moved
            if library:  # an op of library code (nn.Linear): its caller's line
                meta[SOURCE] = site
            if outputs:
                meta["val"] = swapped(meta.get("val"), fresh)
            copies[node] = copy
        for through in throughs[called:]:
            self._call_through(through, template, path, call, modules, copies, fresh, results, site, state)
        for producer, like in template.produced:
            recorder.produced(fresh[id(like)], copies[producer])
        if self._owners is not None and template.nodes:
            # autograd nodes made since the last op recorded (a checkpoint's, made before the ops it runs) belong
            # to the block's first op, as in a full capture
            self._owners.claim(copies[template.nodes[0]])
        if backward is not None:
            backward.copies, backward.wired = copies, wired
        out = rebuild(template.output, fresh, call, modules)
        self._tracer.replayed(template.log)
        for (inside, name), count in template.calls:
            self._tracker.call_log.extend([(f"{path}.{name}" if name else path) if inside else name] * count)
        return out

    def _call_through(self, through: Through, template: Template, path: str, call: CallKey,
                      modules: dict[str, torch.nn.Module], copies: dict[torch.fx.Node, torch.fx.Node],
                      fresh: dict[int, torch.Tensor], results: dict[int, torch.Tensor],
                      site: tuple[str, int] | None, state: BlockState) -> None:
        """Make a call on a handed object again for this copy (capture.block_calls): its ops are recorded as
        they run, then placed as the reference's (module, source line); its results stand for the reference's.
        What the block reads from outside and its modules' state must be as the call found them (the block's
        code after it would read them: the capture runs again without replay where they changed)."""
        recorder = self._recorder

        def copied(spec: tuple) -> Any:
            kind = spec[0]
            if kind == "result":
                return results[spec[1]]
            if kind == "node":
                producer, like = spec[1], spec[2]
                made = fresh.get(id(like))
                if made is None:
                    made = fresh[id(like)] = self._fresh(like)
                recorder.produced(made, copies[producer])
                return made
            return value_at(spec, call, modules)

        positional, keywords = remake(through, lambda spec: build(spec, copied))
        given = tensor_keys((positional, keywords))
        mark = recorder.last_node()
        with torch._C._EnableTorchFunction():  # (a replay runs with them off: the call runs as the block would)
            result = through.function(*positional, **keywords)
        made = [node for node in recorder.nodes_after(mark) if node.op != "placeholder"]
        check(through, result, made, path, given, tensor_keys((positional, keywords)))
        if not template.outside_same(self._slots) or not self._same_state(modules[""], path, state):
            raise ReplayRetry(f"{path}: a call on an object handed to it changed what the block reads")
        for reference, node in zip(through.ops, made):
            copies[reference] = node
            where = reference.meta.get("fxflops_module")
            if where is not None:
                node.meta["fxflops_module"] = (_moved(where[0], template.path, path), where[1])
            node.meta[SOURCE] = site if reference.meta.get(SOURCE) == template.site else reference.meta.get(SOURCE)
        for like, tensor in zip(through.tensors, result_tensors(result)):
            results[id(like)] = tensor

    @staticmethod
    def _plan(template: Template) -> list[tuple]:
        """How to copy each of the reference's nodes, worked out once: (node, the meta its copies start
        from, its module to move, whether its source line is the caller's, whether its value holds an
        output of the block, which each call gets fresh)."""
        outputs = {id(like) for _, like in template.produced}
        plan = []
        for node in template.nodes:
            meta = dict(node.meta)
            meta[REPLAY_OF] = node.meta.get(REPLAY_OF, node.name)
            value = meta.get("val")
            holds = any(id(tensor) in outputs for tensor in _tensors_of(value)) if outputs else False
            plan.append((node, meta, meta.get("fxflops_module"), meta.get(SOURCE) == template.site, holds))
        template.plan = plan
        return plan

    def _verified(self, template: Template, original: Callable[..., Any], path: str, args: tuple,
                  kwargs: dict) -> Any:
        """Run a call that would be replayed, and compare what it recorded with what the replay would copy."""
        recorder, tracker = self._recorder, self._tracker
        mark, first_call = recorder.last_node(), len(tracker.call_log)
        out = original(*args, **kwargs)
        ran = [_signature(node, None, None) for node in recorder.nodes_after(mark) if node.op != "placeholder"]
        copied = [_signature(node, template.path, path) for node in template.nodes]
        calls = _moved_calls(tracker.call_log[first_call:], path)
        if ran != copied or Counter(dict(calls)) != Counter(dict(template.calls)):
            where = next((index for index, (a, b) in enumerate(zip(ran, copied)) if a != b), min(len(ran), len(copied)))
            what = f"op {where}: ran {ran[where] if where < len(ran) else 'nothing'}, replay would copy " \
                   f"{copied[where] if where < len(copied) else 'nothing'}" if ran != copied else "its module calls"
            message = f"{path}: replaying {template.path} would differ from running it ({what})"
            self.mismatches.append(message)
            warnings.warn(f"fxflops: {message}; please report it (replay=False runs every call)", ReplayMismatch,
                          stacklevel=2)
        return out

    def _tensor_at(self, where: tuple, node: torch.fx.Node, call: CallKey,
                   modules: dict[str, torch.nn.Module]) -> torch.fx.Node:
        if where[0] == "same":
            return node
        return self._recorder.input_node(resolve(where, call, modules))

    def _fresh(self, like: torch.Tensor) -> torch.Tensor:
        """A new fake tensor with `like`'s metadata (no op recorded for it)."""
        return self._recorder.unrecorded(self._made_like)(like)

    def _made_like(self, like: torch.Tensor, grad: bool = True) -> torch.Tensor:
        # torch's constructors alone run here, none of the model's code: a reference recording meanwhile (a leaf
        # replayed inside it) has nothing to trace, and its trace function on every Python call of torch's
        # symbolic arithmetic was a fifth of a fresh tensor's cost under named sizes
        with paused_tracing():
            made = _layout_like(self._mode, like)
        return made.requires_grad_(True) if grad and like.requires_grad else made


def _layout_like(mode: FakeTensorMode, like: torch.Tensor) -> torch.Tensor:
    """A new fake tensor of `mode` with `like`'s sizes, strides and dtype, on its device."""
    shape, stride, offset = like.shape, like.stride(), like.storage_offset()
    if all(type(size) is int for size in (*shape, *stride)):
        # around a meta tensor made past every dispatch mode: through the recorder and the fake
        # mode it costs 6x more
        with no_dispatch():
            span = 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0
            meta = torch.empty(offset + span, dtype=like.dtype, device="meta").as_strided(shape, stride, offset)
        return FakeTensor(mode, meta, like.device)
    # what the mode's constructor runs (the meta kernel, its output wrapped), past the mode: the mode's
    # cache key and entry for sizes never asked again cost more than the kernel. A layout that is the
    # contiguous one as expressions is made as that (the same strides, as the same expressions): half
    # the symbolic arithmetic of empty_strided's storage span and checks, 45 a ResNet-50 sweep capture
    with no_dispatch():
        if not contiguous_as_expressions(like):
            meta = _in_storage_like(like, shape, stride, offset)
            if meta is not None:
                return FakeTensor(mode, meta, like.device)
        meta = torch.empty(shape, dtype=like.dtype, device="meta") if contiguous_as_expressions(like) else None
        # empty's strides are `Max(1, size)` products where sympy cannot drop the Max (a size that may be
        # 0): not the same expressions, so those are made as given
        if meta is None or _expressions(meta.stride()) != _expressions(stride):
            meta = torch.empty_strided(shape, stride, dtype=like.dtype, device="meta")
    return FakeTensor(mode, meta, like.device)


def _in_storage_like(like: torch.Tensor, shape: Any, stride: Any, offset: Any) -> torch.Tensor | None:
    """A meta tensor laid out as `like` (sizes, strides, offset as given) in a new storage of `like`'s own size (the
    same expression), or None where that size is not a whole number of elements: what capture.symbolic_cache makes
    from the mode's cache entry. The as_strided's bounds check asks whether `like`'s layout fits its own storage,
    which it does (guards suppressed as in the mode's rebuild from a cache entry)."""
    from fxflops.capture.symbolic_cache import _elements

    elements = _elements(like.untyped_storage().nbytes(), like.dtype.itemsize)
    if elements is None:
        return None
    with like.fake_mode.shape_env.suppress_guards(), torch._C._AutoDispatchBelowADInplaceOrView():
        return torch.empty((elements,), dtype=like.dtype, device="meta").as_strided(shape, stride, offset)


def _expressions(sizes: Any) -> list:
    """Sizes or strides as sympy expressions (ints as themselves)."""
    return [size.node.expr if isinstance(size, torch.SymInt) else size for size in sizes]


def verified_backward(replayed: Any, full: Any) -> Any:
    """A training capture with replay checked against one that ran every call (FXFLOPS_VERIFY_REPLAY): every
    node the same (name, op, module, phase, the forward op it differentiates, source line, values' shapes,
    strides and dtypes, inputs by name), else a ReplayMismatch warning. Returns the full capture."""
    ran, copied = node_rows(full.graph_module.graph), node_rows(replayed.graph_module.graph)
    if ran != copied or replayed.module_calls != full.module_calls:
        where = next((index for index, (a, b) in enumerate(zip(ran, copied)) if a != b), min(len(ran), len(copied)))
        what = f"node {where}: ran {ran[where] if where < len(ran) else 'nothing'}, replay gave " \
               f"{copied[where] if where < len(copied) else 'nothing'}" if ran != copied else "its module calls"
        warnings.warn(f"fxflops: replaying blocks in a training capture would differ from running them ({what}); "
                      "please report it (replay=False runs every call)", ReplayMismatch, stacklevel=2)
    return full


def node_rows(graph: torch.fx.Graph) -> list[tuple]:
    """What a capture's nodes say, in order: each op's row (`_node_row`), then the placeholders' by name (a
    replayed block reads the tensors it reads from outside first: their placeholders may come earlier)."""
    ops, placeholders = [], []
    for node in graph.nodes:
        (placeholders if node.op == "placeholder" else ops).append(_node_row(node))
    return ops + sorted(placeholders, key=lambda row: row[0])


def _node_row(node: torch.fx.Node) -> tuple:
    meta = node.meta
    return (node.name, node.op, node.target, meta.get("fxflops_module"), meta.get(PHASE), meta.get(DIFFERENTIATES),
            meta.get(SOURCE), _layout(meta.get("val")), tuple(used.name for used in node.all_input_nodes))


def _layout(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype, value.requires_grad)
    if isinstance(value, tuple | list):
        return tuple(_layout(item) for item in value)
    return type(value).__name__


def verifying() -> bool:
    """Whether FXFLOPS_VERIFY_REPLAY asks for every replay to be checked against running."""
    return os.environ.get(VERIFY_ENV, "") not in ("", "0")


def saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks are active (checkpointing, offloading): a forward then saves through them."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _specs(spec: Any) -> list[tuple]:
    """Every leaf of an output spec (capture.block_io's), sharded ones included."""
    kind = spec[0]
    if kind is dict:
        return [found for _, item in spec[1] for found in _specs(item)]
    if kind in (tuple, list):
        return [found for item in spec[1] for found in _specs(item)]
    return [spec]


def _tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in a node's value (a tensor, or a tuple or list of them, as `swapped` walks it)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if type(value) in (tuple, list):
        return [tensor for item in value for tensor in _tensors_of(item)]
    return []


def _mutable(value: Any, seen: set[int] | None = None) -> bool:
    """Whether a value read from outside holds data that could be changed in place: a list, a dict, an
    object with attributes (not code: modules, classes, descriptors, callables), a function whose
    defaults or closure hold one, a partial (its keywords)."""
    if isinstance(value, list | dict | set | bytearray | functools.partial):
        return True
    if isinstance(value, types.FunctionType):
        seen = seen if seen is not None else set()
        if id(value) in seen:  # functions that hold each other
            return False
        seen.add(id(value))
        held = (*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values(),
                *(_contents(cell) for cell in value.__closure__ or ()))
        return any(_mutable(item, seen) for item in held)
    return hasattr(value, "__dict__") and not isinstance(value, types.ModuleType | type) and not callable(value) \
        and not hasattr(type(value), "__get__")


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # empty
        return None


class ReplayMismatch(RuntimeWarning):
    """With FXFLOPS_VERIFY_REPLAY set: a call that replay would have copied ran a different program."""


def _signature(node: torch.fx.Node, reference: str | None, path: str | None) -> tuple:
    """What a node contributes to a count: its op, module (moved to `path`), and its values' metadata."""
    where = node.meta.get("fxflops_module")
    module = where[0] if where is not None else None
    if module is not None and reference is not None:
        module = _moved(module, reference, path)
    return (node.target, module, _metadata(node.meta.get("val")),
            tuple(_metadata(used.meta.get("val")) for used in node.all_input_nodes))


def _metadata(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, tuple | list):
        return tuple(_metadata(item) for item in value)
    return type(value).__name__


def _moved(name: str, reference: str, path: str) -> str:
    """A reference node's module name, moved to the repeat's block where it lies inside the reference's."""
    if name == reference:
        return path
    if name.startswith(reference + "."):
        return path + name[len(reference):]
    return name


def _moved_calls(names: list[str], path: str) -> list[tuple[Any, int]]:
    """The module calls made inside a reference call, by name relative to its block where inside it."""
    inside = path + "."
    return [((True, name[len(inside):]), count) if name.startswith(inside) else
            ((True, ""), count) if name == path else ((False, name), count) for name, count in Counter(names).items()]
