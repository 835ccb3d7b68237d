"""Sizes of 1 in a symbolic capture: torch's `size == 1` questions that decide nothing, left unguarded.

A sweep's sizes are symbols that may be 1 (`SizeSymbols` does not let torch make a 1 a constant), so
whatever the forward decides from a size being 1 is a guard, and a capture at batch 2 states whether
it holds at batch 1. Torch also asks `size == 1` where either answer gives the same program: a
broadcast of a size against itself or against a constant 1, the stride check of an axis whose stride
is the expected one. Guarded, each of those would be a condition (`batch != 1`) that splits batch 1
from a sweep for nothing (a ResNet's residual add and its batch norm's [C, 1, 1] operands ask it).

`size_one_shape_env()` is a ShapeEnv that answers those questions, and only those, from the capture's
own sizes without a guard. Each is recognised by the function asking it directly (its code object,
torch's guard machinery between it and the ShapeEnv passed over; or for C++ its file and line), the
form it asks in (`size == 1`, `size != 1`, `numel < 2`) and a test of that call's own values that
shows the other answer would compute the same there; a question it does not recognise is a guard as
always. Besides broadcasts and stride checks: `is_contiguous`'s "fewer than 2 elements" of a tensor
whose strides are known to be the contiguous ones (contiguous either way), and the collapsed stride
of `_collapse_view_helper` where the size-1 candidate's stride is known no less than the least so far
(the same stride either way). A decoder's attention asks three more (its rotary tables broadcast over
the batch, its output reshaped): `_maybe_broadcast`'s `x != y` of the constant 1 against a size where
another axis is expanded anyway; the stride of that broadcast axis (0, or at 1 the input's), read only
by its elementwise op's output layout, where the op's first operand orders that axis
(`_layout_decided_without`; the broadcast is kept out of the fake mode's cache meanwhile, so no other
call is served it unasked); C++ reshape's view-or-copy choice where it is the same at the capture's
sizes and wherever the size is 1 (`_reshape_either_way`). Every other `== 1` (a squeeze, a
branch in the model, a real broadcast, a stride that matters) stays a guard of its own, and none is
hidden behind one of these: an unguarded question leaves nothing the ShapeEnv later assumes.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

# the forms a question whether a size is 1 takes: `size == 1`, `size != 1`, `size < 2` (a size of at
# least 1: 1), `size > 1`
IS_ONE, NOT_ONE_ASKED, BELOW_TWO, ABOVE_ONE = "== 1", "!= 1", "< 2", "> 1"

# what a recognised question's own values show: both answers give the same program (BOTH_WAYS), or
# the answer "not 1" gives what "1" would at a point where the size is 1 (NOT_ONE), or neither (None)
BOTH_WAYS = "both ways"
NOT_ONE = "not one"

# C++ questions (TORCH_GUARD_OR_FALSE names its file and line; the line as this torch build reports it):
# c10/core/Contiguity.h, `_compute_contiguous_sym`'s first pass, per axis: a size-1 axis is skipped;
# another must have the expected stride (a guard, or known) and multiplies the expected stride by its
# size, by 1 where it is 1: the same strides expected further out, so "contiguous" holds at 1 too; a
# stride not known to be the expected one ends the pass, and the tensor's contiguity is then a formula
# in the sizes, right at every point. "Not 1" is right at a size of 1 either way; the other way is not
# (an axis skipped at 1 may have a stride that fails the check elsewhere).
# aten/src/ATen/TensorUtils.cpp, `computeStride` (fake_impls._compute_stride spells it in Python), called
# by reshape to choose a view or a copy: whether an old axis ending a chunk is 1 (line 375), whether a new
# size is 1 or the new sizes so far fall short of the chunk (line 388). Tested per call (`_reshape_either_way`).
# Each line with the torch releases it was read in (a version prefix): in another, that line may ask
# something else. Contiguity.h ships in torch/include, and 2.11's is 2.14's byte for byte; under 2.11
# TensorUtils.cpp's lines 375 and 388 ask what 2.14's do (`size != 1` and `size > 1` of computeStride in
# the reshapes of tests/test_sweep_size_one.py, whose splits and holds agree on both).
RESHAPE = "reshape"
_CPP_QUESTIONS = {("c10/core/Contiguity.h", 66): (NOT_ONE, frozenset({IS_ONE}), ("2.11.", "2.14.")),
                  ("aten/src/ATen/TensorUtils.cpp", 375): (RESHAPE, frozenset({NOT_ONE_ASKED}), ("2.11.", "2.14.")),
                  ("aten/src/ATen/TensorUtils.cpp", 388): (RESHAPE, frozenset({IS_ONE, ABOVE_ONE}), ("2.11.", "2.14."))}

# how far up from evaluate_sym_node the asking function may be: torch's guard machinery in between
# (_guard_or <- guard_or_false, or for a plain `if size != 1:` evaluate <- guard_bool <- bool_ <-
# SymBool.__bool__) is passed over, and the first frame past it is the asking function
_FRAMES_UP = 6

# a recognised question: the test of its call's values (its frame's locals, the size asked about, the
# frame itself for the calls above it, the form asked), and the forms it is asked in
Question = tuple[Callable[[dict, Any, Any, str], "str | None"], frozenset]


def size_one_shape_env() -> Any:
    """A ShapeEnv (no duck sizing) answering the `size == 1` questions that decide nothing without a guard."""
    from torch.fx.experimental import symbolic_shapes
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    SLoc = getattr(symbolic_shapes, "SLoc", None)  # noqa: N806 (torch's class)

    questions = _questions()

    class SizeOneShapeEnv(ShapeEnv):
        refusing = False  # within refusing_guards

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if isinstance(getattr(self, "fake_tensor_cache", None), dict):  # held while an answer's output differs
                self.fake_tensor_cache = _HeldCache()
            # what the capture's direct kernels found once, kept for the same question (symbolic_kernels):
            # (expression, bound, inclusive) sympy decided above the bound, each convolution side's output size and
            # each view's layout
            self.sympy_above: set[tuple] = set()
            self.convolution_sides: dict[tuple, Any] = {}
            self.view_layouts: dict[tuple, Any] = {}

        # arguments passed on as given: other torch releases name and order them differently
        def evaluate_sym_node(self, sym_node: Any, *args: Any, **kwargs: Any) -> Any:
            answer = _unguarded_answer(sym_node, sys._getframe(1), questions)
            if answer is not None:
                return answer
            if self.refusing:  # a direct kernel's dry run: a question that would be a guard stops it
                static = self._maybe_evaluate_static(sym_node.expr)
                if static is None:
                    raise WouldGuard(str(sym_node.expr))
                return static
            return super().evaluate_sym_node(sym_node, *args, **kwargs)

        def _get_stack_summary(self, is_debug: bool = False, framework_loc: str | None = None) -> tuple[Any, str]:
            # where a symbol or guard was made, for messages only: torch's own walk of the stack first
            # imports the modules whose files it skips (torch._inductor, torch.export: ~0.3 s once per
            # process); the nearest frame outside torch is found without them
            return SLoc(framework_loc if framework_loc is not None else _outside_torch(sys._getframe(1)), None), ""

    if SLoc is None or not _stack_summary_as_read(ShapeEnv):  # another release's: its own
        del SizeOneShapeEnv._get_stack_summary

    # duck sizing off: two names that happen to share a value are still two sizes
    return SizeOneShapeEnv(duck_shape=False)


class WouldGuard(Exception):
    """A question asked under `refusing_guards` that neither the sizes' expressions nor `size_one` answer: through
    the mode it would be a guard."""


@contextlib.contextmanager
def refusing_guards(shape_env: Any) -> Iterator[None]:
    """Within it, a question of `size_one_shape_env()`'s that would add a guard raises `WouldGuard` instead (a
    direct kernel asking torch's own functions what the mode would ask, leaving the op to the mode where that
    is a guard); other ShapeEnvs answer as always."""
    previous = getattr(shape_env, "refusing", False)
    shape_env.refusing = True
    try:
        yield
    finally:
        shape_env.refusing = previous


def _stack_summary_as_read(shape_env: type) -> bool:
    """Whether torch's ShapeEnv._get_stack_summary takes (is_debug, framework_loc), as the override does."""
    import inspect

    method = getattr(shape_env, "_get_stack_summary", None)
    try:
        return method is not None and list(inspect.signature(method).parameters)[1:] == ["is_debug", "framework_loc"]
    except (TypeError, ValueError):
        return False


