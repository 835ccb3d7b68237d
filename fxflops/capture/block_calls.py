"""Objects handed to a repeated block (a transformers `Cache`): their calls made again for real at each copy.

A decoder layer given a cache calls `cache.update(key, value, self.layer_idx)`: the cache stores the layer's
keys and values in that layer's slot and returns them joined to what the slot held. Nothing proves what such
a call reads (another layer's slot, a counter of its own), so its effect is not copied: at each copy of the
block the call is made again, on the same object, with this copy's tensors and this copy's values of the
attributes passed to it (`layer_idx`), and its ops are recorded as they run. The copy goes on only where the
call returned what the reference's returned (tensors by shape, strides, dtype and flags, plain values by
value), ran the same ops, left the tensors it was given as they were, and changed neither what the block
read from outside (`Template.outside`) nor its modules' state; otherwise the whole capture runs again
without replay (`ReplayRetry`). The rest of the block is then a function of what was compared, as for any
replayed block.

Proven at the reference (`handed_calls`, else the block's calls run):

- the object is of classes written in Python over `object` alone (`block_state.handable`), the same object
  in every call (keyed by identity), and the block's own code reaches it only by calling it: no name of
  its data (its attributes, its classes' attributes that are not Python functions or properties) occurs on
  a line the block ran, no line reads attributes by computed names, and every call on it came from
  traced code, returned (no exception, no generator), ran no module, left the tensors it was given as
  they were, and changed nothing the block had read so far (globals, the attributes it reached, its
  modules' state: `Marks`, keyed before the call and compared after it);
- each call's arguments are the object, tensors (made in the block before it, its inputs or state, or
  what an earlier call returned), plain values, block modules, and tuples, lists and dicts of them;
  its results are plain values, and tensors made by its own ops, in tuples, lists and dicts; the block's
  other ops read only those results of its ops, and its outputs are none of them;
- an attribute of the block's modules may differ between the reference and a copy (`layer_idx`) where
  every read of its name on a line run is `self.<name>` written as an argument of a call on the object
  (the call instruction found from the caller's frame), the line ran as often as that call was made, no
  line run reads attributes by computed names, and `self` is a module of the block: the copy passes its
  own module's value.
"""

from __future__ import annotations

import dis
import types
from typing import Any

import torch

from fxflops.capture.backward import ReplayRetry
from fxflops.capture.block_io import place_of, resolve
from fxflops.capture.block_reads import Handed, Observer, ReadLog
from fxflops.capture.block_state import BlockState, CallKey, Unsupported, plain_key, tensor_key

_SIMPLE = frozenset({"LOAD_FAST", "LOAD_CONST", "LOAD_DEREF", "LOAD_CLOSURE"})
_NAMED = frozenset({"LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "DELETE_ATTR", "LOAD_CONST", "LOAD_GLOBAL",
                    "LOAD_NAME", "IMPORT_FROM"})
_VARARGS, _VARKEYWORDS = 0x04, 0x08


class Marks(Observer):
    """Notes, around each handed call of a reference, the last node recorded, the module calls made so far and
    which node produced each tensor among its arguments (at the start) and results (at the end); and, with
    `read`/`changed` given, that the call changed nothing the block had read (`read()` keys it, `changed(keys)`
    says what changed: the call's code is not traced, and may write into a global the block reads)."""

    def __init__(self, last_node: Any, producer_of: Any, calls: list, read: Any = None, changed: Any = None) -> None:
        self._last_node, self._producer_of, self._calls = last_node, producer_of, calls
        self._read, self._changed = read, changed

    def begin(self, call: Handed) -> None:
        call.start = (self._last_node(), len(self._calls),
                      {id(t): self._producer_of(t) for t in result_tensors(call.arguments)})
        shapes = tensor_keys(call.arguments)
        try:  # (run inside the trace function: an exception would reach the model's code)
            read = self._read() if self._read is not None else None
        except Exception:  # noqa: BLE001 - what it read cannot be keyed: the call cannot be proven harmless
            read = None
            call.flaw = call.flaw or f"{call.code.co_qualname}, called on it, follows reads that cannot be keyed"
        call.before = (shapes, read)

    def end(self, call: Handed) -> None:
        made = {id(t): self._producer_of(t) for t in result_tensors(call.result)}
        call.end = (self._last_node(), len(self._calls), made)
        shapes, read = call.before
        try:
            what = "a tensor it is given in place (its shape, strides or dtype)" \
                if tensor_keys(call.arguments) != shapes \
                else self._changed(read) if self._changed is not None and read is not None else None
        except Exception:  # noqa: BLE001 - as in begin
            what = "what the block read (it cannot be keyed again)"
        if what is not None:
            call.flaw = call.flaw or f"{call.code.co_qualname}, called on an object handed to it, changes {what}"


