"""Example inputs made from sizes, and the checks that keep them honest.

`--input-shape` shapes (positional, or NAME=SHAPE by keyword) become all-zero tensors on the
model's device: long for token ids and masks, else floating. They are checked against forward's
signature, token ids against the (batch, seq) rank, and `--seq-len` is refused where it would
change nothing. `finish_inputs` applies `--dtype` to a resolved model and its floating-point inputs.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fxflops.cli.options import InputOptions, ModelInputs, ModelSpecError


def finish_inputs(loaded: ModelInputs, options: InputOptions) -> ModelInputs:
    """Apply --dtype to the model and its floating-point inputs; check inputs made from shapes fit forward."""
    if options.input_shapes or options.named_shapes:
        _check_forward_takes(loaded.model, loaded.args, loaded.kwargs)
    if options.dtype is not None:
        loaded.model.to(options.dtype)
        loaded.args = tuple(_cast(value, options.dtype) for value in loaded.args)
        loaded.kwargs = {key: _cast(value, options.dtype) for key, value in loaded.kwargs.items()}
    return loaded


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def _device_of(model: nn.Module) -> torch.device:
    tensor = next(iter(model.parameters()), None)
    if tensor is None:
        tensor = next(iter(model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("meta")


def _check_forward_takes(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """Inputs made from --input-shape must bind to forward's signature: a keyword-only input given by
    position (or a name forward does not take) would fail deep inside the capture instead."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    kinds = {p.kind for p in parameters.values()}
    positional = [name for name, p in parameters.items()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    keywords = [name for name, p in parameters.items()
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    forward = f"{type(model).__name__}.forward"
    takes = f"{forward} takes ({', '.join(parameters) or 'nothing'})"
    if len(args) > len(positional) and inspect.Parameter.VAR_POSITIONAL not in kinds:
        named = [name for name in keywords if name not in positional and name not in kwargs]
        what = (f"give keyword inputs by name, e.g. --input-shape {named[0]}=2,16" if named
                else f"give at most {len(positional)}")
        raise ModelSpecError(f"{takes}: {len(args)} positional shapes given, it takes {len(positional)}; {what}")
    if inspect.Parameter.VAR_KEYWORD in kinds:
        return
    for name in kwargs:
        if name not in keywords:
            close = difflib.get_close_matches(name, keywords, n=1)
            hint = f"; did you mean {close[0]}=...?" if close else ""
            raise ModelSpecError(f"--input-shape {name}=...: {takes}, no input {name!r}{hint}")


def _token_name(name: str) -> bool:
    """Integer index inputs by the names transformers gives them (input_ids, token_type_ids, ...)."""
    return name.endswith("_ids") or name.endswith("attention_mask")


def named_tensors(options: InputOptions, device: torch.device) -> dict[str, torch.Tensor]:
    """--input-shape NAME=SHAPE inputs: --input-dtype's, else long for token ids and masks, else floating."""
    return {name: torch.zeros(shape, dtype=options.input_dtype or (torch.long if _token_name(name) else
                                                                   (options.dtype or torch.float32)),
                              device=device)
            for name, shape in options.named_shapes}


def check_token_ranks(model_name: str, inputs: Mapping[str, tuple[int, ...]]) -> None:
    """Token ids are (batch, seq): any other rank counts a model that can never run (a 4-d input_ids)."""
    for name, shape in inputs.items():
        if name.endswith("_ids") and len(shape) != 2:
            raise ModelSpecError(f"{model_name} takes {name} of shape (batch, seq), e.g. --input-shape 1,128 or "
                                 f"--batch 1 --seq-len 128; got {','.join(map(str, shape))}")


def refuse_seq_len(options: InputOptions, why: str) -> None:
    """--seq-len where it would change nothing is an error, not silently ignored."""
    if options.seq_len_given:
        raise ModelSpecError(f"--seq-len: {why}")


def tensors_from_shapes(
    shapes: Sequence[tuple[int, ...]], device: torch.device, tokens: bool, dtype: torch.dtype | None,
    input_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """All-zero tensors of these shapes: of `input_dtype` (--input-dtype) when given, else long for token
    ids, else floating."""
    kind = input_dtype or (torch.long if tokens else (dtype or torch.float32))
    try:
        return tuple(torch.zeros(shape, dtype=kind, device=device) for shape in shapes)
    except RuntimeError as error:
        if "overflow" not in str(error):
            raise
        raise ModelSpecError(f"--input-shape {' '.join(','.join(map(str, s)) for s in shapes)} is too large for a "
                             "tensor, even a fake one: more than torch's 2**63 - 1 bytes") from None