def _outside_torch(frame: Any) -> str | None:
    """'file:line in function' of the nearest frame outside torch and this module (the model's line)."""
    torch_dir = os.path.dirname(torch.__file__)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(torch_dir) and name != __file__:
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def _unguarded_answer(sym_node: Any, frame: Any, questions: dict[Any, Question]) -> Any:
    """The answer at the capture's sizes (sympy's true or false) to a question whether a size is 1 that one
    of `questions` asks where the other answer would give the same program at a point that answers it
    so; else None."""
    import sympy

    expr, hint = sym_node.expr, sym_node.hint
    if not isinstance(hint, bool):
        return None
    form = _form(expr)
    if form is None:
        return None
    kind, size = form
    for _ in range(_FRAMES_UP):
        if frame is None:
            return None
        question = questions.get(frame.f_code)
        if question is None and _is_machinery(frame.f_code):
            frame = frame.f_back
            continue
        if question is not None:
            test, kinds = question
            if kind not in kinds:
                return None
            either = test(frame.f_locals, size, frame, kind)
            # the size is 1 at the capture's sizes where the question "is it 1" says yes, "is it not 1" no
            is_one = hint if kind in (IS_ONE, BELOW_TWO) else not hint
            return sympy.sympify(hint) if either is BOTH_WAYS or either is NOT_ONE and not is_one else None
        return None  # asked by a function not recognised: a guard
    return None


