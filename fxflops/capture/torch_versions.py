"""Names torch moved or renamed between the versions fxflops runs on (pyproject asks torch >= 2.5; the
CUDA images of lent GPUs carry older builds than the one tests pin): the newer name asked for first, the
older one as the fallback, in one place."""

from __future__ import annotations

from typing import Any

DEVICE_MISMATCH_MESSAGE = "Unhandled FakeTensor Device Propagation"  # the RuntimeError before torch 2.12


def has_guarding_hint(value: Any) -> bool:
    """Whether a SymInt has a hint a guard could use (plain ints do): `has_guarding_hint` in newer torch,
    `has_hint` before it."""
    from torch.fx.experimental import symbolic_shapes

    check = getattr(symbolic_shapes, "has_guarding_hint", None) or symbolic_shapes.has_hint
    return check(value)


def is_device_mismatch(error: BaseException) -> bool:
    """Whether a fake kernel refused tensors on two devices: `FakeTensorDeviceMismatchError` in newer
    torch, a RuntimeError with the same message before it."""
    from torch._subclasses import fake_tensor

    kind = getattr(fake_tensor, "FakeTensorDeviceMismatchError", None)
    if kind is not None and isinstance(error, kind):
        return True
    return isinstance(error, RuntimeError) and DEVICE_MISMATCH_MESSAGE in str(error)


def is_inplace(op: Any) -> bool:
    """Whether an aten overload writes its first argument and returns it (`add_`, `mul_.Tensor`):
    `torch.Tag.inplace` where torch has it, else `inplace_by_schema`."""
    import torch

    tag = getattr(torch.Tag, "inplace", None)
    return tag in op.tags if tag is not None else inplace_by_schema(op)


def inplace_by_schema(op: Any) -> bool:
    """The schema's own marks of an in-place overload, for torch without `Tag.inplace`: a name ending in `_`
    whose first argument, a Tensor, is written (an `out=` overload is not in-place; dunder names only as
    `__i*__`)."""
    schema = op._schema
    base = schema.name.split("::")[-1]
    first = schema.arguments[0] if schema.arguments else None
    written = first is not None and first.alias_info is not None and first.alias_info.is_write \
        and str(first.type) in ("Tensor", "List[Tensor]")
    return written and base.endswith("_") and not (base.startswith("__") and not base.startswith("__i"))


def symbolic_composites(op: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    """The context a composite op runs its inside in when sizes are symbolic. Torch's C++ matmul folds an
    N-d @ 2-d product (`linear` without bias, `matmul` of a 3-d input, the products of SDPA's math
    kernel) through `numel()` and `sizes()` until pytorch/pytorch#183397 (torch 2.11 among the releases
    before it): under a fake mode that pins every symbolic size to its example value, and a sweep to one
    point. On such a torch, for those ops (`folding_composite`), this is torch's Python dispatcher, so the
    matmul runs torch's own Python decomposition (as torch.export runs it), which reads
    `sym_numel()`/`sym_sizes()` and records the same view, mm and _unsafe_view; elsewhere nothing."""
    import contextlib

    from torch._dispatch.python import enable_python_dispatcher

    if _cpp_matmul_pins_sizes() and folding_composite(op, args, kwargs):
        return enable_python_dispatcher()
    return contextlib.nullcontext()


def folding_composite(op: Any, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether a composite reaches torch's C++ matmul fold: linear, matmul, and SDPA without dropout (a
    Python decomposition of dropout records another backward: native_dropout_backward for a mul)."""
    import torch

    packet = getattr(op, "overloadpacket", None)
    if packet is torch.ops.aten.scaled_dot_product_attention:
        dropout = (kwargs or {}).get("dropout_p", args[3] if len(args) > 3 else 0.0)
        return isinstance(dropout, int | float) and dropout == 0
    return packet in (torch.ops.aten.linear, torch.ops.aten.matmul)


def _cpp_matmul_pins_sizes() -> bool:
    """Whether this torch's C++ matmul fold may read concrete sizes (releases before 2.14: torch 2.11 was
    seen doing it; 2.14's keeps them symbolic, so its captures keep their own, faster, path)."""
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) < (2, 14)


def is_pointwise(op: Any) -> bool:
    """Whether an aten overload is tagged pointwise; an in-place one torch left untagged (torch 2.11's
    `hardtanh_`, `elu_`; tagged in newer torch) is, where its out-of-place overload of the same name is."""
    import torch

    if torch.Tag.pointwise in op.tags:
        return True
    if not is_inplace(op):
        return False
    schema = op._schema
    packet = getattr(torch.ops.aten, schema.name.split("::")[-1][:-1], None)
    functional = getattr(packet, schema.overload_name or "default", None) if packet is not None else None
    return functional is not None and torch.Tag.pointwise in functional.tags


def stage_peer_global_rank(stage: Any, stage_index: int) -> int:
    """The global rank holding pipeline stage `stage_index`, as `stage` sends to it: its own
    `_resolve_peer_global_rank` in newer torch; before it (torch 2.11) the stage's table of group ranks,
    taken as global without a group, as 2.11's own sends do."""
    resolve = getattr(stage, "_resolve_peer_global_rank", None)
    if resolve is not None:
        return resolve(stage_index)
    import torch.distributed as dist

    peer = stage.stage_index_to_group_rank[stage_index]
    return peer if stage.group is None else dist.get_global_rank(stage.group, peer)


def stage_input_metas(stage: Any) -> Any:
    """A pipeline stage's input metadata (each with .shape, .stride, .dtype, .requires_grad; None where the
    stage has none yet): `_stage_meta.inputs` in newer torch; before it (torch 2.11) the meta tensors of
    `inputs_meta`, read as the same four fields."""
    meta = getattr(stage, "_stage_meta", None)
    if meta is not None:
        return meta.inputs
    tensors = getattr(stage, "inputs_meta", None)
    if tensors is None:
        return None
    from types import SimpleNamespace

    return tuple(SimpleNamespace(shape=t.shape, stride=tuple(t.stride()), dtype=t.dtype, requires_grad=t.requires_grad)
                 if t is not None else None for t in tensors)


def microbatch_inputs(schedule: Any, args: tuple, kwargs: dict, target: Any, arg_mbs: Any, kwarg_mbs: Any,
                      target_mbs: Any) -> tuple:
    """(args, kwargs, targets) per micro-batch as a pipeline schedule's step splits them:
    `_get_microbatch_inputs` in newer torch; before it (torch 2.11, no pre-split inputs) `_split_inputs` and
    the target split with torch.tensor_split, as 2.11's step does."""
    split = getattr(schedule, "_get_microbatch_inputs", None)
    if split is not None:
        return split(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
    if any(given is not None for given in (arg_mbs, kwarg_mbs, target_mbs)):
        raise ValueError("pre-split micro-batches (arg_mbs=, kwarg_mbs=, target_mbs=) need a newer torch's "
                         "pipeline schedules")
    import torch

    args_split, kwargs_split = schedule._split_inputs(args, kwargs)
    targets = list(torch.tensor_split(target, schedule._n_microbatches)) if target is not None else None
    return args_split, kwargs_split, targets
