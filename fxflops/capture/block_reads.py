"""What a reference call's code read, found from the code it ran (`capture.replay`).

While a reference records, `sys.settrace` notes each line of Python code it runs (torch's and fxflops'
own code aside: their frames get no line events). Each line's bytecode then says what it can read:

- attribute names and string constants: an instance attribute of the block's modules whose name occurs
  on no line run was never read (a `layer_idx` used only to pick a cache slot, with no cache given);
- reads by a name the code computes (`vars(x)`, `x.__dict__`, `inspect.getattr_static`, `getattr(x, n)`
  with `n` not a literal): every attribute then counts as read;
- globals, and the attributes of modules and classes the code reaches by a name it reads: what the
  reference saw there is keyed and compared before every replay;
- what cannot be keyed refuses the reference: writes to globals or to an enclosing function's
  variables, object identities (`id`, `hash`), frames, `eval`/`exec`; and a write into anything
  (`d[k] = v`, `.append`, `x.a = v`) when the code also read a mutable global (it may be that one).

Nothing of the model is touched: no class swapped, no attribute set. The trace function is the
only global state, set for the reference's call and restored after it; with another one present
(a debugger, coverage), no reference is recorded and every call runs.
"""

from __future__ import annotations

import builtins
import dis
import os
import sys
import sysconfig
import types
from typing import Any

import torch

# frames of these trees get no line events: torch's machinery (dispatch, fake tensors, the modules' own
# forwards, which read their attributes only through `torch.nn`'s machinery) and our recorder
_UNTRACED = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
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
_BY_NAME = frozenset({"getattr", "hasattr", "setattr", "delattr"})
_REFUSED = {"id": "reads object identities (id)", "hash": "reads object identities (hash)",
            "globals": "reads globals() as a whole", "locals": "reads locals()", "eval": "runs eval",
            "exec": "runs exec", "_getframe": "reads frames", "currentframe": "reads frames",
            "f_back": "reads frames", "f_locals": "reads frames", "f_globals": "reads frames",
            "get_referrers": "reads the garbage collector", "__import__": "imports by a computed name"}
_MUTATORS = frozenset({"append", "extend", "insert", "pop", "popitem", "update", "setdefault", "clear", "remove",
                       "add", "discard", "sort", "reverse", "__setitem__", "__delitem__", "__setattr__",
                       "__delattr__", "setattr", "delattr", "__iadd__", "__ior__"})