def _is_machinery(code: Any) -> bool:
    """Whether a frame is torch's guard machinery (sym_node, symbolic_shapes, SymBool.__bool__), which
    passes a question on from the function that asks it."""
    name = code.co_filename.replace("\\", "/")
    return name.endswith(("torch/fx/experimental/sym_node.py", "torch/fx/experimental/symbolic_shapes.py")) \
        or code is torch.SymBool.__bool__.__code__



def _form(expr: Any) -> tuple[str, Any] | None:
    """(form, the size asked about) of a question whether a size is 1, in any of sympy's spellings
    (`Ne(1, s)`, `1 < s`, `s >= 2`, `s <= 1`); None for any other question."""
    import sympy

    if isinstance(expr, sympy.Eq | sympy.Ne):
        kind = IS_ONE if isinstance(expr, sympy.Eq) else NOT_ONE_ASKED
        if expr.rhs == 1:
            return kind, expr.lhs
        return (kind, expr.rhs) if expr.lhs == 1 else None
    if isinstance(expr, sympy.StrictLessThan | sympy.StrictGreaterThan):  # lts < gts
        if expr.gts == 2:
            return BELOW_TWO, expr.lts
        return (ABOVE_ONE, expr.gts) if expr.lts == 1 else None
    if isinstance(expr, sympy.LessThan | sympy.GreaterThan):  # lts <= gts
        if expr.gts == 1:
            return BELOW_TWO, expr.lts
        return (ABOVE_ONE, expr.gts) if expr.lts == 2 else None
    return None


