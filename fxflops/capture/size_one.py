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
(the same stride either way). Every other `== 1` (a squeeze, a
branch in the model, a real broadcast, a stride that matters) stays a guard of its own, and none is
hidden behind one of these: an unguarded question leaves nothing the ShapeEnv later assumes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

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
_CPP_QUESTIONS = {("c10/core/Contiguity.h", 66): NOT_ONE}
# the torch release the C++ lines were read in: in another, that line may ask something else
_CPP_QUESTIONS_READ_IN = "2.14."

# how far up from evaluate_sym_node the asking function may be: torch's guard machinery in between
# (_guard_or <- guard_or_false, or for a plain `if size != 1:` evaluate <- guard_bool <- bool_ <-
# SymBool.__bool__) is passed over, and the first frame past it is the asking function
_FRAMES_UP = 6

# a recognised question: the test of its call's values (its frame's locals, and the size asked about),
# and the forms it is asked in
Question = tuple[Callable[[dict, Any], "str | None"], frozenset]


def size_one_shape_env() -> Any:
    """A ShapeEnv (no duck sizing) answering the `size == 1` questions that decide nothing without a guard."""
    from torch.fx.experimental import symbolic_shapes
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    SLoc = getattr(symbolic_shapes, "SLoc", None)  # noqa: N806 (torch's class)

    questions = _questions()

    class SizeOneShapeEnv(ShapeEnv):
        # arguments passed on as given: other torch releases name and order them differently
        def evaluate_sym_node(self, sym_node: Any, *args: Any, **kwargs: Any) -> Any:
            answer = _unguarded_answer(sym_node, sys._getframe(1), questions)
            if answer is not None:
                return answer
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
            either = test(frame.f_locals, size)
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


# the forms a question whether a size is 1 takes: `size == 1`, `size != 1`, `size < 2` (a size of at
# least 1: 1), `size > 1`
IS_ONE, NOT_ONE_ASKED, BELOW_TWO, ABOVE_ONE = "== 1", "!= 1", "< 2", "> 1"


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

    def cpp(values: dict) -> str | None:
        if not torch.__version__.startswith(_CPP_QUESTIONS_READ_IN):
            return None
        file, line = str(values.get("file", "")).replace("\\", "/"), values.get("line")
        return next((way for (name, at), way in _CPP_QUESTIONS.items() if file.endswith(name) and line == at), None)

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

    def broadcast_in_dim(values: dict) -> str | None:
        # a kept axis of the broadcast view takes the input's stride if its size is not 1, and also if it
        # is 1 and the new size is the same: where the two are one size, the same stride either way
        tensor, axis, shape, new_axis = (values.get(name) for name in ("a", "original_idx", "shape", "idx"))
        if tensor is None or axis is None or shape is None or new_axis is None:
            return None
        return BOTH_WAYS if _same_size(tensor.shape[axis], shape[new_axis]) else None

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

    def numel_below_two(values: dict, size: Any) -> str | None:
        # is_contiguous: a tensor of fewer than 2 elements is contiguous; another is if its strides pass the
        # check. Where every stride is known to be the contiguous one for its sizes, the check passes at
        # every point: "contiguous" either way
        tensor = values.get("a")
        if not isinstance(tensor, torch.Tensor) or not _same_expr(tensor.numel(), size):
            return None
        return BOTH_WAYS if _contiguous_strides(tensor.shape, tensor.stride()) else None

    def collapse_stride(values: dict, size: Any) -> str | None:
        # _collapse_view_helper's stride of the collapsed axes: the least stride of the axes not 1 in size,
        # `stride = min(stride, strides[idx])` skipped for an axis of size 1. Where that axis's stride is
        # known to be no less than the least so far, min() keeps the least so far: the same stride either way
        shape, strides, axis, stride = (values.get(name) for name in ("shape", "strides", "idx", "stride"))
        if shape is None or strides is None or axis is None or stride is None or not _same_expr(shape[axis], size):
            return None
        return BOTH_WAYS if _known(strides[axis] >= stride) else None

    def only(test: Callable[[dict], str | None]) -> Callable[[dict, Any], str | None]:
        return lambda values, size: test(values)

    asked_equal = frozenset({IS_ONE})
    found: dict[Any, Question] = {
        SymNode.guard_or_false.__code__: (only(cpp), asked_equal),
        fake_impls.infer_size.__code__: (only(infer_size), asked_equal),
        refs._broadcast_shapes.__code__: (only(broadcast_shapes), asked_equal),
        torch._prims._broadcast_in_dim_meta.__code__: (only(broadcast_in_dim), asked_equal),
        prims_common.check_contiguous_sizes_strides.__code__: (only(contiguous), asked_equal),
        prims_common.is_channels_last_contiguous_2d.__code__: (only(channels_last), asked_equal),
        prims_common.is_channels_last_contiguous_3d.__code__: (only(channels_last), asked_equal),
        prims_common.is_contiguous.__code__: (numel_below_two, frozenset({BELOW_TWO})),
        torch._prims._collapse_view_helper.__code__: (collapse_stride, frozenset({NOT_ONE_ASKED})),
    }
    nested = _nested_code(refs._maybe_broadcast, "should_expand")
    if nested is not None:
        found[nested] = (only(should_expand), asked_equal)
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


def _known_equal(a: Any, b: Any) -> bool:
    """Whether two sizes are equal wherever the capture's conditions hold, without adding a condition."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(a == b)


def _nested_code(function: Any, name: str) -> Any:
    """The code object of the function `name` defined inside `function` (None if there is none)."""
    for constant in function.__code__.co_consts:
        if getattr(constant, "co_name", None) == name:
            return constant
    return None