def tensor_keys(value: Any) -> list | None:
    """The keys of the tensors in a value's tuples, lists and dicts (None where one cannot be keyed): a call
    that changes them in place (`as_strided_`) would leave the block's later ops reading other tensors."""
    try:
        with torch._C.DisableTorchFunction():
            return [tensor_key(tensor) for tensor in result_tensors(value)]
    except Unsupported:
        return None


class Through:
    """A call on a handed object, as each copy makes it again: the function, its arguments' specs, where its
    ops begin among the reference's nodes (`first`), those ops, and its result's key and tensors."""

    __slots__ = ("function", "positional", "keywords", "first", "ops", "key", "tensors")

    def __init__(self, function: Any, positional: list, keywords: dict, first: int, ops: list[torch.fx.Node],
                 result: Any) -> None:
        self.function = function
        self.positional = positional
        self.keywords = keywords
        self.first = first
        self.ops = ops
        self.key = result_key(result)
        self.tensors = list(result_tensors(result))


def handed_calls(log: ReadLog, call: CallKey, state: BlockState, before: dict[int, set[str]],
                 nodes: list[torch.fx.Node], watched: set[tuple[str, str]]
                 ) -> tuple[list[Through], frozenset, frozenset] | str:
    """What a reference did with the objects it was handed, as copies make it again, the attributes passed to
    their calls (relative path, name) and the nodes the calls recorded; or why it cannot stand for another call."""
    if log.computed:
        return "it reads attributes by computed names, with an object handed to it"
    for handed in call.handed.values():
        data = before.get(id(handed), set()) | data_names(handed)
        read = sorted(log.names & data)
        if read:
            return f"it reads {read[0]} of the {type(handed).__name__} it is handed"
    position = {node: index for index, node in enumerate(nodes)}
    ops_before = []  # per node: how many of the reference's ops (not placeholders) come before it
    count = 0
    for node in nodes:
        ops_before.append(count)
        count += node.op != "placeholder"
    modules = {id(module): relative for relative, module in state.modules}
    throughs: list[Through] = []
    segments: dict[torch.fx.Node, int] = {}  # a node made in a call -> the call's index
    results: dict[int, int] = {}  # id(a tensor a call returned) -> the call's index
    passes: dict[tuple[str, str], list[tuple[types.CodeType, int, int]]] = {}  # attribute -> (code, load, line)
    calls_at: dict[tuple[types.CodeType, int], int] = {}  # (caller's code, call offset) -> calls made from it
    for index, handed in enumerate(log.handed):
        if handed.flaw is not None:
            return handed.flaw
        (start, modules_before, produced), (end, modules_after, made) = handed.start, handed.end
        if modules_after != modules_before:
            return f"{handed.code.co_qualname}, called on an object handed to it, ran a module"
        first = handed.arguments[handed.code.co_varnames[0]]
        function = _function_of(type(first), handed.code)
        if function is None:
            return f"it calls {handed.code.co_qualname} on a {type(first).__name__}, which is none of its methods"
        begin = position[start] + 1 if start in position else 0
        stop = position[end] + 1 if end in position else begin
        segment = nodes[begin:stop]
        for node in segment:
            segments[node] = index
        for tensor in result_tensors(handed.result):
            producer = made.get(id(tensor))
            if producer is None or segments.get(producer) != index or producer.op == "placeholder":
                return f"{handed.code.co_qualname}, called on an object handed to it, returns a tensor it did not make"
            results.setdefault(id(tensor), index)
        passed = _passed(handed, modules, watched)
        for parameter, relative, name, load, line in passed:
            passes.setdefault((relative, name), []).append((handed.caller, load, line))
        key = (handed.caller, handed.offset)
        calls_at[key] = calls_at.get(key, 0) + 1
        try:
            spec = _Specs(call, state, produced, results, segments, position, modules, index,
                          {parameter: (relative, name) for parameter, relative, name, _, _ in passed})
            positional, keywords = spec.arguments(handed)
        except Unsupported as why:
            return f"{handed.code.co_qualname}, called on an object handed to it, is given {why}"
        first_op = ops_before[begin] if begin < len(nodes) else count
        throughs.append(Through(function, positional, keywords, first_op,
                                [node for node in segment if node.op != "placeholder"], handed.result))
    producers = {made_by for handed in log.handed for made_by in handed.end[2].values()}
    for node in nodes:
        if node in segments:
            continue
        for used in node.all_input_nodes:
            if used in segments and used not in producers:
                return "it reads a tensor made inside a call on an object handed to it that the call did not return"
    return throughs, _proven(passes, calls_at, log), frozenset(segments)