def _questions() -> dict[Any, Question]:
    """torch's functions that ask whether a size is 1, each with the test of its call's values (its frame's
    locals) that says which answers give the same program there."""
    import torch._prims
    import torch._prims_common as prims_common
    import torch._refs as refs
    from torch._subclasses import fake_impls
    from torch.fx.experimental.sym_node import SymNode

    def cpp(values: dict, size: Any, frame: Any, kind: str) -> str | None:
        file, line = str(values.get("file", "")).replace("\\", "/"), values.get("line")
        way, kinds, releases = next((way for (name, at), way in _CPP_QUESTIONS.items()
                                     if file.endswith(name) and line == at), (None, (), ()))
        if kind not in kinds or not torch.__version__.startswith(releases):
            return None
        # C++ frames are not Python's: the frame above the question's is the Python call into C++
        return _reshape_either_way(frame.f_back, size) if way is RESHAPE else way

    def infer_size(values: dict) -> str | None:
        # fake elementwise ops, per axis: b's size if a's is 1, else a's (b's must then be 1 or a's)
        return _broadcast(values.get("sizeA"), values.get("sizeB"))

    def broadcast_shapes(values: dict) -> str | None:
        # per shape and axis: the common size so far (1 at first) becomes this shape's if it is 1; this
        # shape's must be 1 or the common one
        shape, axis, common = (values.get(name) for name in ("shape", "idx", "common_shape"))
        return None if shape is None or axis is None or common is None else _broadcast(shape[axis], common[axis])

    def should_expand(values: dict) -> str | None:
        # _maybe_broadcast, per axis: both 1 goes on, one of them 1 expands, neither goes on; where the two
        # are one size the answers are "both" or "neither", and both go on
        return BOTH_WAYS if _same_size(values.get("x"), values.get("y")) else None

    def should_expand_unequal(values: dict) -> str | None:
        # `x != y` (the constant 1 against a size): "unequal" expands at once; "equal" (both 1) goes on to
        # the next axes, and expands at the first pair known unequal (an earlier one would have returned
        # already). Where the shapes have such a pair, the shape is expanded either way
        shape, common = values.get("a"), values.get("b")
        if shape is None or common is None or len(shape) != len(common):
            return None
        return BOTH_WAYS if any(_known(x != y) for x, y in zip(shape, common)) else None

    def broadcast_in_dim(values: dict, size: Any, frame: Any, kind: str) -> str | None:
        # a kept axis of the broadcast view takes the input's stride if its size is not 1, and also if it
        # is 1 and the new size is the same: where the two are one size, the same stride either way
        tensor, axis, shape, new_axis = (values.get(name) for name in ("a", "original_idx", "shape", "idx"))
        if tensor is None or axis is None or shape is None or new_axis is None:
            return None
        if _same_size(tensor.shape[axis], shape[new_axis]):
            return BOTH_WAYS
        # the constant 1 broadcast to a size: stride 0 where the size is not 1, the input's where it is. Inside
        # an elementwise op that stride is read by the output's layout alone, which it does not change where
        # the op's first operand orders the axis (`_layout_decided_without`)
        if type(tensor.shape[axis]) is int and tensor.shape[axis] == 1:
            return NOT_ONE if _layout_decided_without(frame, tensor, new_axis) else None
        return None

    def contiguous(values: dict) -> str | None:
        # a size-1 axis skips its stride check and leaves the expected stride as is; an axis whose stride
        # is the expected one passes the check and multiplies the expected stride by its size, by 1 at a
        # point where it is 1: the same result and the same strides expected further out
        stride, expected = values.get("y"), values.get("expected_stride")
        return NOT_ONE if stride is not None and expected is not None and _known_equal(stride, expected) else None

    def channels_last(values: dict) -> str | None:
        # the same check in channels-last order (the stride is read after the question)
        tensor, axis, expected = values.get("a"), values.get("idx"), values.get("expected_stride")
        if tensor is None or axis is None or expected is None:
            return None
        return NOT_ONE if _known_equal(tensor.stride()[axis], expected) else None

    def numel_below_two(values: dict, size: Any, frame: Any, kind: str) -> str | None:
        # is_contiguous: a tensor of fewer than 2 elements is contiguous; another is if its strides pass the
        # check. Where every stride is known to be the contiguous one for its sizes, the check passes at
        # every point: "contiguous" either way
        tensor = values.get("a")
        if not isinstance(tensor, torch.Tensor) or not _same_expr(tensor.numel(), size):
            return None
        return BOTH_WAYS if _contiguous_strides(tensor.shape, tensor.stride()) else None

    def collapse_stride(values: dict, size: Any, frame: Any, kind: str) -> str | None:
        # _collapse_view_helper's stride of the collapsed axes: the least stride of the axes not 1 in size,
        # `stride = min(stride, strides[idx])` skipped for an axis of size 1. Where that axis's stride is
        # known to be no less than the least so far, min() keeps the least so far: the same stride either way
        shape, strides, axis, stride = (values.get(name) for name in ("shape", "strides", "idx", "stride"))
        if shape is None or strides is None or axis is None or stride is None or not _same_expr(shape[axis], size):
            return None
        return BOTH_WAYS if _known(strides[axis] >= stride) else None

    def only(test: Callable[[dict], str | None]) -> Callable[[dict, Any, Any, str], str | None]:
        return lambda values, size, frame, kind: test(values)

    asked_equal = frozenset({IS_ONE})
    asked_any = frozenset({IS_ONE, NOT_ONE_ASKED, BELOW_TWO, ABOVE_ONE})
    found: dict[Any, Question] = {
        SymNode.guard_or_false.__code__: (cpp, asked_any),
        SymNode.guard_or_true.__code__: (cpp, asked_any),
        fake_impls.infer_size.__code__: (only(infer_size), asked_equal),
        refs._broadcast_shapes.__code__: (only(broadcast_shapes), asked_equal),
        torch._prims._broadcast_in_dim_meta.__code__: (broadcast_in_dim, asked_equal),
        prims_common.check_contiguous_sizes_strides.__code__: (only(contiguous), asked_equal),
        prims_common.is_channels_last_contiguous_2d.__code__: (only(channels_last), asked_equal),
        prims_common.is_channels_last_contiguous_3d.__code__: (only(channels_last), asked_equal),
        prims_common.is_contiguous.__code__: (numel_below_two, frozenset({BELOW_TWO})),
        torch._prims._collapse_view_helper.__code__: (collapse_stride, frozenset({NOT_ONE_ASKED})),
    }
    nested = _nested_code(refs._maybe_broadcast, "should_expand")
    if nested is not None:
        expand_equal, expand_unequal = only(should_expand), only(should_expand_unequal)
        found[nested] = (lambda values, size, frame, kind: (expand_equal if kind == IS_ONE else expand_unequal)(
            values, size, frame, kind), frozenset({IS_ONE, NOT_ONE_ASKED}))
    return found


