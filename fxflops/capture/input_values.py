"""Values a forward reads, computed from the real example inputs while the capture runs on fake tensors.

A forward that reads a tensor's value (`.item()`, `.tolist()`, `int(t)`) or makes an op whose output
size depends on values (`nonzero`, `masked_select`, `unique`, `bincount`, `repeat_interleave` with
tensor repeats) cannot be shaped by fake tensors alone. When the tensor derives only from the example
inputs and constants (a mask, a length, positions, a grid size) its value is known: every op whose
tensor arguments all have a real value ("shadow") runs on those real values too, beside its fake run,
so the read value is the one eager execution would see. Weights never get a shadow, so nothing the
weights determine is ever computed, and only the inputs and the small input-derived tensors are.

Two cases where the value is not known:

- routing (weights decide): a router's picks over weight-derived scores (`topk`'s indices, `argmax` / `max`
  along a dim, a `sort`'s ranking, `multinomial`'s samples) get a shadow under a stated assumption (`Routing`:
  balanced by default, the worst case, or given per-expert counts); a value read from them is stated in the
  capture's cautions, and whatever is built from them (counts, masks scattered into `zeros_like`) carries it.
- a size made from values without a shadow, or a value read from them, is counted at its bound
  (capture.value_bounds: every element for `nonzero`, a bound an op gives the values for `bincount`,
  `repeat_interleave` or `.item()`) and a caution says so; a read no op bounds fails, naming op, module and line.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from fxflops.capture.attribution import ModuleTracker
from fxflops.capture.recorder import source_text, user_frame
from fxflops.capture.tensor_walk import tensors_in
from fxflops.capture.value_bounds import SOURCES, AtBound, Bound, EveryIndex, at_bound, output_bounds
from fxflops.threads import one_thread

# an input with more elements gets no shadow (its copy would cost memory; forwards read values from
# masks, lengths and ids, not from images)
MAX_SHADOWED_INPUT = 1 << 24
# a factory op's output (arange, zeros, full) gets a shadow only up to this size (a tensor of constants)
MAX_SHADOWED_CONSTANT = 1 << 20
# an op whose output is larger is not run for real: a value read downstream of it then counts at its bound
# or fails, saying so (a 4096-token causal mask, 2**24 elements, cost a 70B first estimate 0.1 s for nothing)
MAX_SHADOWED_OUTPUT = 1 << 22

_aten = torch.ops.aten
# ops whose output memory is uninitialized: no value. A collective the capture does not see as a write
# fills such a buffer (FSDP2 all-gathers its parameters into one), and its garbage decided router picks;
# a forward that fills one in place and reads it fails loudly instead of silently
UNINITIALIZED = frozenset({_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty,
                           _aten.new_empty_strided})
# ops whose values read only their tensor arguments' shapes and dtypes (zeros_like(scores) is known whatever
# the scores are: a routing mask scattered into it has the picks' values)
SHAPE_ONLY = frozenset({_aten.new_ones.default, _aten.new_zeros.default, _aten.new_full.default,
                        _aten.ones_like.default, _aten.zeros_like.default, _aten.full_like.default,
                        _aten.fill.Scalar})
_DATA_DEPENDENT = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


def value_refusal(op: Any, in_place: bool = True) -> str | None:
    """Why `op`'s value is not computed from its arguments' values, or None: it draws random numbers (from the
    user's generator), its memory is uninitialized, or (`in_place`) it writes a tensor, whose value then depends
    on when it is read, which a graph's data flow does not say (the live capture follows writes itself)."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    if torch.Tag.nondeterministic_seeded in op.tags:
        return "random or in place"
    if op.overloadpacket in UNINITIALIZED:
        return "uninitialized memory"
    if in_place and op._schema.is_mutable:
        return "random or in place"
    return None


@dataclass(frozen=True)
class Routing:
    """What `topk` over weight-derived scores (a mixture-of-experts router) is assumed to pick, where the
    forward reads the picks' values (routed token counts): "balanced" (tokens·top_k/experts per expert,
    round robin), "worst" (every token to the same top_k experts) or given per-expert token counts."""

    kind: str = "balanced"
    counts: tuple[int, ...] = ()

    @staticmethod
    def of(value: str | Sequence[int] | Routing | None) -> Routing:
        if value is None:
            return Routing()
        if isinstance(value, Routing):
            return value
        if isinstance(value, str):
            if value not in ("balanced", "worst"):
                raise ValueError(f"routing must be 'balanced', 'worst' or a list of per-expert token counts, got {value!r}")
            return Routing(value)
        counts = tuple(int(c) for c in value)
        if not counts or any(c < 0 for c in counts):
            raise ValueError(f"routing counts must be non-negative ints, one per expert, got {value!r}")
        return Routing("counts", counts)

    def describe(self) -> str:
        if self.kind == "counts":
            return f"the given per-expert token counts {list(self.counts)}"
        if self.kind == "worst":
            return "worst-case routing (every token to the same top-k experts)"
        return "balanced routing (tokens·top_k/experts tokens per expert)"

    def indices(self, rows: int, k: int, choices: int) -> torch.Tensor:
        """[rows, k] expert indices, distinct within a row, with this routing's per-expert counts."""
        if self.kind == "worst":
            return torch.arange(k).expand(rows, k).clone()
        if self.kind == "balanced":
            return (torch.arange(rows * k) % choices).reshape(rows, k)
        if len(self.counts) != choices or sum(self.counts) != rows * k or max(self.counts, default=0) > rows:
            raise ValueError(f"routing counts {list(self.counts)} do not fit topk over {choices} experts: they must "
                             f"be {choices} counts summing to tokens·top_k = {rows * k}, each at most {rows}")
        # experts in order, each repeated by its count, dealt out slot by slot: a run of one expert
        # (at most `rows` long) lands on distinct rows
        order = torch.repeat_interleave(torch.arange(choices), torch.tensor(self.counts))
        return order.reshape(k, rows).t().contiguous()

    def ranking(self, rows: int, choices: int) -> torch.Tensor:
        """[rows, choices]: every expert once per row, in the order a router's sort ranks them. Balanced: row r
        from expert r mod experts on (any first k columns balanced where the tokens are a multiple of the
        experts); worst: the same order in every row; given counts: each row's first k (k = the counts' sum
        over the rows) as `indices` deals them, the other experts after them in order."""
        if self.kind == "worst":
            return torch.arange(choices).expand(rows, choices).clone()
        if self.kind == "balanced":
            return (torch.arange(rows)[:, None] + torch.arange(choices)) % choices
        k, left = divmod(sum(self.counts), rows) if rows else (0, 0)
        if left or not 0 < k <= choices:
            raise ValueError(f"routing counts {list(self.counts)} do not fit a sort of {choices} experts over {rows} "
                             "tokens: their sum must be tokens·top_k")
        top = self.indices(rows, k, choices)
        rest = torch.ones(rows, choices, dtype=torch.bool).scatter(1, top, False)
        return torch.cat([top, torch.arange(choices).expand(rows, choices)[rest].reshape(rows, choices - k)], 1)


def _data_dependent(op: Any) -> bool:
    """Whether an op reads a value or makes a size from values (torch tags it so)."""
    return isinstance(op, torch._ops.OpOverload) and any(tag in op.tags for tag in _DATA_DEPENDENT)


def reads_values(op: Any) -> bool:
    """Whether an op's result depends on tensor values, not only shapes (a value read, a value-made size, a
    router's picks, which get the routing assumption's values): a block that ran one is a program of those
    values (capture.replay copies no such block: its copies would carry no values)."""
    return _data_dependent(op) or op in _ROUTERS


ROUTED = "values the weights decide were read"  # how the routing caution begins


def routing_assumed(cautions: Sequence[str]) -> bool:
    """Whether a capture's count rests on the routing assumption (its cautions say so)."""
    return any(caution.startswith(ROUTED) for caution in cautions)


def routing_spread(balanced_flops: int, worst_flops: int) -> str:
    """The caution stating what worst-case routing would count beside the balanced count."""
    if worst_flops == balanced_flops:
        return f"worst-case routing counts the same FLOPs as balanced routing ({balanced_flops:,})"
    return (f"worst-case routing (every token to the same top-k experts) counts {worst_flops:,} FLOPs, "
            f"{(worst_flops - balanced_flops) / balanced_flops:+.1%} against balanced routing's {balanced_flops:,}")


class ValueReadError(RuntimeError):
    """A forward read a value that neither the inputs nor a stated assumption determine."""


@dataclass
class _Shadow:
    """A tensor's real values beside its fake twin, with the router picks they were derived from."""

    real: Any
    assumed: frozenset[str] = field(default_factory=frozenset)  # the assumed router picks it derives from


class InputValues:
    """Runs ops on fake tensors through `run`, and on the real values of input-derived tensors beside them."""

    def __init__(self, mode: FakeTensorMode, run: Callable[[Any, tuple, dict], Any], tracker: ModuleTracker,
                 root_type: str, routing: Routing) -> None:
        self.mode = mode
        self._run = run
        self._tracker = tracker
        self._root_type = root_type
        self.routing = routing
        self._shadows: dict[int, tuple[torch.Tensor, _Shadow]] = {}  # id(fake) -> (fake, its shadow)
        self._bounded: dict[str, None] = {}  # cautions of sizes counted at their bound, once each, in order
        self._bounds: dict[int, tuple[torch.Tensor, Bound]] = {}  # id(fake) -> (fake, where its values lie)
        self._routed: dict[str, None] = {}  # the router picks (op and module) a value read derived from, in order

    @property
    def cautions(self) -> list[str]:
        """What the count assumed: sizes at their bound, and the routing of the router picks read."""
        found = list(self._bounded)
        if self._routed:
            sites = list(self._routed)
            more = f" and {len(sites) - 1} more" if len(sites) > 1 else ""
            found.append(f"{ROUTED} (a router's picks: {sites[0]}{more}); counted "
                         f"under {self.routing.describe()}; routing='balanced', 'worst' or per-expert token "
                         "counts changes it")
        return found

    # --- inputs ----------------------------------------------------------------------------------

    def twin_input(self, twin: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """`twin`, also giving each real example input (not meta, not too large) a shadow: a copy, so an
        in-place op the forward runs on it never touches the user's tensor."""
        def made(tensor: torch.Tensor) -> torch.Tensor:
            fake = twin(tensor)
            if not tensor.is_meta and not isinstance(tensor, FakeTensor) and tensor.numel() <= MAX_SHADOWED_INPUT:
                with unset_fake_temporarily(), torch.no_grad():
                    self._shadows[id(fake)] = (fake, _Shadow(tensor.detach().clone()))
            return fake
        return made

    # --- ops -------------------------------------------------------------------------------------

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """What `func` gives on fake tensors; a value it reads or a size it makes comes from the shadows."""
        if func.namespace == "prim":  # prim.device, prim.layout: metadata, no value read, no tensor made
            return self._run(func, args, kwargs)  # (a third of a transformer's dispatches)
        tensors = tensors_in((args, kwargs))
        shadows = [self._shadow(t) for t in tensors]
        known = all(s is not None for s in shadows)
        # an op reading only its arguments' shapes makes constants whatever the arguments hold (up to a constant's size)
        constant = not known and func in SHAPE_ONLY
        known = known or constant
        data_dependent = _data_dependent(func)
        if known and data_dependent and tensors:
            return self._from_values(func, args, kwargs, shadows)
        try:
            out = self._run(func, *self._masks_as_indices(func, args, kwargs))
        except (DataDependentOutputException, DynamicOutputShapeException):
            bounded = self._at_bound(func, args, kwargs)
            if bounded is None:
                raise self._unknown(func) from None
            return bounded
        except RuntimeError as error:
            if func in _WIDENED and "not implemented for" in str(error):
                out = self._widened(func, args, kwargs)
            # the forward's own check of a size counted at its bound (split's sizes' sum): a kernel's own check
            # (a plain RuntimeError; a missing kernel's NotImplementedError is for the caller's fallbacks)
            elif self._bounded and type(error) is RuntimeError:
                raise self._after_bound(func, error) from error
            else:
                raise
        # a random op is not run for real: it would draw from the user's generator (its values are not
        # the inputs' anyway, so nothing downstream of one has a shadow)
        if known and value_refusal(func, in_place=False) is None \
                and _small_outputs(out, MAX_SHADOWED_OUTPUT if tensors and not constant else MAX_SHADOWED_CONSTANT):
            self._shadow_outputs(func, args, kwargs, [s for s in shadows if s is not None], out)
            return out
        if func in _ROUTERS:
            self._assume_routing(func, args, kwargs, out)
        else:
            self._forget_written(func, args, kwargs)
        if self._bounds or func.overloadpacket.__name__ in SOURCES or any(t.dtype == torch.bool for t in tensors):
            self._bound_outputs(func, args, kwargs, out)
        return out

    def _shadow(self, tensor: torch.Tensor) -> _Shadow | None:
        found = self._shadows.get(id(tensor))
        if found is not None and found[0] is tensor:
            return found[1]
        # a real tensor the forward made outside the mode (torch.tensor(sizes) lifted in) is a constant: its own value
        if not isinstance(tensor, FakeTensor) and not tensor.is_meta and tensor.numel() <= MAX_SHADOWED_CONSTANT:
            return _Shadow(tensor)
        return None

    def _masks_as_indices(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Boolean index masks with a value, as the integer indices they select, so `x[mask]` on a tensor without
        a value (the weights') is shaped by the mask's values alone, as eager execution shapes it."""
        position = _MASK_INDEXED.get(func)
        if position is None or len(args) <= position:
            return args, kwargs
        indices = list(args[position])
        for place, index in enumerate(indices):
            shadow = self._shadow(index) if isinstance(index, torch.Tensor) else None
            if shadow is None or index.dtype not in (torch.bool, torch.uint8):
                continue
            with unset_fake_temporarily():
                selected = shadow.real.bool().nonzero().unbind(1)
            del indices[place]
            for offset, real in enumerate(selected):
                indices.insert(place + offset, self._fake_of(real, index.device, shadow.assumed))
            return (*args[:position], indices, *args[position + 1:]), kwargs  # (torch allows one such mask)
        return args, kwargs

    def _widened(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op whose CPU kernel lacks an integer dtype its GPU kernel has (histc on int64 routing picks),
        run on float64 copies (exact for these values) and cast back; its value too where the inputs have one."""
        dtype = next(t.dtype for t in tensors_in((args, kwargs)))
        wide_args, wide_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.double(), (args, kwargs))
        out = self._run(func, wide_args, wide_kwargs).to(dtype)
        shadows = [self._shadow(t) for t in tensors_in((args, kwargs))]
        if all(s is not None for s in shadows):
            with unset_fake_temporarily(), torch.no_grad():
                real_args, real_kwargs = pytree.tree_map_only(
                    torch.Tensor, lambda t: self._shadow(t).real.double(), (args, kwargs))
                real = func(*real_args, **real_kwargs).to(dtype)
            self._shadows[id(out)] = (out, _Shadow(real, frozenset().union(*(s.assumed for s in shadows))))
        return out

    def _real_run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """`func` on the shadows' real values (a factory op meant for the meta device on the CPU)."""
        def real(value: Any) -> Any:
            if isinstance(value, FakeTensor) and self._shadow(value) is None:  # a shape-only op's (SHAPE_ONLY)
                return torch.zeros((), dtype=value.dtype).expand(value.shape)  # argument: its shape, no memory
            if isinstance(value, torch.Tensor):  # (a real constant as a copy: an in-place op must not change it)
                return self._shadow(value).real if isinstance(value, FakeTensor) else value.detach().clone()
            if isinstance(value, torch.device) and value.type == "meta":
                return torch.device("cpu")
            return value

        with unset_fake_temporarily(), torch.no_grad(), one_thread():  # (the copies too: under the mode they would be fake)
            real_args, real_kwargs = pytree.tree_map(real, (args, kwargs))
            if real_kwargs.get("device") in ("meta", torch.device("meta")):
                real_kwargs["device"] = torch.device("cpu")
            return func(*real_args, **real_kwargs)

    def _shadow_outputs(self, func: Any, args: tuple, kwargs: dict, shadows: list[_Shadow], out: Any) -> None:
        try:
            real = self._real_run(func, args, kwargs)
        except Exception:  # noqa: BLE001 - a kernel stricter than the fake one (kernel_checks says so): no shadow
            self._forget_written(func, args, kwargs)
            return
        assumed = frozenset().union(*(s.assumed for s in shadows))
        fakes, reals = pytree.tree_leaves(out), pytree.tree_leaves(real)
        if len(fakes) != len(reals):
            return
        for fake, value in zip(fakes, reals):
            if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor):
                self._shadows[id(fake)] = (fake, _Shadow(value, assumed))

    def _from_values(self, func: Any, args: tuple, kwargs: dict, shadows: list[_Shadow]) -> Any:
        """A data-dependent op on input-derived tensors: run on the real values; the fake output takes
        their shapes (a tensor) or is the value itself (a scalar read)."""
        real = self._real_run(func, args, kwargs)
        assumed = frozenset().union(*(s.assumed for s in shadows))
        self._routed.update(dict.fromkeys(sorted(assumed)))
        device = next((t.device for t in tensors_in((args, kwargs))), torch.device("cpu"))

        return pytree.tree_map(lambda value: self._fake_of(value, device, assumed)
                               if isinstance(value, torch.Tensor) else value, real)

    def _fake_of(self, value: torch.Tensor, device: torch.device, assumed: frozenset[str]) -> FakeTensor:
        """A fake tensor shaped as the real `value`, with `value` as its shadow."""
        with unset_fake_temporarily():
            meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        fake = FakeTensor(self.mode, meta, device)
        self._shadows[id(fake)] = (fake, _Shadow(value, assumed))
        return fake

    def _forget_written(self, func: Any, args: tuple, kwargs: dict) -> None:
        """An op that writes into a tensor with a shadow, from values without one, makes its shadow and those
        of its views (the shadows sharing its memory) stale: they are dropped."""
        schema = getattr(func, "_schema", None)
        if schema is None or not schema.is_mutable:
            return
        for position, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            # a list of written tensors too (FSDP2's split_with_sizes_copy(out=[...]) into its parameters)
            for tensor in (value if isinstance(value, list | tuple) else (value,)):
                if isinstance(tensor, torch.Tensor):
                    self._forget(tensor)

    def _forget(self, tensor: torch.Tensor) -> None:
        if self._bounds:  # a bound on its values, or on a view's, no longer holds
            memory = tensor.untyped_storage()._cdata
            for key in [key for key, (fake, _) in self._bounds.items() if fake.untyped_storage()._cdata == memory]:
                del self._bounds[key]
        written = self._shadow(tensor)
        if written is None or not isinstance(written.real, torch.Tensor):
            return
        memory = written.real.untyped_storage().data_ptr()
        for key in [key for key, (_, shadow) in self._shadows.items()
                    if shadow.real.untyped_storage().data_ptr() == memory]:
            del self._shadows[key]

    def numpy_reads(self) -> TorchFunctionMode:
        """A mode answering `Tensor.numpy()` (which a fake tensor refuses before any op is dispatched) from the
        tensor's values, for the capture to enter around the forward."""
        return _NumpyReads(self)

    def _numpy(self, tensor: torch.Tensor) -> Any:
        shadow = self._shadow(tensor)
        if shadow is None:
            raise self._unknown("Tensor.numpy")
        self._routed.update(dict.fromkeys(sorted(shadow.assumed)))
        with unset_fake_temporarily():
            return shadow.real.detach().clone().numpy()

    # --- what the values do not determine ----------------------------------------------------------

    def _assume_routing(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """A router's picks over scores without a shadow (the weights decide them): topk's indices, or
        argmax's / max's along a dim (top-1), get the routing assumption's values, used only if the
        forward reads them."""
        picks = _ROUTERS.get(func)
        if picks is None:
            return
        found = picks(args, kwargs, out)
        if found is None:
            return
        scores, k, dim, indices = found
        if not isinstance(indices, torch.Tensor) or scores.dim() == 0 or isinstance(k, torch.SymInt):
            return
        dim = dim % scores.dim()
        shape = [int(size) for size in scores.shape]
        shape[dim] = k
        choices = int(scores.shape[dim])
        rows = (math.prod(shape) // k) if k else 0
        with unset_fake_temporarily():
            moved = [*shape[:dim], *shape[dim + 1:], k]
            chosen = self.routing.ranking(rows, choices) if k == choices else self.routing.indices(rows, k, choices)
            picked = chosen.reshape(moved).movedim(-1, dim)
            if tuple(indices.shape) != tuple(picked.shape):  # argmax / max without keepdim
                picked = picked.squeeze(dim)
        path, type_name = self._tracker.current()
        site = f"{func} in module '{path or '(root)'}' ({type_name or self._root_type})"
        self._shadows[id(indices)] = (indices, _Shadow(picked, frozenset({site})))

    def _bound_of(self, value: Any) -> Bound | None:
        """Where a value's elements lie: a number's own, a shadow's range, a bound a rule gave, a boolean's 0..1."""
        if isinstance(value, bool | int | float) and not isinstance(value, torch.SymInt | torch.SymFloat):
            return Bound(value, value, "")
        if not isinstance(value, torch.Tensor):
            return None
        found = self._bounds.get(id(value))
        if found is not None and found[0] is value:
            return found[1]
        shadow = self._shadow(value)
        if shadow is not None and isinstance(shadow.real, torch.Tensor) and shadow.real.numel():
            with unset_fake_temporarily():
                low, high = shadow.real.min().item(), shadow.real.max().item()
            return Bound(low, high, "")
        if value.dtype == torch.bool:
            return Bound(0, 1, "booleans")
        return None

    def _bound_outputs(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """The bounds (value_bounds.RULES) of an op's outputs without a shadow."""
        path, type_name = self._tracker.current()
        origin = f"{func} in module '{path or '(root)'}' ({type_name or self._root_type})"
        for tensor, bound in output_bounds(func, args, kwargs, out, self._bound_of, origin):
            if self._shadow(tensor) is None and tensor.dtype != torch.bool:
                self._bounds[id(tensor)] = (tensor, bound)

    def _at_bound(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A size-making op, or a value read, without values, at its largest (value_bounds; a caution says so),
        or None where no bound is known."""
        found: AtBound | None = at_bound(func, args, kwargs, self._bound_of)
        if found is None:
            return None
        device = args[0].device
        if found.metas is not None:
            with unset_fake_temporarily():
                out = pytree.tree_map(lambda v: FakeTensor(self.mode, v, device) if isinstance(v, torch.Tensor) else v,
                                      found.metas)
        elif found.call is not None:
            call, call_args, call_kwargs = found.call
            out = self._run(call, *pytree.tree_map(self._every_index, (call_args, call_kwargs),
                                                    is_leaf=lambda v: isinstance(v, EveryIndex)))
        else:
            out = found.size  # a value read
        made = "reads a value" if found.call is None and found.metas is None else "makes a size from tensor values"
        self._bounded[f"{func} in {self._where()} {made} fxflops does not know: counted at its bound "
                      f"{found.size} ({found.words})"] = None
        if not isinstance(out, int | float):
            self._bound_outputs(func, args, kwargs, out)
        return out

    def _every_index(self, value: Any) -> Any:
        if not isinstance(value, EveryIndex):
            return value
        with unset_fake_temporarily():
            meta = torch.empty(value.length, dtype=torch.int64, device="meta")
        return FakeTensor(self.mode, meta, value.device)

    def _after_bound(self, func: Any, error: RuntimeError) -> ValueReadError:
        first = next(iter(self._bounded)).split(" fxflops does not know")[0]
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return ValueReadError(
            f"{func} failed in {self._where()} ({reason}) after {first} was counted at its bound: the forward needs "
            "the real values there; give real values for the inputs they derive from, routing= for a router's "
            "picks, or pass method='trace' with real weights")

    def _unknown(self, func: Any) -> ValueReadError:
        return ValueReadError(
            f"the forward reads a tensor's value ({func}) that derives from the weights or from an input given "
            f"without values, so its control flow or sizes depend on tensor values fake tensors do not have, in "
            f"{self._where()}: give real values for that input (a tensor, also in input_shape's list), or pass "
            "method='trace' with real weights")

    def _where(self) -> str:
        path, type_name = self._tracker.current()
        text = source_text(user_frame())
        return f"module '{path or '(root)'}' ({type_name or self._root_type})" + (f" at {text}" if text else "")


class _NumpyReads(TorchFunctionMode):
    """`Tensor.numpy()` on a fake tensor: its values (HiDream's MoE reads routed token counts so)."""

    def __init__(self, values: InputValues) -> None:
        super().__init__()
        self._values = values

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.numpy and args and isinstance(args[0], FakeTensor):
            return self._values._numpy(args[0])
        return func(*args, **(kwargs or {}))


def _small_outputs(out: Any, limit: int) -> bool:
    """Whether an op's outputs are small enough to compute and hold for real."""
    return all(t.numel() <= limit for t in tensors_in(out))


# ops indexing with a list of tensors (at this position) where a boolean mask's values make the size
_MASK_INDEXED: Mapping[Any, int] = {_aten.index.Tensor: 1, _aten.index_put.default: 1, _aten.index_put_.default: 1,
                                    _aten._index_put_impl_.default: 1}
# ops whose CPU kernels (and torch's meta kernels for the CPU) lack integer dtypes the GPU kernels have: run widened
_WIDENED = frozenset({_aten.histc.default})


def _argument(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    return args[position] if len(args) > position else kwargs.get(name, default)


# a router's picks: (scores, how many per row, along which dim, the indices tensor) from an op's call
_ROUTERS: Mapping[Any, Callable[[tuple, dict, Any], tuple | None]] = {
    _aten.topk.default: lambda args, kwargs, out: (
        args[0], int(_argument(args, kwargs, 1, "k")), _argument(args, kwargs, 2, "dim", -1), out[1]),
    _aten.argmax.default: lambda args, kwargs, out: None if _argument(args, kwargs, 1, "dim") is None else (
        args[0], 1, _argument(args, kwargs, 1, "dim"), out),
    _aten.max.dim: lambda args, kwargs, out: (args[0], 1, _argument(args, kwargs, 1, "dim"), out[1]),
    # a sort ranks every expert: its first k columns are the picks (the routing's `ranking`)
    _aten.sort.default: lambda args, kwargs, out: (
        args[0], _ranked(args[0], _argument(args, kwargs, 1, "dim", -1)), _argument(args, kwargs, 1, "dim", -1),
        out[1]),
    _aten.sort.stable: lambda args, kwargs, out: (
        args[0], _ranked(args[0], kwargs.get("dim", -1)), kwargs.get("dim", -1), out[1]),
    # a router sampling its picks from the scores' softmax: what it samples is assumed as topk's picks
    _aten.multinomial.default: lambda args, kwargs, out: (
        args[0], int(_argument(args, kwargs, 1, "num_samples")), -1, out),
}


def _ranked(scores: torch.Tensor, dim: int) -> int:
    return int(scores.shape[dim]) if scores.dim() else 1


# --- values from the inputs over a captured graph -----------------------------------------------------
# A capture at named sizes (a sweep, the training meter's) has no shadows: what derives from the inputs is
# read off its graph instead, and computed on each batch's real tensors (timing.data_masks: a data mask's
# kept pairs per step), with the same refusals as the live shadows above.


class NotReplayable(Exception):
    """A value whose derivation from the inputs cannot be computed on real tensors; says why."""


@dataclass(frozen=True)
class Derivation:
    """The ops between the model's inputs and `values` in a captured graph, in graph order."""

    values: tuple[torch.fx.Node, ...]
    nodes: tuple[torch.fx.Node, ...]  # call_function nodes only
    inputs: tuple[tuple[torch.fx.Node, int], ...]  # placeholder, its index among the batch's tensors
    constants: tuple[tuple[torch.fx.Node, torch.Tensor], ...] = ()  # placeholder, the scalar it holds

    def run(self, tensors: Sequence[torch.Tensor], argument: Callable[[Any], Any],
            chosen: dict[Any, Any] | None = None) -> list[Any]:
        """The values computed on the batch `tensors`; `argument` gives each argument that is not a node its
        value there (a symbolic size at the batch's sizes, the batch's device); `chosen` as call_recorded's."""
        env: dict[torch.fx.Node, Any] = {node: tensors[index] for node, index in self.inputs}
        device = tensors[0].device if tensors else None
        env.update((node, constant.to(device) if device is not None else constant) for node, constant in self.constants)

        def value(arg: Any) -> Any:
            if isinstance(arg, torch.fx.Node):
                return env[arg]
            if isinstance(arg, list | tuple):
                return type(arg)(value(item) for item in arg)
            return argument(arg)

        with torch.no_grad():
            for node in self.nodes:
                env[node] = call_recorded(node, value(node.args), {k: value(v) for k, v in node.kwargs.items()}, chosen)
        return [env[node] for node in self.values]


def derivation(*values: torch.fx.Node, what: str = "its value") -> Derivation:
    """The ops between the model's inputs (placeholders carrying capture.inputs' INPUT_INDEX) and `values`,
    computable on real tensors; NotReplayable says what stops it (`what` names the value in its words): a
    parameter or buffer read, a random op, uninitialized memory, an in-place write, a nested graph."""
    from fxflops.capture.inputs import INPUT_INDEX

    graph = values[0].graph
    ancestors: set[torch.fx.Node] = set()
    stack = list(values)
    while stack:
        node = stack.pop()
        if node not in ancestors:
            ancestors.add(node)
            stack.extend(node.all_input_nodes)
    inputs, nodes, constants = [], [], []
    for node in graph.nodes:  # graph order is an order that runs
        if node not in ancestors:
            continue
        if node.op == "placeholder":
            if INPUT_INDEX in node.meta:
                inputs.append((node, node.meta[INPUT_INDEX]))
            elif (constant := scalar_constant(node)) is not None:
                constants.append((node, constant))
            else:
                raise NotReplayable(f"{what} reads a parameter, buffer or constant tensor, not only the inputs")
        elif node.op != "call_function" or not callable(node.target) or isinstance(
                node.target, torch._ops.HigherOrderOperator):
            raise NotReplayable(f"{what} is built by {node.op} {node.target}, which is not replayed")
        elif (refused := value_refusal(node.target)) is not None:
            raise NotReplayable(f"{what} is built with {node.target} ({refused})")
        else:
            nodes.append(node)
    if _written(ancestors):
        raise NotReplayable(f"{what} is built with in-place ops")
    return Derivation(tuple(values), tuple(nodes), tuple(inputs), tuple(constants))


def scalar_constant(node: torch.fx.Node) -> torch.Tensor | None:
    """The value of a placeholder that holds a one-element tensor the forward made from a literal (the mode
    keeps such a constant real: `torch.tensor(0.0)` in transformers 5.17's eager mask), else None: a
    parameter, a buffer or a larger stray tensor holds state that a later batch may not share."""
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and not value.is_meta \
            and value.numel() == 1 and not value.requires_grad:
        return value.detach().clone()
    return None


def _written(nodes: set[torch.fx.Node]) -> bool:
    """Whether an op outside `nodes` writes one of them or a view of one (its value then depends on when
    it is read, which the data flow does not say)."""
    seen, stack = set(nodes), list(nodes)
    while stack:
        for user in stack.pop().users:
            schema = _schema(user)
            if schema is None or user in seen:
                continue
            if schema.is_mutable:
                return True
            if any(ret.alias_info is not None for ret in schema.returns):  # a view shares the storage
                seen.add(user)
                stack.append(user)
    return False


def _schema(node: torch.fx.Node) -> Any:
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema
    return None


def call_recorded(node: torch.fx.Node, args: tuple, kwargs: dict, chosen: dict[Any, Any] | None = None) -> Any:
    """Run a captured node's op on real values. A composite recorded whole (x.to(device) as aten.to.device)
    holds the Python call's arguments, which its overload may not take: then the Tensor method or
    torch function of that name, as the model called it. `chosen` keeps, per node, the one that worked."""
    function = chosen.get(node) if chosen is not None else None
    if function is not None:
        return function(*args, **kwargs)
    candidates = [node.target]
    if isinstance(node.target, torch._ops.OpOverload):
        name = node.target.overloadpacket.__name__
        candidates += [f for f in (getattr(torch.Tensor, name, None), getattr(torch, name, None)) if f is not None]
    for index, function in enumerate(candidates):
        try:
            out = function(*args, **kwargs)
        except (TypeError, RuntimeError):
            if index == len(candidates) - 1:
                raise
            continue
        if chosen is not None:
            chosen[node] = function
        return out
    raise AssertionError("unreachable")
