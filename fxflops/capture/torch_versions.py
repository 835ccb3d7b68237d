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
    `torch.Tag.inplace` where torch has it, else the schema's own marks (a name ending in `_` whose first
    argument is written; an `out=` overload is not in-place)."""
    import torch

    tag = getattr(torch.Tag, "inplace", None)
    return tag in op.tags if tag is not None else inplace_by_schema(op)


def inplace_by_schema(op: Any) -> bool:
    """`is_inplace` where torch has no `Tag.inplace`: from the op's schema alone."""
    schema = op._schema
    base = schema.name.split("::")[-1]
    first = schema.arguments[0] if schema.arguments else None
    written = first is not None and first.alias_info is not None and first.alias_info.is_write \
        and str(first.type) == "Tensor"
    return written and base.endswith("_") and not (base.startswith("__") and not base.startswith("__i"))


def symbolic_composites(op: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    """The context a composite op runs its inside in when sizes are symbolic. Torch's C++ matmul folds an
    N-d @ 2-d product (`linear` without bias, `matmul` of a 3-d input, the products of SDPA's math
    kernel) through `numel()` and `sizes()` until pytorch/pytorch#183397 (torch 2.11 among the releases
    before it): under a fake mode that pins every symbolic size to its example value, and a sweep to one
    point. For those ops this is torch's Python dispatcher, so the matmul runs torch's own Python
    decomposition (as torch.export runs it), which reads `sym_numel()`/`sym_sizes()` on every release and
    records the same view, mm and _unsafe_view. SDPA only without dropout, and no other composite: a Python
    decomposition of dropout records another backward (native_dropout_backward for a mul)."""
    import contextlib

    import torch
    from torch._dispatch.python import enable_python_dispatcher

    packet = getattr(op, "overloadpacket", None)
    folds = packet in (torch.ops.aten.linear, torch.ops.aten.matmul)
    if packet is torch.ops.aten.scaled_dot_product_attention:
        dropout = (kwargs or {}).get("dropout_p", args[3] if len(args) > 3 else 0.0)
        folds = isinstance(dropout, int | float) and dropout == 0
    return enable_python_dispatcher() if folds else contextlib.nullcontext()


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