_LOADS = frozenset({"LOAD_FAST", "LOAD_DEREF", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_CONST", "LOAD_CLASSDEREF"})


class LineReads:
    """What one line of code can read, and what about it cannot be keyed."""

    __slots__ = ("names", "globals", "stored", "reflective", "refused", "mutates")

    def __init__(self) -> None:
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
        elif name == "LOAD_CONST" and type(argument) is str:
            reads.names.add(argument)
        elif name in ("LOAD_GLOBAL", "LOAD_NAME"):
            reads.globals.add(argument)
            reads.names.add(argument)
            if argument in _BY_NAME and not _literal_name_follows(instructions, index):
                reads.reflective = True
        elif name in ("STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME", "DELETE_NAME"):
            reads.refused = f"writes the global {argument}"
        elif name in ("STORE_DEREF", "DELETE_DEREF") and argument in code.co_freevars:
            reads.refused = f"writes {argument} of an enclosing function"
        elif name in ("STORE_SUBSCR", "DELETE_SUBSCR"):
            reads.mutates = True
        if type(argument) is str and name != "LOAD_CONST":
            if argument in _REFLECTIVE:
                reads.reflective = True
            elif argument in _REFUSED:
                reads.refused = _REFUSED[argument]
            if argument in _MUTATORS:
                reads.mutates = True
    return lines


def _literal_name_follows(instructions: list[dis.Instruction], index: int) -> bool:
    """Whether `getattr(obj, "name", ...)` at `index` names its attribute by a literal: one load of the
    object (then attribute reads of it), and a string constant next."""
    position = index + 1
    if position >= len(instructions) or instructions[position].opname not in _LOADS:
        return False
    position += 1
    while position < len(instructions) and instructions[position].opname == "LOAD_ATTR":
        position += 1
    return position < len(instructions) and instructions[position].opname == "LOAD_CONST" \
        and type(instructions[position].argval) is str


class ReadLog:
    """What a reference's code read: names, globals (namespace, name), and what refuses it."""

    __slots__ = ("names", "outside", "stored", "reflective", "refused", "mutates", "codes")

    def __init__(self) -> None:
        self.codes: set[types.CodeType] = set()  # the code that ran
        self.names: set[str] = set()
        self.stored: set[str] = set()
        self.outside: dict[tuple[int, str], tuple[Any, str]] = {}  # (id(namespace), name) -> (namespace, name)
        self.reflective = False
        self.refused: str | None = None
        self.mutates = False

    def merge(self, other: ReadLog) -> None:
        self.codes |= other.codes
        self.names |= other.names
        self.stored |= other.stored
        self.outside.update(other.outside)
        self.reflective |= other.reflective
        self.refused = self.refused or other.refused
        self.mutates |= other.mutates

    def read_global(self, namespace: Any, name: str) -> None:
        self.outside.setdefault((id(namespace), name), (namespace, name))


class Tracer:
    """Notes the lines of code run while references record (nested ones each get their own log)."""

    def __init__(self) -> None:
        self._lines: list[set[tuple[types.CodeType, int]]] = []
        self._given_modules: list[set[types.CodeType]] = []  # code with reflective lines run with a module at hand
        self._children: list[list[ReadLog]] = []
        self._traced: dict[types.CodeType, bool | None] = {}
        # filename -> _kind of it: a file's code objects share it (realpath walks the path, ~50 us, and a
        # symbolic capture runs thousands of sympy functions from a few hundred files)
        self._kinds: dict[str, bool | None] = {}
        self._globals: dict[types.CodeType, dict[str, Any]] = {}
        self._analysed: dict[types.CodeType, tuple[dict[int, LineReads], bool]] = {}
        self._previous: Any = None
        self._libraries: tuple[str, ...] | None = None  # see _SIZE_LIBRARIES, found when first tracing

    @property
    def active(self) -> bool:
        return bool(self._lines)

    def available(self) -> bool:
        """Whether a reference can be traced: no other trace function (a debugger, coverage) is set."""
        return self.active or sys.gettrace() is None

    def start(self) -> None:
        self._lines.append(set())
        self._given_modules.append(set())
        self._children.append([])
        if len(self._lines) == 1:
            if self._libraries is None:
                self._libraries = _library_roots(_SIZE_LIBRARIES)
            sys.settrace(self._call)

    def stop(self) -> ReadLog:
        """The log of the innermost reference (merged into its enclosing one's)."""
        lines, children, given = self._lines.pop(), self._children.pop(), self._given_modules.pop()
        if not self._lines:
            sys.settrace(None)
        log = self._log(lines, given)
        for child in children:
            log.merge(child)
        if self._children:
            self._children[-1].append(log)
        return log

    def replayed(self, log: ReadLog) -> None:
        """A replay inside a recording reference: what its reference read, the enclosing one reads."""
        if self._children:
            self._children[-1].append(log)

    def _call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
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
        self._lines[-1].add((code, frame.f_lineno))
        if self._reads(code)[1] and code not in self._given_modules[-1] \
                and any(isinstance(value, torch.nn.Module) for value in frame.f_locals.values()):
            # reads by computed names count where they can reach a module: its arguments and closure
            # hold one (a config's own __getattribute__ reads the config, keyed whole anyway)
            self._given_modules[-1].add(code)
        return self._line

    def _line(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "line" and self._lines:
            self._lines[-1].add((frame.f_code, frame.f_lineno))
        return self._line

    def _reads(self, code: types.CodeType) -> tuple[dict[int, LineReads], bool]:
        found = self._analysed.get(code)
        if found is None:
            lines = line_reads(code)
            found = self._analysed[code] = (lines, any(reads.reflective for reads in lines.values()))
        return found

    def _log(self, lines: set[tuple[types.CodeType, int]], given: set[types.CodeType]) -> ReadLog:
        log = ReadLog()
        for code, line in lines:
            log.codes.add(code)
            reads = self._reads(code)[0].get(line)
            if reads is None:
                continue
            log.names |= reads.names
            log.stored |= reads.stored
            log.reflective |= reads.reflective and code in given
            log.mutates |= reads.mutates
            log.refused = log.refused or reads.refused
            if reads.globals:
                namespace = self._globals[code]
                for name in reads.globals:
                    log.read_global(namespace if name in namespace else _builtins(namespace), name)
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


def _library_roots(names: tuple[str, ...]) -> tuple[str, ...]:
    """The directories of those of the packages `names` that are imported (one not imported runs no code)."""
    found = []
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            found.append(os.path.dirname(os.path.realpath(file)) + os.sep)
    return tuple(found)


def _builtins(namespace: dict[str, Any]) -> dict[str, Any]:
    found = namespace.get("__builtins__", builtins.__dict__)
    return found if isinstance(found, dict) else found.__dict__