def _broadcast(a: Any, b: Any) -> str | None:
    """Which answers to `a == 1` (or `b == 1`) give one broadcast size of `a` and `b`: both, where they are
    one size (an op's first operand is broadcast against itself); "not 1", where the other is the
    constant 1 (a [C, 1, 1] operand: the asked size either way, which is 1 where it is 1, but asked at
    1 the result would be the constant); else neither (a real broadcast decides the size)."""
    if _same_size(a, b):
        return BOTH_WAYS
    return NOT_ONE if type(a) is int and a == 1 or type(b) is int and b == 1 else None


def _same_size(a: Any, b: Any) -> bool:
    """Whether two sizes are one: the same int, or SymInts of the same expression."""
    if a is b or type(a) is int and type(b) is int and a == b:
        return True
    return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr


def _same_expr(value: Any, size: Any) -> bool:
    """Whether a size (int or SymInt) is the expression a question asks about."""
    return value == size if type(value) is int else isinstance(value, torch.SymInt) and value.node.expr == size


def _contiguous_strides(shape: Any, strides: Any) -> bool:
    """Whether each stride is known to be the contiguous one for the sizes after it, at every point."""
    expected: Any = 1
    for size, stride in reversed(tuple(zip(shape, strides))):
        if not _known_equal(stride, expected):
            return False
        expected = expected * size
    return True