def writes_elsewhere(log: ReadLog) -> bool:
    """Whether the code run may write into something (capture.block_reads: a store, a mutator method) other
    than by a method call on a handed object (`x.update(...)`) made from a line each time that line ran."""
    if not log.handed:
        return bool(log.mutating)
    made: dict[tuple[types.CodeType, int], int] = {}
    for handed in log.handed:
        if handed.caller is not None:
            made[(handed.caller, handed.offset)] = made.get((handed.caller, handed.offset), 0) + 1
    accounted = set()
    for (caller, offset), count in made.items():
        groups = _argument_groups(caller, offset)
        if groups is not None and log.lines.get((caller, groups[2])) == count \
                and _line_of(caller, groups[3]) == groups[2]:
            accounted.add((caller, groups[3]))
    return bool(log.mutating - accounted)


def result_key(value: Any) -> Any:
    """A call's result as a key: tensors by metadata, plain values by value, containers item by item."""
    plain = plain_key(value)
    if plain is not None:
        return plain
    kind = type(value)
    if isinstance(value, torch.Tensor):
        return tensor_key(value)
    if kind is tuple or kind is list:
        return (kind, tuple(result_key(item) for item in value))
    if kind is dict:
        return (dict, tuple((result_key(key), result_key(item)) for key, item in value.items()))
    return ("object", id(value))  # (the handed object itself, say: the same object at each copy)


def data_names(value: Any) -> set[str]:
    """The names through which code can read an object's data without a call the trace sees: its attributes,
    and its classes' attributes other than Python functions and properties of them (dunder names aside: its
    class's own description, `__module__`, `__doc__`, and `__dict__`, whose reads count as computed)."""
    names = set(vars(value))
    for cls in type(value).__mro__[:-1]:
        names.update(name for name, item in vars(cls).items() if not _python_method(item))
    return {name for name in names if not (name.startswith("__") and name.endswith("__"))}


def remake(through: Through, build: Any) -> tuple[tuple, dict]:
    """A handed call's arguments for a copy: `build(spec)` gives each value."""
    keywords = {key: build(spec) for key, spec in through.keywords.items()}
    return tuple(build(spec) for spec in through.positional), keywords


def check(through: Through, result: Any, made: list[torch.fx.Node], where: str, before: list | None = None,
          after: list | None = None) -> None:
    """A handed call made again at a copy must return what it returned, run the ops it ran and leave the
    tensors it was given as they were (`before`, `after`: their keys): else the capture runs again without
    replay."""
    if result_key(result) != through.key or len(made) != len(through.ops) or before != after \
            or any(a.target is not b.target for a, b in zip(made, through.ops)):
        raise ReplayRetry(f"{where}: a call on an object handed to it returned or ran what it did not at its reference")


