"""What the command line says about a MODEL's inputs, as records, and the parsers of its small strings.

`InputOptions` (batch, sequence length, input shapes, dtype, --set values, the hf: task) goes in,
`ModelInputs` (the model, its example inputs, notes and cautions) comes out of `model_spec.load`;
`ModelSpecError` is every one-line usage error the command reports with exit status 2. The parsers
read `--input-shape [NAME=]SHAPE`, `--sweep NAME=VALUES`, `--dtype` and `--set KEY=VALUE`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
}
# --input-dtype: what the inputs made from --input-shape hold (integer ones for token ids or an Embedding)
INPUT_DTYPES = {**DTYPES, "long": torch.long, "int64": torch.long, "int": torch.int32, "int32": torch.int32,
                "bool": torch.bool}


class ModelSpecError(ValueError):
    """The MODEL string or an option describing the inputs cannot be used (one-line message)."""


@dataclass
class ModelInputs:
    """A resolved MODEL: the module, its example inputs, and where they came from."""

    model: nn.Module
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    # set when the inputs are real tensors fxflops made up (their values mean nothing): what they are
    made_up: str | None = None
    # inputs from --input-shape are meta tensors (nothing allocated); for a model with real weights, this
    # makes the real all-zero tensors a run needs (method trace), only when one is asked for or needed
    real_inputs: Callable[[], tuple[tuple, dict]] | None = None
    notes: list[str] = field(default_factory=list)  # what the user should know about how it was built
    cautions: list[str] = field(default_factory=list)  # what the report must carry (a model of class defaults)


@dataclass(frozen=True)
class InputOptions:
    """What the command line says about the inputs."""

    batch: int = 1
    seq_len: int = 128
    input_shapes: tuple[tuple[int, ...], ...] = ()  # positional inputs
    named_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()  # keyword inputs: (name, shape)
    seq_len_given: bool = False  # the user set seq_len (the CLI's --seq-len): refused where it means nothing
    dtype: torch.dtype | None = None
    input_dtype: torch.dtype | None = None  # of the inputs made from shapes (--input-dtype); None: by name/kind
    overrides: Mapping[str, Any] = field(default_factory=dict)  # config / constructor values
    hf_task: str = "auto"
    trust_remote_code: bool = False  # hf: may run the Python a config's auto_map names
    # where models and inputs are built: "meta" to count; "cpu" with real (random) weights for the tools
    # that run a real forward (--compare --run-tools); a FILE.py:FACTORY decides for itself
    device: str = "meta"


# ------------------------------------------------------------------------------- small parsers


def parse_input_shape(text: str) -> tuple[str | None, tuple[int, ...]]:
    """`2,16` -> (None, (2, 16)), a positional input; `input_ids=2,16` -> ("input_ids", (2, 16)), a keyword one."""
    name, sep, shape = text.rpartition("=")
    if not sep:
        return None, parse_shape(text)
    if not name.strip().isidentifier():
        raise ModelSpecError(f"bad input shape {text!r}: a named shape is NAME=SHAPE such as input_ids=2,16")
    return name.strip(), parse_shape(shape)


def parse_shape(text: str) -> tuple[int, ...]:
    """`1,3,224,224` (or `1x3x224x224`) -> (1, 3, 224, 224)."""
    parts = [part.strip() for part in re.split(r"[,x]", text.strip())]
    if not text.strip() or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ModelSpecError(
            f"bad input shape {text!r}: expected positive integers separated by commas, "
            "such as 1,3,224,224, or NAME=SHAPE for a keyword input (input_ids=2,16)"
        )
    return tuple(int(part) for part in parts)


# the axes a --sweep name means when the user gives none: [batch, seq] tokens, [batch, C, H, W] images
SWEEP_AXES: dict[str, tuple[int, ...]] = {"batch": (0,), "seq": (1,), "size": (2, 3), "height": (2,), "width": (3,)}
MAX_SWEEP_POINTS = 10_000
_SWEEP = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:\[([\d,\s-]+)\])?\s*=\s*(.+)$")
_RANGE = re.compile(r"^(\d+)\.\.(\d+)(?:([:*])(\d+))?$")


def parse_sweep(text: str) -> tuple[str, tuple[int, ...], list[int]]:
    """`seq=128,256,1024` -> ("seq", (1,), [128, 256, 1024]).

    Axes in brackets name what the size is (`size[2,3]=...`); batch, seq, size, height and width
    have defaults. Values are a comma list of sizes and ranges: `A..B` (every size), `A..B:STEP`,
    `A..B*FACTOR` (A, A*FACTOR, ... up to B)."""
    match = _SWEEP.match(text)
    if match is None:
        raise ModelSpecError(f"bad --sweep {text!r}: expected NAME=VALUES such as seq=128,256,1024 or "
                             "size[2,3]=160..320:32")
    name, axes_text, values_text = match.groups()
    if axes_text is not None:
        try:
            axes = tuple(int(axis) for axis in axes_text.split(","))
        except ValueError:
            raise ModelSpecError(f"bad --sweep {text!r}: axes in brackets are integers, e.g. seq[1]") from None
    elif name in SWEEP_AXES:
        axes = SWEEP_AXES[name]
    else:
        raise ModelSpecError(f"--sweep {name}: which input axis is {name}? Name it in brackets, e.g. "
                             f"{name}[1]=... (known without: {', '.join(SWEEP_AXES)})")
    values: list[int] = []
    for item in values_text.split(","):
        values += _sweep_values(item.strip(), text)
        if len(values) > MAX_SWEEP_POINTS:
            raise ModelSpecError(f"--sweep {name}: more than {MAX_SWEEP_POINTS} values")
    return name, axes, values


def _sweep_values(item: str, text: str) -> list[int]:
    if item.isdigit():
        return [int(item)]
    match = _RANGE.match(item)
    if match is None:
        raise ModelSpecError(f"bad --sweep value {item!r} in {text!r}: use sizes and ranges such as "
                             "128, 128..1024:128 or 128..4096*2")
    start, stop, kind, step = int(match[1]), int(match[2]), match[3], int(match[4] or 1)
    if stop < start or step < 1 or (kind == "*" and (step < 2 or start < 1)):
        raise ModelSpecError(f"bad --sweep range {item!r}: it needs start <= stop and a step of at least 1 "
                             "(a factor of at least 2, from a start of at least 1)")
    if kind == "*":
        found = []
        while start <= stop and len(found) <= MAX_SWEEP_POINTS:
            found.append(start)
            start *= step
        return found
    if (stop - start) // step > MAX_SWEEP_POINTS:
        raise ModelSpecError(f"--sweep range {item!r}: more than {MAX_SWEEP_POINTS} values")
    return list(range(start, stop + 1, step))


def parse_dtype(text: str | None, names: Mapping[str, torch.dtype] = DTYPES) -> torch.dtype | None:
    if text is None:
        return None
    try:
        return names[text.lower().removeprefix("torch.")]
    except KeyError:
        from fxflops.spelling import did_you_mean

        raise ModelSpecError(f"unknown dtype {text!r}; use one of {', '.join(names)}"
                             f"{did_you_mean(text.lower(), names)}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """`n_layer=2` -> ("n_layer", 2): values are read as JSON when they are JSON, else strings."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ModelSpecError(f"bad --set {text!r}: expected KEY=VALUE such as n_layer=2")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value