def _known(condition: Any) -> bool:
    """Whether a size condition holds at every point the capture's ranges allow, asking no guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(condition)


def _not_one(size: Any) -> bool:
    """Whether `size == 1` is answered without a guard where the mode asks it as this module's "not 1" question
    (a broadcast against the constant 1, a contiguity check): static, known not 1, or not 1 at the capture's
    sizes (at a point where it is 1 that answer is a guard of the mode's)."""
    return type(size) is int or size.node.hint not in (None, 1) or _known(size != 1)


def _known_equal(a: Any, b: Any) -> bool:
    """Whether two sizes are equal wherever the capture's conditions hold, without adding a condition."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(a == b)


def _nested_code(function: Any, name: str) -> Any:
    """The code object of the function `name` defined inside `function` (a function or a code object; None
    if there is none)."""
    code = getattr(function, "__code__", function)
    for constant in getattr(code, "co_consts", ()):
        if getattr(constant, "co_name", None) == name:
            return constant
    return None


# how far up from a prim's meta function its caller in torch's references may be: the fake mode's
# dispatch (cache, decompositions) lies between
_DISPATCH_FRAMES = 40


def _layout_decided_without(frame: Any, tensor: Any, axis: int) -> bool:
    """Whether the stride on `axis` of the broadcast of `tensor` that `frame` (prims' broadcast_in_dim) makes
    is read by nothing that it changes: the broadcast is an elementwise binary reference's expansion of its
    second operand (`_maybe_broadcast`), its result goes to that op's prim alone, and the first operand, of
    the broadcast's shape, orders `axis` against every other axis in the output's layout.

    The prim's layout (`compute_elementwise_output_logical_to_physical_perm`) compares two axes' strides
    operand by operand and takes the first operand's order where its strides there are nonzero and unequal:
    known so at every point, the second's stride on `axis` is never compared, and the other comparisons do
    not read it. Its contiguity checks read the first operand first and the second only where the first
    passes; the second's check reaches `axis` only past its other axes, and asks there whether the size is
    1, a guard of its own (its stride, 0, is not the expected one). The broadcast's output is held out of
    the fake mode's cache until the reference returns (`_HeldCache`): another call of the same broadcast
    elsewhere asks its own question."""
    import torch._refs as refs

    expand = getattr(refs.expand, "__wrapped__", refs.expand).__code__
    inner = _nested_code(refs._maybe_broadcast, "__maybe_broadcast")
    binary = _nested_code(_nested_code(refs._make_elementwise_binary_reference, "inner"), "_ref")
    if inner is None or binary is None:
        return False
    frame = _up_to(frame, expand)
    if frame is None or frame.f_locals.get("a") is not tensor:
        return False
    frame = _up_to(frame, inner)
    if frame is None or frame.f_locals.get("x") is not tensor:
        return False
    common, ref = frame.f_locals.get("shape"), frame
    for _ in range(3):  # __maybe_broadcast <- its generator expression <- _maybe_broadcast <- _ref
        ref = ref.f_back if ref is not None else None
    if ref is None or ref.f_code is not binary or common is None:
        return False
    first, second = ref.f_locals.get("a"), ref.f_locals.get("b")
    if second is not tensor or not isinstance(first, torch.Tensor) or len(first.shape) != len(common) \
            or not all(_same_size(x, y) for x, y in zip(first.shape, common)):
        return False
    strides = first.stride()
    own = strides[axis]
    if not _known(own != 0) or not all(_known(other != 0) and _known(own != other)
                                       for at, other in enumerate(strides) if at != axis):
        return False
    cache = getattr(getattr(common[axis], "node", None), "shape_env", None)
    cache = getattr(cache, "fake_tensor_cache", None)
    if not isinstance(cache, _HeldCache):
        return False
    cache.hold(ref)
    return True


def _up_to(frame: Any, code: Any) -> Any:
    """The nearest frame above `frame` running `code`, within the fake mode's dispatch; None past it."""
    frame = frame.f_back
    for _ in range(_DISPATCH_FRAMES):
        if frame is None or frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


class _HeldCache(dict):
    """The ShapeEnv's fake-tensor cache, storing nothing while a held frame runs.

    A question answered without a guard where the op's own output differs by the answer (a broadcast's
    stride that only its elementwise op reads) must not leave that output in the cache: a later equal call
    from elsewhere would be served it without asking."""

    def __init__(self) -> None:
        super().__init__()
        self._held: Any = None

    def hold(self, frame: Any) -> None:
        self._held = frame

    def __setitem__(self, key: Any, entry: Any) -> None:
        if self._held is not None:
            if _running(self._held):
                return
            self._held = None
        super().__setitem__(key, entry)


def _running(frame: Any) -> bool:
    """Whether `frame` is on the current call stack."""
    current = sys._getframe(1)
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


def _reshape_either_way(caller: Any, size: Any) -> str | None:
    """NOT_ONE where the reshape that `caller` (the capture's torch-function mode calling `Tensor.reshape` or
    `torch.reshape`) runs is a view, or a copy, both at the capture's sizes and wherever `size` is 1.

    C++ reshape asks computeStride whether the new shape is a view of the tensor's strides; on a fake tensor
    it uses the answer only to choose the view (whose strides the fake view computes) or a copy, and drops
    computeStride's strides. The capture's answer to each question in that call whether `size` is 1 is
    then right wherever computeStride chooses alike at the capture's sizes and at any point where `size`
    is 1 (there every other question known from the sizes' ranges)."""
    import sympy

    if caller is None or not isinstance(size, sympy.Symbol):
        return None
    call = _reshape_call(caller)
    if call is None:
        return None
    tensor, new = call
    old, strides = list(tensor.shape), list(tensor.stride())
    env = next((v.node.shape_env for v in (*old, *strides, *new) if isinstance(v, torch.SymInt)), None)
    if env is None:
        return None
    hints = [_hint(v) for v in (*old, *strides, *new)]
    if any(h is None for h in hints):
        return None
    n, m = len(old), len(new)
    at_hint = _is_view(hints[:n], hints[n:2 * n], _inferred(hints[2 * n:], hints[:n]), lambda c: bool(c))
    exprs = [_expr(v).xreplace({size: 1}) for v in (*old, *strides, *new)]

    def known(condition: Any) -> bool | None:
        condition = sympy.sympify(condition)
        if condition in (sympy.true, sympy.false):
            return bool(condition)
        try:
            static = env._maybe_evaluate_static(condition)
        except Exception:  # noqa: BLE001 (any failure: not known)
            return None
        return None if static is None else bool(static)

    at_one = _is_view(exprs[:n], exprs[n:2 * n], _inferred(exprs[2 * n:2 * n + m], exprs[:n]), known)
    return NOT_ONE if at_hint is not None and at_hint == at_one else None


def _reshape_call(caller: Any) -> tuple[Any, list] | None:
    """(tensor, new sizes) of a `Tensor.reshape` / `torch.reshape` call that the capture's torch-function mode
    runs in `caller` (fxflops.capture.recorder.CompositeOps, which calls nothing else that reshapes)."""
    recorder = sys.modules.get("fxflops.capture.recorder")
    if recorder is None or caller.f_code is not recorder.CompositeOps.__torch_function__.__code__:
        return None
    values = caller.f_locals
    func, args, kwargs = values.get("func"), values.get("args"), values.get("kwargs") or {}
    if func not in (torch.Tensor.reshape, torch.reshape) or not isinstance(args, tuple) or not args:
        return None
    tensor, rest = args[0], list(args[1:])
    if kwargs:
        if set(kwargs) != {"shape"}:
            return None
        rest.append(kwargs["shape"])
    if len(rest) == 1 and isinstance(rest[0], tuple | list | torch.Size):
        rest = list(rest[0])
    if not isinstance(tensor, torch.Tensor) or not all(type(v) is int or isinstance(v, torch.SymInt) for v in rest):
        return None
    return tensor, rest


def _hint(value: Any) -> int | None:
    """A size's value at the capture's sizes."""
    if type(value) is int:
        return value
    hint = value.node.hint
    return hint if type(hint) is int else None


def _expr(value: Any) -> Any:
    """A size as a sympy expression."""
    import sympy

    return sympy.Integer(value) if type(value) is int else value.node.expr


def _inferred(new: list, old: list) -> list:
    """The new sizes with a -1 replaced by what the old sizes' count leaves for it."""
    if -1 not in new:
        return new
    numel, rest = 1, 1
    for value in old:
        numel = numel * value
    for value in new:
        if value != -1:
            rest = rest * value
    left = numel // rest if type(numel) is int and type(rest) is int else numel / rest
    return [left if value == -1 else value for value in new]


def _is_view(old: list, strides: list, new: list, decide: Callable[[Any], "bool | None"]) -> bool | None:
    """Whether computeStride (aten/src/ATen/TensorUtils.cpp; fake_impls._compute_stride in Python) finds `new`
    a view of sizes `old` with `strides`, each comparison answered by `decide` (None: it cannot tell)."""

    class Unknown(Exception):
        pass

    def ask(condition: Any) -> bool:
        answer = decide(condition)
        if answer is None:
            raise Unknown
        return answer

    try:
        if not old:
            return True
        numel = 1
        for value in old:
            numel = numel * value
        if ask(_eq(numel, 0)):
            return None  # an empty tensor: its own rules, not followed here
        view_d, base, tensor_numel, view_numel = len(new) - 1, strides[-1], 1, 1
        for tensor_d in range(len(old) - 1, -1, -1):
            tensor_numel = tensor_numel * old[tensor_d]
            if tensor_d == 0 or (ask(_ne(old[tensor_d - 1], 1))
                                 and ask(_ne(strides[tensor_d - 1], tensor_numel * base))):
                while view_d >= 0 and (ask(_lt(view_numel, tensor_numel)) or ask(_eq(new[view_d], 1))):
                    view_numel = view_numel * new[view_d]
                    view_d -= 1
                if ask(_ne(view_numel, tensor_numel)):
                    return False
                if tensor_d > 0:
                    base, tensor_numel, view_numel = strides[tensor_d - 1], 1, 1
        return view_d == -1
    except Unknown:
        return None


def _eq(a: Any, b: Any) -> Any:
    import sympy

    return a == b if type(a) is int and type(b) is int else sympy.Eq(a, b)


def _ne(a: Any, b: Any) -> Any:
    import sympy

    return a != b if type(a) is int and type(b) is int else sympy.Ne(a, b)


def _lt(a: Any, b: Any) -> Any:
    import sympy

    return a < b if type(a) is int and type(b) is int else sympy.Lt(a, b)