class _Specs:
    """How a copy gets each argument of a handed call: ("plain", value) as it is, ("node", node, like) a
    fresh tensor made by that node's copy, ("result", id) what an earlier call returned at the copy,
    ("place", where) this call's input or state, ("module", relative), ("attribute", relative, name),
    (type, items) a container rebuilt."""

    def __init__(self, call: CallKey, state: BlockState, produced: dict[int, Any], results: dict[int, int],
                 segments: dict, position: dict, modules: dict[int, str], index: int,
                 passed: dict[str, tuple[str, str]]) -> None:
        self._call, self._state, self._produced, self._results = call, state, produced, results
        self._segments, self._position, self._modules, self._index = segments, position, modules, index
        self._passed = passed

    def arguments(self, handed: Handed) -> tuple[list, dict]:
        code, values = handed.code, handed.arguments
        names = code.co_varnames
        count, keywords_only = code.co_argcount, code.co_kwonlyargcount
        positional = [self._parameter(name, values[name]) for name in names[:count]]
        at = count + keywords_only
        if code.co_flags & _VARARGS:
            positional += [self.spec(value) for value in values[names[at]]]
            at += 1
        keywords = {name: self._parameter(name, values[name]) for name in names[count:count + keywords_only]}
        if code.co_flags & _VARKEYWORDS:
            keywords.update((key, self.spec(value)) for key, value in values[names[at]].items())
        return positional, keywords

    def _parameter(self, name: str, value: Any) -> Any:
        passed = self._passed.get(name)
        return ("attribute", *passed) if passed is not None else self.spec(value)

    def spec(self, value: Any) -> Any:
        kind = type(value)
        if plain_key(value) is not None or id(value) in self._call.handed:
            return ("plain", value)
        if isinstance(value, torch.Tensor):
            if id(value) in self._results:
                if self._results[id(value)] >= self._index:
                    raise Unsupported("a tensor it returns itself")
                return ("result", id(value))
            producer = self._produced.get(id(value))
            if producer in self._position and producer.op != "placeholder":
                if producer in self._segments:
                    raise Unsupported("a tensor made inside an earlier call")
                return ("node", producer, value)
            where = place_of(value, self._call, self._state)
            return ("place", where) if where is not None else ("plain", value)
        if kind is tuple or kind is list:
            return (kind, [self.spec(item) for item in value])
        if kind is dict:
            return (dict, [(key, self.spec(item)) for key, item in value.items()])
        if isinstance(value, torch.nn.Module) and id(value) in self._modules:
            return ("module", self._modules[id(value)])
        raise Unsupported(f"a {kind.__name__}")


def build(spec: Any, copy: Any) -> Any:
    """An argument of a handed call at a copy, from its spec; `copy(spec)` makes a tensor's."""
    kind = spec[0]
    if kind == "plain":
        return spec[1]
    if kind in (tuple, list):
        return kind(build(item, copy) for item in spec[1])
    if kind is dict:
        return {key: build(item, copy) for key, item in spec[1]}
    return copy(spec)


def value_at(spec: Any, call: CallKey, modules: dict[str, torch.nn.Module]) -> Any:
    """A spec's value read from the copy's call or modules: a place, a module, an attribute passed."""
    kind = spec[0]
    if kind == "place":
        return resolve(spec[1], call, modules)
    if kind == "module":
        return modules[spec[1]]
    if kind == "attribute":
        return modules[spec[1]].__dict__[spec[2]]
    raise KeyError(kind)


def _passed(handed: Handed, modules: dict[int, str], watched: set[tuple[str, str]]) -> list[tuple]:
    """The attributes `self.<name>` written as arguments of the call instruction that made a handed call:
    (parameter, module's relative path, name, offset of the load, line)."""
    caller, self_module = handed.caller, handed.caller_self
    relative = modules.get(id(self_module)) if self_module is not None else None
    if caller is None or relative is None or not caller.co_argcount:
        return []
    groups = _argument_groups(caller, handed.offset)
    if groups is None:
        return []
    loads, keyword_names, line, _ = groups
    code = handed.code
    names, count = code.co_varnames, code.co_argcount
    positional = len(loads) - len(keyword_names)
    found = []
    for index, group in enumerate(loads):
        if len(group) != 2 or group[0].opname != "LOAD_FAST" or group[0].argval != caller.co_varnames[0] \
                or group[1].opname != "LOAD_ATTR":
            continue
        name = group[1].argval
        if (relative, name) not in watched or any(name in vars(cls) for cls in type(self_module).__mro__):
            continue
        if index < positional:
            parameter = names[index + 1] if index + 1 < count else None  # (after the object: the method's self)
        else:
            keyword = keyword_names[index - positional]
            parameter = keyword if keyword in names[1:count + code.co_kwonlyargcount] else None
        if parameter is not None and handed.arguments.get(parameter) is self_module.__dict__.get(name):
            found.append((parameter, relative, name, group[1].offset, line))
    return found


