"""Repeated blocks: a module call that provably runs the program an earlier call ran is not run again;
the earlier call's nodes are copied in its place.

A block's first call (the reference) runs and is recorded as usual, every attribute read of its modules
logged (for that call their classes are read-logging subclasses). A later call of a module of the same
class replays the reference when:

- its arguments are equal: tensors by shape, strides, dtype, device and flags (fake tensors hold no
  values), plain values by value, the same tensor in the same places, and nothing else (a cache object,
  which the block would update, makes the call run);
- its state is equal (`BlockState`): every module of the block by class, training flag, name and
  submodules, parameters and buffers by metadata, attributes by value, shared objects (a config) by
  identity and what they hold, except attributes the reference never read (a layer index that only
  picks a cache slot when no cache is given);
- the reference was self-contained: it wrote into no tensor from outside the block, changed no module
  attribute nor an argument's contents, ran no torch.cond and no module counted whole, had no hook, and
  returned tensors (made in the block, or its inputs or its own tensors) and plain values in tuples,
  lists and dicts.

The block's program is then a function of what was compared, so the call would run the same ops on
the same shapes: the reference's nodes are copied with their module paths moved to this call's and
their inputs wired to this call's tensors, the module calls it made are counted again, and fresh fake
tensors shaped like the reference's outputs are returned. Assumed, and not checked: a block does not
read Python state outside its modules and arguments (a module-level global) that changes between
calls, nor keep state there. Forward-only captures: a backward needs every op to have run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.node import map_arg
from torch.utils._mode_utils import no_dispatch

from fxflops.capture.attribution import ModuleTracker
from fxflops.capture.block_io import node_specs, place, place_of, rebuild, resolve, swapped, written_outside
from fxflops.capture.block_state import MODULE_INTERNALS, BlockState, CallKey, Unsupported, structure_ids
from fxflops.capture.input_values import reads_values
from fxflops.capture.module_walk import unique_modules
from fxflops.capture.recorder import SOURCE, OpRecorder, user_frame

REPLAY_OF = "fxflops_replay_of"  # node.meta key: the name of the reference node a replayed node copies
_MAX_TEMPLATES = 4  # programs kept per (structure, arguments); a block whose every call differs stops trying


class Template:
    """A reference call: its state, what it read, and how to copy its nodes; or why it cannot be copied."""

    __slots__ = ("state", "free", "refused", "path", "site", "nodes", "externals", "output", "produced", "calls",
                 "reads")

    def __init__(self, state: BlockState, path: str, site: tuple[str, int] | None) -> None:
        self.state = state
        self.path = path
        self.site = site  # the user's line that called the block: the source of ops run in library code
        self.free: frozenset[tuple[str, str]] = frozenset()  # attributes watched and never read
        self.reads: frozenset[tuple[str, str]] = frozenset()
        self.refused: str | None = None
        self.nodes: list[torch.fx.Node] = []
        self.externals: list[tuple[torch.fx.Node, tuple]] = []
        self.output: Any = None  # the output's structure: ("node", producer, tensor), ("input", n), ...
        # (node, output tensor it produced): the reference's output tensors made in it, each once
        self.produced: list[tuple[torch.fx.Node, torch.Tensor]] = []
        self.calls: list[tuple[Any, int]] = []

    def matches(self, state: BlockState) -> bool:
        mine, theirs = self.state.entries, state.entries
        if mine == theirs:
            return True
        if mine.keys() != theirs.keys():
            return False
        return all(entry == mine[relative] or self._differ_where_free(relative, mine[relative], entry)
                   for relative, entry in theirs.items())

    def _differ_where_free(self, relative: str, mine: tuple, theirs: tuple) -> bool:
        """Whether two states of a module differ only in attributes the reference never read."""
        if mine[0] != theirs[0] or [key for key, _ in mine[1]] != [key for key, _ in theirs[1]]:
            return False
        return all(a == b or (relative, key) in self.free for (key, a), (_, b) in zip(mine[1], theirs[1]))


class Replays:
    """Wraps each module's forward (in its instance dict, which `isolation` restores) to replay repeats."""

    def __init__(self, model: torch.nn.Module, recorder: OpRecorder, tracker: ModuleTracker,
                 mode: FakeTensorMode) -> None:
        self._recorder = recorder
        self._tracker = tracker
        self._mode = mode
        modules = [module for _, module in unique_modules(model)]
        self._structures = structure_ids(modules)
        counts = Counter(self._structures.values())
        self._modules = modules[1:]  # not the root: it runs once
        self._with_siblings = {id(module) for module in modules if counts[self._structures[id(module)]] > 1}
        self._calls: dict[int, int] = {}
        self._templates: dict[tuple, list[Template]] = {}
        self._reads: list[tuple[int, str]] = []  # (id(module), attribute) read while a reference records
        self._watchers: dict[tuple[type, tuple[str, ...]], type] = {}
        self._watched_class: dict[type, type] = {}  # watching subclass -> the module's own class
        self._recording = 0  # > 0 while a first reference of its kind runs
        self._given_up: set[tuple] = set()

    def install(self) -> None:
        for module in self._modules:
            if isinstance(module, torch.jit.ScriptModule):  # its forward is TorchScript's, not an attribute
                continue
            original = module.__dict__.get("forward") or type(module).forward.__get__(module)
            module.__dict__["forward"] = self._forward(module, original)

    def _forward(self, module: torch.nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._call(module, original, args, kwargs)
        forward.__wrapped__ = original  # inspect.signature(module.forward) still reads the model's
        return forward

    def class_of(self, module: torch.nn.Module) -> type:
        cls = type(module)
        return self._watched_class.get(cls, cls)

    # --- a call ------------------------------------------------------------------------------------

    def _call(self, module: torch.nn.Module, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if not self._recorder.recording_plainly:
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
        if templates is None:  # a first call of its kind: it may well be the only one
            self._templates[key] = []
            return original(*args, **kwargs)
        if key in self._given_up or not templates and self._recording:
            # nothing to match, and no reference taken: inside a first reference a block is not taken
            # as one (when the enclosing block repeats it is replayed whole, and its parts' references
            # would never be used)
            return original(*args, **kwargs)
        try:
            with torch._C.DisableTorchFunction():
                state = BlockState(module, self._tracker.name_of, path, self.class_of)
        except Unsupported:
            return original(*args, **kwargs)
        for template in templates:
            if template.matches(state):
                if template.refused is not None:
                    return original(*args, **kwargs)
                with torch._C.DisableTorchFunction():
                    return self._replay(template, path, call, state)
        if self._recording:
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
        wholes, cautions, first_read = len(tracker.whole_calls), len(recorder.cautions), len(self._reads)
        watched, swapped = self._watch(state)
        exclusive = not templates  # the first of its kind: its parts wait (see _call); a second one may not repeat
        self._recording += exclusive
        try:
            out = original(*args, **kwargs)
        finally:
            self._recording -= exclusive
            for child, cls in swapped:
                child.__class__ = cls
        template = Template(state, path, site)
        templates.append(template)
        with torch._C.DisableTorchFunction():
            ids = {id(child): relative for relative, child in state.modules}
            reads = frozenset((ids[key], name) for key, name in self._reads[first_read:] if key in ids)
            template.reads, template.free = reads, frozenset(watched - reads)
            if len(tracker.whole_calls) != wholes or len(recorder.cautions) != cautions:
                template.refused = "a module counted whole, or torch.cond, ran in it"
            else:
                template.refused = self._fill(template, module, call, recorder.nodes_after(mark), out,
                                              args, kwargs)
            template.calls = _moved_calls(tracker.call_log[first_call:], path)
        return out

    def _watch(self, state: BlockState) -> tuple[set[tuple[str, str]], list[tuple[torch.nn.Module, type]]]:
        """Swap each module's class for one whose properties log reads of its own attributes."""
        watched: set[tuple[str, str]] = set()
        swapped = []
        for relative, module in state.modules:
            cls = type(module)
            if cls in self._watched_class:  # an enclosing reference watches it already
                watched.update((relative, name) for name in self._watcher_names(cls))
                continue
            names = tuple(sorted(key for key in module.__dict__
                                 if key not in MODULE_INTERNALS and not hasattr(cls, key)))
            if not names:
                continue
            try:
                module.__class__ = self._watcher(cls, names)
            except Exception:  # a class whose layout or __init_subclass__ forbids it: its attributes must then be equal
                continue
            swapped.append((module, cls))
            watched.update((relative, name) for name in names)
        return watched, swapped

    def _watcher_names(self, watcher: type) -> tuple[str, ...]:
        return watcher.__dict__.get("_fxflops_watched_names", ())

    def _watcher(self, cls: type, names: tuple[str, ...]) -> type:
        found = self._watchers.get((cls, names))
        if found is not None:
            return found
        reads = self._reads
        namespace: dict[str, Any] = {name: _logged_attribute(name, reads) for name in names}
        namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__, _fxflops_watched_names=names)
        watcher = type(cls.__name__, (cls,), namespace)
        # what a base's __init_subclass__ added (transformers wraps each subclass's forward): not ours
        for key in set(watcher.__dict__) - set(namespace) - {"__doc__", "__dict__", "__weakref__"}:
            delattr(watcher, key)
        self._watchers[(cls, names)] = watcher
        self._watched_class[watcher] = cls
        return watcher

    def _fill(self, template: Template, module: torch.nn.Module, call: CallKey, nodes: list[torch.fx.Node],
              out: Any, args: tuple, kwargs: dict) -> str | None:
        """Fill in how to copy the reference; or say why it cannot stand for another call."""
        try:
            after = BlockState(module, self._tracker.name_of, template.path, self.class_of)
            again = CallKey(args, kwargs)
        except Unsupported as why:
            return str(why)
        if after.entries != template.state.entries:
            return "its forward changed its modules' state"
        if again.key != call.key or any(a is not b for a, b in zip(again.tensors, call.tensors)):
            return "its forward changed its arguments"
        if any(node.op == "call_function" and reads_values(node.target) for node in nodes):
            return "it read tensor values (capture.input_values), which another call's tensors need not share"
        inside = set(nodes)
        externals: dict[torch.fx.Node, tuple] = {}
        for node in nodes:
            if node.op == "placeholder":
                externals[node] = place(node, call, template.state)
                continue
            for used in node.all_input_nodes:
                if used not in inside and used not in externals:
                    externals[used] = place(used, call, template.state)
            written = written_outside(node, inside)
            if written is not None:
                return f"{node.target} writes into {written}, from outside the block"
        template.nodes = [node for node in nodes if node.op != "placeholder"]
        template.externals = list(externals.items())
        try:
            template.output = self._output_spec(out, inside, call, template.state)
        except Unsupported as why:
            return str(why)
        made = {id(spec[2]): spec for spec in node_specs(template.output)}
        template.produced = [(spec[1], spec[2]) for spec in made.values()]
        return None

    def _output_spec(self, value: Any, inside: set[torch.fx.Node], call: CallKey, state: BlockState) -> Any:
        kind = type(value)
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
        if value is None or kind in (bool, int, float, str):
            return ("plain", value)
        raise Unsupported(f"an output of type {kind.__name__}")

    # --- a repeat -------------------------------------------------------------------------------------

    def _replay(self, template: Template, path: str, call: CallKey, state: BlockState) -> Any:
        recorder = self._recorder
        modules = dict(state.modules)
        wired = {node: self._tensor_at(place, node, call, modules) for node, place in template.externals}
        # the reference's outputs live on in its caller (as this call's input, say): the copies get tensors
        # of their own in their place, so no op sees one tensor where the full capture has two
        fresh = {id(like): self._fresh(like) for _, like in template.produced}
        copies: dict[torch.fx.Node, torch.fx.Node] = {}
        site = user_frame()

        def source(node: torch.fx.Node) -> torch.fx.Node:
            copy = copies.get(node)
            return copy if copy is not None else wired[node]

        for node in template.nodes:
            copy = recorder.copy_node(node, map_arg(node.args, source), map_arg(node.kwargs, source))
            meta = copy.meta
            where = meta.get("fxflops_module")
            if where is not None:
                meta["fxflops_module"] = (_moved(where[0], template.path, path), where[1])
            if meta.get(SOURCE) == template.site:  # an op of library code (nn.Linear): its caller's line
                meta[SOURCE] = site
            meta[REPLAY_OF] = node.meta.get(REPLAY_OF, node.name)
            meta["val"] = swapped(meta.get("val"), fresh)
            copies[node] = copy
        for producer, like in template.produced:
            recorder.produced(fresh[id(like)], copies[producer])
        out = rebuild(template.output, fresh, call, modules)
        self._reads.extend((id(modules[relative]), name) for relative, name in template.reads if relative in modules)
        for (inside, name), count in template.calls:
            self._tracker.call_log.extend([f"{path}.{name}" if inside else name] * count)
        return out

    def _tensor_at(self, where: tuple, node: torch.fx.Node, call: CallKey,
                   modules: dict[str, torch.nn.Module]) -> torch.fx.Node:
        if where[0] == "same":
            return node
        return self._recorder.input_node(resolve(where, call, modules))

    def _fresh(self, like: torch.Tensor) -> torch.Tensor:
        """A new fake tensor with `like`'s metadata (no op recorded for it)."""
        return self._recorder.unrecorded(self._made_like)(like)

    def _made_like(self, like: torch.Tensor) -> torch.Tensor:
        shape, stride, offset = like.shape, like.stride(), like.storage_offset()
        if all(type(size) is int for size in (*shape, *stride)):
            # around a meta tensor made past every dispatch mode: through the recorder and the fake
            # mode it costs 6x more
            with no_dispatch():
                span = 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0
                meta = torch.empty(offset + span, dtype=like.dtype, device="meta").as_strided(shape, stride, offset)
            made = FakeTensor(self._mode, meta, like.device)
        else:
            made = torch.empty_strided(shape, stride, dtype=like.dtype, device=like.device)
        return made.requires_grad_(True) if like.requires_grad else made


def _logged_attribute(name: str, reads: list[tuple[int, str]]) -> property:
    def get(module: Any) -> Any:
        reads.append((id(module), name))
        try:
            return module.__dict__[name]
        except KeyError:
            raise AttributeError(name) from None

    def put(module: Any, value: Any) -> None:
        reads.append((id(module), name))
        module.__dict__[name] = value

    def drop(module: Any) -> None:
        reads.append((id(module), name))
        del module.__dict__[name]

    return property(get, put, drop)


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
    return [((True, name[len(inside):]), count) if name.startswith(inside) else ((False, name), count)
            for name, count in Counter(names).items()]
