"""What a reference call's code read, found from the code it ran (`capture.replay`).

While a reference records, `sys.settrace` notes each line of Python code it runs (torch's and fxflops'
own code aside: their frames get no line events). Each line's bytecode then says what it can read:

- attribute names and string constants: an instance attribute of the block's modules whose name occurs
  on no line run was never read (a `layer_idx` used only to pick a cache slot, with no cache given);
- reads by a name the code computes (`vars(x)`, `x.__dict__`, `inspect.getattr_static`, `getattr(x, n)`
  with `n` not a literal, such a function under another name) where the frame's values reach a module:
  every attribute then counts as read;
- globals, and the attributes of modules and classes the code reaches by a name it reads: what the
  reference saw there is keyed and compared before every replay;
- what cannot be keyed refuses the reference: writes to globals or to an enclosing function's
  variables, one code run with two globals dicts, object identities (`id`, `hash`), frames,
  `eval`/`exec`; and a write into anything
  (`d[k] = v`, `.append`, `x.a = v`) when the code also read a mutable global (it may be that one).

An object the block is handed (a cache: `capture.block_calls`) is watched: a call of a function whose
first argument it is, made from the traced code, is noted with its arguments and result (`Handed`), and
the code that call runs is not traced (it runs again for real at each copy). Each line run is counted.

Nothing of the model is touched: no class swapped, no attribute set. The trace function is the
only global state, set for the reference's call and restored after it; with another one present
(a debugger, coverage), no reference is recorded and every call runs.
"""

from __future__ import annotations

import builtins
import dis
import inspect
import os
import sys
import sysconfig
import types
from typing import Any

import torch

from fxflops.capture.reach import own_attribute, reaches

# frames of these trees get no line events: torch's machinery (dispatch, fake tensors, the modules' own
# forwards, which read their attributes only through `torch.nn`'s machinery) and our recorder
_UNTRACED = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
_OURS = os.path.dirname(os.path.dirname(__file__)) + os.sep  # fxflops' own machinery: never a handed call
# the standard library is traced where the traced code calls it (inspect.getattr_static, copy.copy), not
# where torch's or our machinery does (linecache for source lines)
_STDLIB = tuple({os.path.realpath(sysconfig.get_paths()[key]) + os.sep for key in ("stdlib", "platstdlib")})
# torch's symbolic sizes compute in sympy (and mpmath under it), which hashes and reads locals(): like the
# standard library, traced where the traced code calls them, not where torch's machinery does (a sweep's
# SymInt arithmetic on a model's line would otherwise refuse every reference)
_SIZE_LIBRARIES = ("sympy", "mpmath")

_REFLECTIVE = frozenset({"__dict__", "vars", "getattr_static", "attrgetter", "__getattribute__", "dir",
                         "getmembers", "__getstate__", "asdict", "astuple", "__reduce_ex__", "__reduce__"})
_UNKNOWN = object()  # a file not yet classified by _kind
_REACH_LIMIT = 2_000  # objects walked to find whether a frame's value reaches a module (more: taken to)
_BY_NAME = frozenset({"getattr", "hasattr", "setattr", "delattr"})
_REFUSED = {"id": "reads object identities (id)", "hash": "reads object identities (hash)",
            "globals": "reads globals() as a whole", "locals": "reads locals()", "eval": "runs eval",
            "exec": "runs exec", "_getframe": "reads frames", "currentframe": "reads frames",
            "f_back": "reads frames", "f_locals": "reads frames", "f_globals": "reads frames",
            "get_referrers": "reads the garbage collector", "__import__": "imports by a computed name"}
_MUTATORS = frozenset({"append", "extend", "insert", "pop", "popitem", "update", "setdefault", "clear", "remove",
                       "add", "discard", "sort", "reverse", "__setitem__", "__delitem__", "__setattr__",
                       "__delattr__", "setattr", "delattr", "__iadd__", "__ior__",
                       # functions written in C that write into their first argument (operator, heapq, bisect,
                       # collections.deque): their code is not traced, only their names are seen
                       "setitem", "delitem", "iadd", "ior", "iconcat", "heappush", "heappop", "heapify",
                       "heapreplace", "heappushpop", "insort", "insort_left", "insort_right", "appendleft",
                       "extendleft", "popleft", "rotate"})