def _argument_groups(code: types.CodeType, offset: int) -> tuple[list[list[dis.Instruction]], tuple, int, int] | None:
    """The arguments of the method call whose CALL instruction runs at `offset` in `code`, each a simple load
    and the attribute loads after it, with the keyword names, the call's line and the method load's offset;
    None unless it is `x.method(args)` of such."""
    instructions = [ins for ins in _instructions(code) if ins.offset <= offset]
    if len(instructions) < 3 or instructions[-1].opname != "CALL" or instructions[-2].opname != "PRECALL":
        return None
    count = instructions[-1].arg
    at = len(instructions) - 3
    keyword_names: tuple = ()
    if instructions[at].opname == "KW_NAMES":
        keyword_names = code.co_consts[instructions[at].arg]
        at -= 1
    groups: list[list[dis.Instruction]] = []
    while len(groups) < count:
        group = []
        while at >= 0 and instructions[at].opname == "LOAD_ATTR":
            group.append(instructions[at])
            at -= 1
        if at < 0 or instructions[at].opname not in _SIMPLE:
            return None
        group.append(instructions[at])
        at -= 1
        groups.append(group[::-1])
    if at < 0 or instructions[at].opname != "LOAD_METHOD":
        return None
    line = instructions[-1].positions.lineno if instructions[-1].positions else None
    return groups[::-1], keyword_names, line, instructions[at].offset


def _proven(passes: dict[tuple[str, str], list[tuple]], calls_at: dict, log: ReadLog) -> frozenset:
    """The passed attributes whose name is read on no line run but as such an argument, on lines that ran
    as often as their call was made."""
    proven = []
    if not passes or log.reflective:  # (a read by a computed name may be of any of them)
        return frozenset()
    made_from: dict[tuple[types.CodeType, int | None], int] = {}  # (code, line) -> handed calls made on it
    for (caller, offset), made in calls_at.items():
        key = (caller, _line_of(caller, offset))
        made_from[key] = made_from.get(key, 0) + made
    mentions: dict[types.CodeType, dict[int, list[dis.Instruction]]] = {}
    for code, _ in log.lines:
        if code not in mentions:
            mentions[code] = _mentions(code)
    for (relative, name), loads in passes.items():
        accounted = {(code, load) for code, load, _ in loads}
        calls = {(code, line): made_from.get((code, line), 0) for code, _, line in loads}
        ok = True
        for (code, line), runs in log.lines.items():
            for instruction in mentions[code].get(line, ()):
                if instruction.argval == name and (code, instruction.offset) not in accounted:
                    ok = False
            if (code, line) in calls and calls[(code, line)] != runs:
                ok = False
        if ok:
            proven.append((relative, name))
    return frozenset(proven)


def _instructions(code: types.CodeType) -> list[dis.Instruction]:
    return list(dis.get_instructions(code))


def _mentions(code: types.CodeType) -> dict[int, list[dis.Instruction]]:
    """Each line's instructions that name something (an attribute, a global, a string constant)."""
    lines: dict[int, list[dis.Instruction]] = {}
    line = code.co_firstlineno
    for instruction in _instructions(code):
        if instruction.positions is not None and instruction.positions.lineno is not None:
            line = instruction.positions.lineno
        if instruction.opname in _NAMED and type(instruction.argval) is str:
            lines.setdefault(line, []).append(instruction)
    return lines


def _line_of(code: types.CodeType, offset: int) -> int | None:
    line = None
    for instruction in _instructions(code):
        if instruction.offset > offset:
            break
        if instruction.positions is not None and instruction.positions.lineno is not None:
            line = instruction.positions.lineno
    return line


def _function_of(cls: type, code: types.CodeType) -> Any:
    """The function of `cls` (a method, a property's getter) whose code is `code`, found through its classes."""
    for base in cls.__mro__:
        for item in vars(base).values():
            for function in (item.fget, item.fset, item.fdel) if isinstance(item, property) else \
                    (getattr(item, "__func__", item),):
                if isinstance(function, types.FunctionType) and function.__code__ is code:
                    return function
    return None


def _python_method(item: Any) -> bool:
    if isinstance(item, property):
        return all(part is None or isinstance(part, types.FunctionType) for part in (item.fget, item.fset, item.fdel))
    return isinstance(item, types.FunctionType)


def result_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a value's tuples, lists and dicts (not inside other objects: a handed one's)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if type(value) in (tuple, list):
        return [tensor for item in value for tensor in result_tensors(item)]
    if type(value) is dict:
        return [tensor for item in value.values() for tensor in result_tensors(item)]
    return []