_BUILDS = frozenset({"BUILD_MAP", "BUILD_LIST", "BUILD_SET", "BUILD_CONST_KEY_MAP"})
_LOADS = frozenset({"LOAD_FAST", "LOAD_DEREF", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_CONST", "LOAD_CLASSDEREF"})


class LineReads:
    """What one line of code can read, and what about it cannot be keyed."""

    __slots__ = ("names", "globals", "stored", "reflective", "refused", "mutates", "mutating")

    def __init__(self) -> None:
        self.mutating: list[int] = []  # the offsets of the instructions that may write (see `mutates`)
        self.names: set[str] = set()
        self.globals: set[str] = set()
        self.stored: set[str] = set()  # attributes written (x.name = v)
        self.reflective = False
        self.refused: str | None = None
        self.mutates = False


def line_reads(code: types.CodeType) -> dict[int, LineReads]:
    """Each line of `code` (not its nested functions': they have frames of their own) and what it reads."""
    lines: dict[int, LineReads] = {}
    instructions = list(dis.get_instructions(code))
    fresh = _fresh_locals(code, instructions)
    line = code.co_firstlineno
    for index, instruction in enumerate(instructions):
        if instruction.positions is not None and instruction.positions.lineno is not None:
            line = instruction.positions.lineno
        reads = lines.get(line)
        if reads is None:
            reads = lines[line] = LineReads()
        name, argument = instruction.opname, instruction.argval
        if name in ("LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "DELETE_ATTR", "IMPORT_FROM"):
            reads.names.add(argument)
            if name in ("STORE_ATTR", "DELETE_ATTR"):
                reads.stored.add(argument)
                reads.mutates = True
                reads.mutating.append(instruction.offset)
        elif name == "LOAD_CONST" and type(argument) is str:
            reads.names.add(argument)
        elif name in ("LOAD_GLOBAL", "LOAD_NAME"):
            reads.globals.add(argument)
            reads.names.add(argument)
        if name in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD") and argument in _BY_NAME \
                and not _literal_name_follows(instructions, index):  # (builtins.getattr too)
            reads.reflective = True
        elif name in ("STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME", "DELETE_NAME"):
            reads.refused = f"writes the global {argument}"
        elif name in ("STORE_DEREF", "DELETE_DEREF") and argument in code.co_freevars:
            reads.refused = f"writes {argument} of an enclosing function"
        elif name in ("STORE_SUBSCR", "DELETE_SUBSCR") and not _into_fresh(instructions, index, fresh):
            reads.mutates = True
            reads.mutating.append(instruction.offset)
        if type(argument) is str and name != "LOAD_CONST":
            if argument in _REFLECTIVE:
                reads.reflective = True
            elif argument in _REFUSED:
                reads.refused = _REFUSED[argument]
            if argument in _MUTATORS and not (name == "LOAD_METHOD" and index
                                              and _is_fresh(instructions[index - 1], fresh)):
                reads.mutates = True
                reads.mutating.append(instruction.offset)
    return lines


def _fresh_locals(code: types.CodeType, instructions: list[dis.Instruction]) -> frozenset[str]:
    """The local variables that only ever hold a container this frame built (`d = {}`, `x = [a, b]`): a write
    into one writes into nothing from outside the call (what else writes, into the container or holding it,
    is a write of its own)."""
    parameters = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)
    built: dict[str, bool] = {}
    for index, instruction in enumerate(instructions):
        if instruction.opname in ("STORE_FAST", "DELETE_FAST"):
            made = index > 0 and instructions[index - 1].opname in _BUILDS and instruction.opname == "STORE_FAST"
            built[instruction.argval] = built.get(instruction.argval, True) and made
    excluded = set(code.co_varnames[:parameters]) | set(code.co_cellvars)
    return frozenset(name for name, fresh in built.items() if fresh and name not in excluded)


def _is_fresh(instruction: dis.Instruction, fresh: frozenset[str]) -> bool:
    return instruction.opname == "LOAD_FAST" and instruction.argval in fresh


def _into_fresh(instructions: list[dis.Instruction], index: int, fresh: frozenset[str]) -> bool:
    """Whether the subscript store or delete at `index` writes `v[k]` for a fresh local `v` and a plain key."""
    key, container = index - 1, index - 2
    return bool(fresh) and container >= 0 and instructions[key].opname in ("LOAD_CONST", "LOAD_FAST") \
        and _is_fresh(instructions[container], fresh)


def _literal_name_follows(instructions: list[dis.Instruction], index: int) -> bool:
    """Whether `getattr(obj, "name", ...)` at `index` names its attribute by a literal: one load of the
    object (then attribute reads of it), and a string constant next."""
    position = index + 1
    if position >= len(instructions) or instructions[position].opname not in _LOADS:
        return False
    position = _past_attributes(instructions, position + 1)
    if position >= len(instructions) or instructions[position].opname != "LOAD_CONST" \
            or type(instructions[position].argval) is not str:
        return False
    # the string is the whole argument (not `"_".join(parts)`): the call follows, or a default loaded first
    position += 1
    if position < len(instructions) and instructions[position].opname in _LOADS:
        position = _past_attributes(instructions, position + 1)
    return position < len(instructions) and instructions[position].opname == "PRECALL"


def _past_attributes(instructions: list[dis.Instruction], position: int) -> int:
    while position < len(instructions) and instructions[position].opname == "LOAD_ATTR":
        position += 1
    return position


class Handed:
    """A call the traced code made of a function whose first argument is an object the block was handed:
    its code, its arguments as bound, the call instruction that made it (caller's code, offset, first
    argument), and what `Observer` noted around it; `result` once it returned."""

    __slots__ = ("code", "arguments", "caller", "offset", "caller_self", "start", "end", "result", "flaw", "before")

    def __init__(self, frame: types.FrameType) -> None:
        code = frame.f_code
        self.code = code
        self.arguments = dict(frame.f_locals)  # (at the call event: its parameters only)
        caller = frame.f_back
        self.caller = caller.f_code if caller is not None else None
        self.offset = caller.f_lasti if caller is not None else -1
        self.caller_self = _first_argument(caller) if caller is not None else None
        self.start: Any = None
        self.end: Any = None
        self.result: Any = None
        self.before: Any = None  # what the block had read when it was made, as `Observer.begin` keyed it
        # what makes it unfit to be made again: not called by traced code, a generator, an exception in it
        self.flaw: str | None = None
        if caller is None or caller.f_trace is None:
            self.flaw = f"{code.co_qualname} is called on it by code that is not traced"
        elif code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR):
            self.flaw = f"{code.co_qualname}, called on it, is a generator"


class Observer:
    """What the one recording a reference notes around a handed object's call (nodes recorded before and
    after it): `begin(call)` and `end(call)` fill in `call.start` and `call.end`."""

    def begin(self, call: Handed) -> None: ...

    def end(self, call: Handed) -> None: ...


class ReadLog:
    """What a reference's code read: names, globals (namespace, name), and what refuses it."""

    __slots__ = ("names", "outside", "stored", "reflective", "refused", "mutates", "codes", "lines", "computed",
                 "handed", "mutating")

    def __init__(self) -> None:
        self.codes: set[types.CodeType] = set()  # the code that ran
        self.lines: dict[tuple[types.CodeType, int], int] = {}  # each line run, and how often
        self.computed = False  # whether a line run reads by computed names in code given a handed object
        self.handed: list[Handed] = []  # calls on the objects it was handed, in order (not merged)
        self.mutating: set[tuple[types.CodeType, int]] = set()  # (code, offset) of each instruction that may write
        self.names: set[str] = set()
        self.stored: set[str] = set()
        self.outside: dict[tuple[int, str], tuple[Any, str]] = {}  # (id(namespace), name) -> (namespace, name)
        self.reflective = False
        self.refused: str | None = None
        self.mutates = False

    def merge(self, other: ReadLog) -> None:
        self.codes |= other.codes
        for key, runs in other.lines.items():
            self.lines[key] = self.lines.get(key, 0) + runs
        self.names |= other.names
        self.stored |= other.stored
        self.outside.update(other.outside)
        self.reflective |= other.reflective
        self.computed |= other.computed
        self.mutating |= other.mutating
        self.refused = self.refused or other.refused
        self.mutates |= other.mutates

    def read_global(self, namespace: Any, name: str) -> None:
        self.outside.setdefault((id(namespace), name), (namespace, name))


class Tracer:
    """Notes the lines of code run while references record (nested ones each get their own log)."""

    def __init__(self, observer: Observer | None = None) -> None:
        self._lines: list[dict[tuple[types.CodeType, int], int]] = []  # line -> times run, per reference
        self._given_modules: list[set[types.CodeType]] = []  # code with reflective lines run with a module at hand
        self._given_handed: list[set[types.CodeType]] = []  # ... with an object the block was handed at hand
        self._children: list[list[ReadLog]] = []
        self._traced: dict[types.CodeType, bool | None] = {}
        # filename -> _kind of it: a file's code objects share it (realpath walks the path, ~50 us, and a
        # symbolic capture runs thousands of sympy functions from a few hundred files)
        self._kinds: dict[str, bool | None] = {}
        self._globals: dict[types.CodeType, dict[str, Any]] = {}
        self._analysed: dict[types.CodeType, tuple[dict[int, LineReads], bool]] = {}
        self._previous: Any = None
        self._libraries: tuple[str, ...] | None = None  # see _SIZE_LIBRARIES, found when first tracing
        self._observer = observer if observer is not None else Observer()
        self._watched: list[dict[int, Any]] = []  # per reference: id -> an object it was handed
        self._handed: list[list[Handed]] = []
        # per reference: why it cannot stand for another call, found while it runs (a handed call inside it that is
        # not its own, code run with two sets of globals)
        self._foreign: list[str | None] = []
        self._inside = 0  # > 0 while a handed object's call runs (its code is not traced)
        # the code of the handed objects' methods: a call of one with such an object first is a handed call (a
        # function given one otherwise is the block's own code, read as any other)
        self._methods: frozenset[types.CodeType] = frozenset()
        self._reflective = _reflective_functions()
        self._reached: dict[tuple[int, int, int], tuple[Any, bool, Any]] = {}  # see _reaches; emptied as tracing ends

    @property
    def active(self) -> bool:
        return bool(self._lines)

    def available(self) -> bool:
        """Whether a reference can be traced: no other trace function (a debugger, coverage) is set."""
        return self.active or sys.gettrace() is None

    def start(self, handed: dict[int, Any] | None = None) -> None:
        """Trace a reference; `handed`: id -> the objects it is handed, whose calls are noted, not traced."""
        self._lines.append({})
        self._given_modules.append(set())
        self._given_handed.append(set())
        self._children.append([])
        self._watched.append(handed or {})
        self._handed.append([])
        self._foreign.append(None)
        for value in (handed or {}).values():
            self._methods |= methods_of(type(value))
        if len(self._lines) == 1:
            if self._libraries is None:
                self._libraries = _library_roots(_SIZE_LIBRARIES)
            sys.settrace(self._call)

    def stop(self) -> ReadLog:
        """The log of the innermost reference (merged into its enclosing one's)."""
        lines, children, given = self._lines.pop(), self._children.pop(), self._given_modules.pop()
        given_handed = self._given_handed.pop()
        handed, foreign = self._handed.pop(), self._foreign.pop()
        self._watched.pop()
        self._methods = frozenset().union(*(methods_of(type(value)) for watched in self._watched
                                            for value in watched.values()))
        if not self._lines:
            sys.settrace(None)
        self._reached = {key: known for key, known in self._reached.items() if key[2] <= len(self._lines)}
        log = self._log(lines, given, given_handed)
        for child in children:
            log.merge(child)
        log.handed = handed
        log.refused = log.refused or foreign
        if self._children:
            self._children[-1].append(log)
        return log

    def so_far(self) -> ReadLog:
        """What the references recording now have read so far: their lines run and their finished parts'
        logs (a call on a handed object may change what was read before it: `capture.replay` compares)."""
        log = ReadLog()
        for lines, given, given_handed, children in zip(self._lines, self._given_modules, self._given_handed,
                                                         self._children):
            log.merge(self._log(lines, given, given_handed))
            for child in children:
                log.merge(child)
        return log

    def replayed(self, log: ReadLog) -> None:
        """A replay inside a recording reference: what its reference read, the enclosing one reads."""
        if self._children:
            self._children[-1].append(log)

    def _call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if self._inside:  # run by a handed object's call: made again for real at each copy, not read here
            return None
        code = frame.f_code
        if code in self._methods and not code.co_filename.startswith(_OURS):
            first = _first_argument(frame)
            if any(id(first) in watched for watched in self._watched):
                return self._handed_call(frame, first)
        traced = self._traced.get(code, _UNKNOWN)
        if traced is _UNKNOWN:  # (None is a kind: traced where traced code calls it)
            filename = code.co_filename
            traced = self._kinds.get(filename, _UNKNOWN)
            if traced is _UNKNOWN:
                traced = self._kinds[filename] = _kind(filename, self._libraries or ())
            self._traced[code] = traced
            self._globals[code] = frame.f_globals
        if traced is not True and (traced is False or frame.f_back is None or frame.f_back.f_trace is None):
            return None
        if frame.f_globals is not self._globals[code]:
            # one code run with other globals (types.FunctionType(code, namespace)): its lines' globals are read in
            # the namespace of its first call, so what this call reads would not be compared
            for level, why in enumerate(self._foreign):
                self._foreign[level] = why or f"it runs {code.co_qualname} with two different sets of globals"
        lines = self._lines[-1]
        key = (code, frame.f_lineno)
        lines[key] = lines.get(key, 0) + 1
        if self._reads(code)[1] and (code not in self._given_modules[-1] or code not in self._given_handed[-1]):
            # reads by computed names count where they can reach a module, or an object the block was handed:
            # its arguments and closure hold one, or an object they hold does (a config's own __getattribute__
            # reads the config, keyed whole)
            values = list(frame.f_locals.values())
            if any(self._reaches(value, 0) for value in values):
                self._given_modules[-1].add(code)
            watched = self._watched[-1]
            if watched and any(self._reaches(value, 1) for value in values):
                self._given_handed[-1].add(code)
        return self._line

    def _reaches(self, value: Any, which: int) -> bool:
        """Whether a value reaches a module (`which` 0) or an object the innermost reference was handed (1),
        found once per value while the references record (the value kept: its id is not reused meanwhile)."""
        if isinstance(value, torch.nn.Module):
            return which == 0
        if value is None or isinstance(value, str | int | float | torch.Tensor | type | types.FunctionType):
            return False
        key = (id(value), which, len(self._lines))
        known = self._reached.get(key)
        held = _held(value)
        if known is None or known[2] != held:  # (asked again where what it holds itself changed since)
            watched = self._watched[-1]
            found = (lambda node: isinstance(node, torch.nn.Module)) if which == 0 else \
                (lambda node: id(node) in watched)
            known = self._reached[key] = (value, reaches(value, found, _REACH_LIMIT), held)
        return known[1]

    def _line(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "line" and self._lines:
            lines = self._lines[-1]
            key = (frame.f_code, frame.f_lineno)
            lines[key] = lines.get(key, 0) + 1
        return self._line

    def _handed_call(self, frame: types.FrameType, handed: Any) -> Any:
        """Note a call on a handed object (for each reference running that was handed it; one that was not
        cannot stand for its copies: the call's code is not traced), and follow it to its return only."""
        call = Handed(frame)
        for watched, calls, level in zip(self._watched, self._handed, range(len(self._handed))):
            if id(handed) in watched:
                calls.append(call)
            elif self._foreign[level] is None:
                self._foreign[level] = f"a block in it calls {call.code.co_qualname} on an object it was handed"
        self._observer.begin(call)
        self._inside += 1

        def follow(frame: types.FrameType, event: str, arg: Any) -> Any:
            if event == "exception":
                call.flaw = call.flaw or f"{call.code.co_qualname}, called on it, raised"
            elif event == "return":
                self._inside -= 1
                call.result = arg
                self._observer.end(call)
            return follow
        return follow

    def _reads(self, code: types.CodeType) -> tuple[dict[int, LineReads], bool]:
        found = self._analysed.get(code)
        if found is None:
            lines = line_reads(code)
            found = self._analysed[code] = (lines, any(reads.reflective for reads in lines.values()))
        return found

    def _log(self, lines: dict[tuple[types.CodeType, int], int], given: set[types.CodeType],
             given_handed: set[types.CodeType]) -> ReadLog:
        log = ReadLog()
        log.lines = lines
        for code, line in lines:
            log.codes.add(code)
            reads = self._reads(code)[0].get(line)
            if reads is None:
                continue
            log.names |= reads.names
            log.stored |= reads.stored
            log.reflective |= reads.reflective and code in given
            log.computed |= reads.reflective and code in given_handed
            log.mutates |= reads.mutates
            if reads.mutating:
                log.mutating.update((code, offset) for offset in reads.mutating)
            log.refused = log.refused or reads.refused
            if reads.globals:
                namespace = self._globals[code]
                for name in reads.globals:
                    space = namespace if name in namespace else _builtins(namespace)
                    log.read_global(space, name)
                    if name not in _BY_NAME and name not in _REFLECTIVE and id(space.get(name)) in self._reflective:
                        # a reflective function under another name (`ga = getattr`): what names it reads is
                        # not in the code; every attribute counts as read, and an object handed is not proven
                        log.reflective = log.computed = True
        return log


class paused_tracing:  # noqa: N801 - a context manager, named as one
    """No line tracing inside an op's dispatch (fake kernels and the recorder: torch's and our code, and
    most of a reference's Python calls), where the tracer is a replay's."""

    __slots__ = ("_trace",)

    def __enter__(self) -> None:
        trace = sys.gettrace()
        self._trace = trace if getattr(trace, "__func__", None) is Tracer._call else None
        if self._trace is not None:
            sys.settrace(None)

    def __exit__(self, *exc: Any) -> None:
        if self._trace is not None:
            sys.settrace(self._trace)


def _kind(filename: str, libraries: tuple[str, ...] = ()) -> bool | None:
    """True: traced; False: not; None: traced where called from traced code (the standard library, the
    `libraries` torch computes sizes in, and code made by exec: a dataclass's __init__)."""
    if filename.startswith(_UNTRACED):
        return False
    if filename.startswith("<"):
        return None
    real = os.path.realpath(filename)
    if real.startswith(_STDLIB) and "-packages" + os.sep not in real or libraries and real.startswith(libraries):
        return None
    return True


def _held(value: Any) -> Any:
    """The identities of what a value holds itself (its attributes, or a container's items): a cheap sign
    that what it reaches may have changed."""
    if isinstance(value, dict):
        return tuple(map(id, dict.values(value)))
    if isinstance(value, list | tuple | set | frozenset):
        return tuple(map(id, value))
    state = own_attribute(value, "__dict__", None)
    return tuple(map(id, state.values())) if type(state) is dict else None


def _reflective_functions() -> frozenset[int]:
    """The ids of the functions that read attributes by a name given to them, of the modules imported (one not
    imported cannot have been bound to another name)."""
    found = [getattr(builtins, name) for name in ("getattr", "hasattr", "setattr", "delattr", "vars", "dir")]
    found.append(object.__getattribute__)
    for module, names in (("operator", ("attrgetter",)), ("inspect", ("getattr_static", "getmembers")),
                          ("dataclasses", ("asdict", "astuple"))):
        imported = sys.modules.get(module)
        found.extend(getattr(imported, name) for name in names if imported is not None)
    return frozenset(id(function) for function in found)


def _library_roots(names: tuple[str, ...]) -> tuple[str, ...]:
    """The directories of those of the packages `names` that are imported (one not imported runs no code)."""
    found = []
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            found.append(os.path.dirname(os.path.realpath(file)) + os.sep)
    return tuple(found)


def methods_of(cls: type) -> frozenset[types.CodeType]:
    """The code of a class's Python methods, and of its properties' accessors, through its bases."""
    found = set()
    for base in cls.__mro__[:-1]:
        for item in vars(base).values():
            parts = (item.fget, item.fset, item.fdel) if isinstance(item, property) else \
                (getattr(item, "__func__", item),)
            found.update(part.__code__ for part in parts if isinstance(part, types.FunctionType))
    return frozenset(found)


def _first_argument(frame: types.FrameType) -> Any:
    """The value of a frame's first parameter (`self` of a method), None when it has none."""
    code = frame.f_code
    return frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None


def _builtins(namespace: dict[str, Any]) -> dict[str, Any]:
    found = namespace.get("__builtins__", builtins.__dict__)
    return found if isinstance(found, dict) else found.__dict__
