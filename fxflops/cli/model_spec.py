"""Turn a MODEL string of the command line into a model and example inputs, all on the meta device.

Forms (checked in this order):
    torchvision:NAME          torchvision.models.get_model(NAME, weights=None); never downloads
    hf:NAME                   a checkpoint whose published config fxflops knows (fxflops/cli/checkpoints.toml:
                              "hf:gpt2", "hf:facebook/opt-350m"), or a model type with its config
                              class's defaults ("hf:llama"; the report says so); never downloads
    hf:PATH                   a local config.json (or a folder holding one)
    FILE.py:FACTORY           FACTORY() from that file
    package.module:FACTORY    FACTORY() from an importable module
    NAME                      a built-in example (`fxflops examples`)

A factory returns a model, or (model, inputs) where inputs is a tensor, a tuple of positional
inputs, a dict of keyword inputs, or an (args, kwargs) pair. It receives whichever of `batch`,
`seq_len` and `dtype` its signature names.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import inspect
import json
import re
import sys
import tomllib
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxflops.cli import examples

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

HF_TASKS = {
    "auto": "",  # the class config.architectures names, else the head a user runs (see _hf_builder)
    "base": "AutoModel",
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "image-classification": "AutoModelForImageClassification",
}

ZERO_INPUTS = "all-zero inputs made from --input-shape"


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
    overrides: Mapping[str, Any] = field(default_factory=dict)  # config / constructor values
    hf_task: str = "auto"
    trust_remote_code: bool = False  # hf: may run the Python a config's auto_map names


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


def parse_dtype(text: str | None) -> torch.dtype | None:
    if text is None:
        return None
    try:
        return DTYPES[text.lower().removeprefix("torch.")]
    except KeyError:
        raise ModelSpecError(f"unknown dtype {text!r}; use one of {', '.join(DTYPES)}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """`n_layer=2` -> ("n_layer", 2): values are read as JSON when they are JSON, else strings."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ModelSpecError(f"bad --set {text!r}: expected KEY=VALUE such as n_layer=2")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


# ------------------------------------------------------------------------------------ dispatch


def load(spec: str, options: InputOptions | None = None) -> ModelInputs:
    """Resolve `spec` (see the module docstring) into a model with example inputs."""
    options = options or InputOptions()
    if spec.startswith("torchvision:"):
        return load_torchvision(spec.removeprefix("torchvision:"), options)
    if spec.startswith("hf:"):
        return load_huggingface(spec.removeprefix("hf:"), options)
    if ":" in spec:
        target, _, attribute = spec.rpartition(":")
        return load_factory(target, attribute, options)
    return load_example(spec, options)


def _finish(loaded: ModelInputs, options: InputOptions) -> ModelInputs:
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


def _named_tensors(options: InputOptions, device: torch.device) -> dict[str, torch.Tensor]:
    """--input-shape NAME=SHAPE inputs: long for token ids and masks, else floating."""
    return {name: torch.zeros(shape, dtype=torch.long if _token_name(name) else (options.dtype or torch.float32),
                              device=device)
            for name, shape in options.named_shapes}


def _check_token_ranks(model_name: str, inputs: Mapping[str, tuple[int, ...]]) -> None:
    """Token ids are (batch, seq): any other rank counts a model that can never run (a 4-d input_ids)."""
    for name, shape in inputs.items():
        if name.endswith("_ids") and len(shape) != 2:
            raise ModelSpecError(f"{model_name} takes {name} of shape (batch, seq), e.g. --input-shape 1,128 or "
                                 f"--batch 1 --seq-len 128; got {','.join(map(str, shape))}")


def _refuse_seq_len(options: InputOptions, why: str) -> None:
    """--seq-len where it would change nothing is an error, not silently ignored."""
    if options.seq_len_given:
        raise ModelSpecError(f"--seq-len: {why}")


def _tensors_from_shapes(
    shapes: Sequence[tuple[int, ...]], device: torch.device, tokens: bool, dtype: torch.dtype | None
) -> tuple[torch.Tensor, ...]:
    kind = torch.long if tokens else (dtype or torch.float32)
    try:
        return tuple(torch.zeros(shape, dtype=kind, device=device) for shape in shapes)
    except RuntimeError as error:
        if "overflow" not in str(error):
            raise
        raise ModelSpecError(f"--input-shape {' '.join(','.join(map(str, s)) for s in shapes)} is too large for a "
                             "tensor, even a fake one: more than torch's 2**63 - 1 bytes") from None


# ------------------------------------------------------------------------------------ examples


def load_example(name: str, options: InputOptions) -> ModelInputs:
    try:
        example = examples.get_example(name)
    except KeyError:
        close = _other_forms_of(name)
        guess = f"did you mean {' or '.join(close)}? " if close else ""
        raise ModelSpecError(
            f"unknown model {name!r}: not a built-in example (`fxflops examples` lists them); {guess}"
            "MODEL forms: torchvision:NAME, hf:NAME, hf:path/config.json, file.py:factory, "
            "package.module:factory"
        ) from None
    try:
        with torch.device("meta"):
            model = example.build(**options.overrides)
    except TypeError as error:
        raise ModelSpecError(f"--set does not fit example {example.name}: {error}") from None
    if not example.takes_tokens:
        _refuse_seq_len(options, f"{example.name} takes images, not token sequences; give the input size with "
                                 "--input-shape, e.g. 1,1,32,32")
    elif options.input_shapes or options.named_shapes:
        _refuse_seq_len(options, "--input-shape gives the sequence length already; give one of the two")
    if options.input_shapes and example.takes_tokens:
        _check_token_ranks(example.name, {"input_ids": options.input_shapes[0]})
    if options.input_shapes or options.named_shapes:
        args = _tensors_from_shapes(options.input_shapes, torch.device("meta"), example.takes_tokens, options.dtype)
    else:
        args = example.inputs(batch=options.batch, seq_len=options.seq_len, device="meta")
    loaded = ModelInputs(model, args, _named_tensors(options, torch.device("meta")), f"built-in example {example.name}")
    return _finish(loaded, options)


def _other_forms_of(name: str) -> list[str]:
    """What a bare NAME most likely meant: hf:gpt2, torchvision:resnet50, or a built-in example close to it."""
    found = []
    lowered = name.lower()
    if lowered in (checkpoint.lower() for checkpoint in _checkpoint_names()):
        found.append(f"hf:{name}")
    elif importlib.util.find_spec("transformers") is not None and lowered in _model_types():
        found.append(f"hf:{lowered}")
    if importlib.util.find_spec("torchvision") is not None:
        import torchvision

        if lowered in torchvision.models.list_models():
            found.append(f"torchvision:{lowered}")
    names = list(examples.EXAMPLES)
    found += [example for example in names if example.startswith(lowered)]
    return found[:3] or difflib.get_close_matches(lowered, names, n=2)


# --------------------------------------------------------------------------------- torchvision


def load_torchvision(name: str, options: InputOptions) -> ModelInputs:
    try:
        import torchvision
    except ImportError:
        raise ModelSpecError("torchvision: models need the torchvision package") from None
    known = torchvision.models.list_models()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else " (see torchvision.models.list_models())"
        raise ModelSpecError(f"unknown torchvision model {name!r}{hint}")
    with torch.device("meta"):
        model = torchvision.models.get_model(name, **_no_weights(torchvision, name, options.overrides))
    model.eval()
    _refuse_seq_len(options, f"torchvision {name} takes images, not token sequences; give the image size with "
                             "--input-shape, e.g. 1,3,224,224 (or --sweep size=...)")
    shapes = options.input_shapes
    if not shapes and not options.named_shapes:
        shapes = (_torchvision_input_shape(torchvision, name, model, options.batch),)
    args = _tensors_from_shapes(shapes, torch.device("meta"), False, options.dtype)
    return _finish(ModelInputs(model, args, _named_tensors(options, torch.device("meta")), f"torchvision {name}"),
                   options)


def _no_weights(torchvision: Any, name: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The builder's arguments with every weights argument None (a detector's backbone weights
    default to ImageNet's, which torchvision would download); fxflops never downloads anything."""
    weighted = [key for key, value in overrides.items() if _is_weights(key) and value is not None]
    if weighted:
        raise ModelSpecError(f"--set {weighted[0]}: fxflops never downloads weights (it counts from "
                             "shapes alone); leave the weights arguments out")
    parameters = inspect.signature(torchvision.models.get_model_builder(name)).parameters
    return {**{key: None for key in parameters if _is_weights(key)}, **overrides}


def _is_weights(name: str) -> bool:
    """torchvision's pretrained-weights arguments: `weights`, `weights_backbone` (not `init_weights`)."""
    return name == "weights" or name.startswith("weights_")


def _torchvision_input_shape(torchvision: Any, name: str, model: nn.Module, batch: int) -> tuple[int, ...]:
    """Image (or clip) size the model was trained at, read from its weights' metadata (no download)."""
    size = getattr(model, "image_size", None)
    if size is None:
        try:
            keywords = getattr(torchvision.models.get_model_weights(name).DEFAULT.transforms, "keywords", {})
        except (ValueError, AttributeError):
            keywords = {}
        size = keywords.get("crop_size") or keywords.get("resize_size") or 224
    if isinstance(size, (tuple, list)):
        size = size[0]
    if name in torchvision.models.list_models(module=torchvision.models.video):
        return (batch, 3, 16, size, size)
    return (batch, 3, size, size)


# -------------------------------------------------------------------------------- transformers


def load_huggingface(name: str, options: InputOptions) -> ModelInputs:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ModelSpecError('hf: models need the transformers package: pip install "fxflops[hf]"') from None
    if options.hf_task not in HF_TASKS:
        raise ModelSpecError(f"unknown --hf-task {options.hf_task!r}; use one of {', '.join(HF_TASKS)}")
    config, from_defaults = resolve_hf_config(name, options.trust_remote_code)
    for key, value in options.overrides.items():
        if not hasattr(config, key):
            raise ModelSpecError(f"--set {key}: {type(config).__name__} has no such field{_close_field(config, key)}")
        setattr(config, key, value)
    build, what = _hf_builder(config, options)
    try:
        with torch.device("meta"):
            model = build()
    except ValueError as error:
        first = str(error).strip().splitlines()[0]
        raise ModelSpecError(f"{type(config).__name__} has no {what}: {first}") from None
    model.eval()
    args, kwargs = _hf_inputs(model, config, options)
    loaded = ModelInputs(model, args, kwargs, f"transformers {type(model).__name__}")
    if from_defaults:
        loaded.cautions.append(_defaults_caution(name, config, options.overrides))
    if _custom_code(config) and not options.trust_remote_code:
        loaded.notes.append(f"hf:{name}'s config names its own model code (auto_map); it was not run, and "
                            f"transformers' {type(model).__name__} was built instead (--trust-remote-code runs it)")
    return _finish(loaded, options)


def _defaults_caution(name: str, config: Any, overrides: Mapping[str, Any]) -> str:
    given = f" but for --set {', '.join(overrides)}" if overrides else ""
    return (f"built from {type(config).__name__}'s defaults{given} (hf:{name} is a model type, not a published "
            "checkpoint): for a real checkpoint's sizes give hf:path/to/config.json")


def _close_field(config: Any, key: str) -> str:
    """"; did you mean 'n_layer'?" for a misspelt config field, else ""."""
    fields = [*config.to_dict(), *getattr(config, "attribute_map", {})]
    close = difflib.get_close_matches(key, fields, n=2)
    return f"; did you mean {' or '.join(repr(name) for name in close)}?" if close else ""


def _hf_builder(config: Any, options: InputOptions) -> tuple[Any, str]:
    """A function building the model --hf-task asks for, and what it builds in words."""
    import transformers

    trust = options.trust_remote_code
    task = options.hf_task
    if task == "auto":
        custom = _custom_auto_class(config) if trust else None
        if custom is not None:
            auto_class = getattr(transformers, custom)
            return (lambda: auto_class.from_config(config, trust_remote_code=True)), f"{custom} model"
        named = _architecture_class(config)
        if named is not None:
            return (lambda: named._from_config(config)), named.__name__
        task = _hf_auto_task(config)
    auto_class = getattr(transformers, HF_TASKS[task])
    return (lambda: auto_class.from_config(config, trust_remote_code=trust)), f"{task} model"


def _architecture_class(config: Any) -> Any:
    """The transformers class config.architectures names (what the checkpoint was saved from), if any."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
        if isinstance(cls, type) and hasattr(cls, "_from_config"):
            return cls
    return None


def _custom_auto_class(config: Any) -> str | None:
    """The auto_map key ("AutoModelForCausalLM") whose custom class config.architectures names."""
    import transformers

    auto_map = getattr(config, "auto_map", None) or {}
    for name in getattr(config, "architectures", None) or ():
        for key, target in auto_map.items():
            if key != "AutoConfig" and name in _class_names(target) and hasattr(transformers, key):
                return key
    return None


def _hf_auto_task(config: Any) -> str:
    """The head a user runs when the config names none: the LM of decoder-only and seq2seq types."""
    from transformers.models.auto import modeling_auto as auto

    model_type = getattr(config, "model_type", "")
    custom = set(getattr(config, "auto_map", None) or ()) if _custom_code(config) else set()
    if getattr(config, "is_encoder_decoder", False):  # never its decoder alone (whisper has a causal LM)
        seq2seq = model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES or "AutoModelForSeq2SeqLM" in custom
        return "seq2seq-lm" if seq2seq else "base"
    decoder_only = model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES \
        and model_type not in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if decoder_only or (custom and "AutoModelForCausalLM" in custom):
        return "causal-lm"
    return "base"


def _custom_code(config: Any) -> bool:
    auto_map = getattr(config, "auto_map", None)
    return isinstance(auto_map, dict) and _runs_code(auto_map)


def _class_names(target: Any) -> set[str]:
    """Class names an auto_map entry points at ("modeling_x.XForCausalLM" -> "XForCausalLM")."""
    items = target if isinstance(target, (list, tuple)) else (target,)
    return {item.rpartition(".")[2] for item in items if isinstance(item, str)}


def hf_config(name: str, trust_remote_code: bool = False) -> Any:
    """A transformers config: from a local file, a known checkpoint, or a model type's defaults."""
    return resolve_hf_config(name, trust_remote_code)[0]


def resolve_hf_config(name: str, trust_remote_code: bool = False) -> tuple[Any, bool]:
    """(config, from_defaults): whether the config is a class's defaults rather than a checkpoint's."""
    path = Path(name)
    if path.is_dir() and (path / "config.json").is_file():
        return _config_from_file(path / "config.json", trust_remote_code), False
    if path.is_file():
        return _config_from_file(path, trust_remote_code), False
    if name.endswith(".json"):
        raise ModelSpecError(f"hf: config file {name!r} not found")
    return _config_by_name(name)


def _config_from_file(path: Path, trust_remote_code: bool = False) -> Any:
    from transformers import CONFIG_MAPPING

    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelSpecError(f"hf: cannot read {path}: {error}") from None
    model_type = values.get("model_type") if isinstance(values, dict) else None
    if not model_type:
        raise ModelSpecError(f"hf: {path} has no \"model_type\" field")
    auto_map = values.get("auto_map") or {}
    if not isinstance(auto_map, dict):
        raise ModelSpecError(f"hf: {path}: \"auto_map\" must map auto classes to code, got {auto_map!r}")
    if trust_remote_code and _runs_code(auto_map):
        return _remote_config(path, auto_map)
    if model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type].from_dict(values)
    custom = auto_map.get("AutoConfig")
    if custom:
        raise ModelSpecError(
            f"hf: {path}: model_type {model_type!r} is defined by Python in the model's folder "
            f"(auto_map AutoConfig: {custom}); fxflops never runs a model repository's code "
            "unless you pass --trust-remote-code"
        )
    raise ModelSpecError(f"hf: {path}: transformers does not know model_type {model_type!r}")


def _runs_code(auto_map: Mapping[str, Any]) -> bool:
    """Whether an auto_map names config or model code (tokenizer and processor code is not built here)."""
    return any(key == "AutoConfig" or key.startswith("AutoModel") for key in auto_map)


def _remote_config(path: Path, auto_map: Mapping[str, Any]) -> Any:
    """The config as the folder's own code defines it; only with --trust-remote-code, never downloading:
    code in another repository ("org/repo--module.Class") is refused, not fetched."""
    from transformers import AutoConfig

    elsewhere = [ref for target in auto_map.values() for ref in (target if isinstance(target, list | tuple)
                                                                 else (target,)) if isinstance(ref, str) and "--" in ref]
    if elsewhere:
        raise ModelSpecError(f"hf: {path}: auto_map names code in another repository ({elsewhere[0]}); "
                             "fxflops never downloads anything: put that code in the folder")
    if path.name != "config.json":
        raise ModelSpecError(f"hf: {path}: a model whose code is in its folder is read from the folder's "
                             f"config.json; pass hf:{path.parent}")
    try:
        config = AutoConfig.from_pretrained(str(path.parent), trust_remote_code=True, local_files_only=True)
    except (OSError, ValueError, ImportError) as error:
        raise ModelSpecError(f"hf: {path}: the folder's own config code failed: {error}") from None
    config._name_or_path = str(path.parent)  # where its model code is found, whatever class the config is
    return config


def _model_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return list(CONFIG_MAPPING_NAMES)


def known_checkpoints() -> dict[str, dict[str, Any]]:
    """The published configs fxflops knows (fxflops/cli/checkpoints.toml): name -> config.json fields
    (with "aliases", the other names the Hub serves the checkpoint under)."""
    text = resources.files("fxflops.cli").joinpath("checkpoints.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)["checkpoint"]


def _checkpoint_values(name: str) -> dict[str, Any] | None:
    """config.json fields of the known checkpoint called `name` (or an alias of it), any case."""
    wanted = name.strip().lower()
    for checkpoint, values in known_checkpoints().items():
        if wanted in (n.lower() for n in [checkpoint, *values.get("aliases", ())]):
            return {key: value for key, value in values.items() if key != "aliases"}
    return None


def _checkpoint_names() -> list[str]:
    return [name for checkpoint, values in known_checkpoints().items()
            for name in [checkpoint, *values.get("aliases", ())]]


def _candidate_types(name: str, model_types: list[str]) -> list[str]:
    """Model types the name starts with, longest first (`opt-2.7b` -> `opt`)."""
    base = name.lower().rsplit("/", 1)[-1]
    pieces = re.split(r"[-_.]", base)
    prefixes = ["-".join(pieces[:end]) for end in range(len(pieces), 0, -1)]
    known = set(model_types)
    found = []
    for prefix in prefixes:
        for variant in (prefix, prefix.replace("-", "_")):
            if variant in known and variant not in found:
                found.append(variant)
    return found


def _config_by_name(name: str) -> tuple[Any, bool]:
    """A known checkpoint's published config, or a model type's defaults (flagged True); anything else
    is refused: a config class's defaults are never passed off as a checkpoint."""
    from transformers import CONFIG_MAPPING

    values = _checkpoint_values(name)
    if values is not None:
        return CONFIG_MAPPING[values["model_type"]].from_dict(values), False
    model_types = _model_types()
    if name in model_types:
        return CONFIG_MAPPING[name](), True
    raise ModelSpecError(_unknown_hf_name(name, model_types))


def _unknown_hf_name(name: str, model_types: list[str]) -> str:
    checkpoints = {checkpoint.lower(): checkpoint for checkpoint in _checkpoint_names()}
    close = [checkpoints[c] for c in difflib.get_close_matches(name.lower(), list(checkpoints), n=2, cutoff=0.7)]
    close = list(dict.fromkeys(close + difflib.get_close_matches(name, model_types, n=3)))[:3]
    guess = f"did you mean {' or '.join('hf:' + t for t in close)}? " if close else ""
    candidates = _candidate_types(name, model_types)
    example = candidates[0] if candidates else "MODEL_TYPE"
    return (f"hf: {name!r} is neither a checkpoint fxflops knows (fxflops examples lists them) nor a "
            f"transformers model type, and fxflops never downloads; {guess}give its config.json "
            f"(hf:path/to/config.json), or a model type with its sizes (hf:{example} --set key=value ...)")


def _hf_inputs(model: nn.Module, config: Any, options: InputOptions) -> tuple[tuple, dict]:
    """Keyword inputs named after the model's main input; token ids unless it takes pixels."""
    main = getattr(model, "main_input_name", "input_ids")
    device = torch.device("meta")
    if options.input_shapes or options.named_shapes:
        _refuse_seq_len(options, "--input-shape gives the input sizes already; give one of the two")
        given = dict(options.named_shapes)
        if options.input_shapes:
            given = {main: options.input_shapes[0], **given}
        _check_token_ranks(type(model).__name__, given)
        tensors = _tensors_from_shapes(options.input_shapes, device, main == "input_ids", options.dtype)
        kwargs = {main: tensors[0]} if tensors else {}
        return tuple(tensors[1:]), {**kwargs, **_named_tensors(options, device)}
    if main != "input_ids":
        _refuse_seq_len(options, f"{type(model).__name__} takes {main}, not token sequences; give its shape "
                                 f"with --input-shape")
    if main == "input_ids":
        ids = torch.zeros(options.batch, options.seq_len, dtype=torch.long, device=device)
        kwargs = {"input_ids": ids}
        if getattr(config, "is_encoder_decoder", False):
            kwargs["decoder_input_ids"] = ids
        return (), kwargs
    if main == "pixel_values":
        size = getattr(config, "image_size", 224)
        height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
        channels = getattr(config, "num_channels", 3)
        pixels = torch.zeros(options.batch, channels, height, width, device=device)
        return (), {"pixel_values": pixels}
    raise ModelSpecError(
        f"{type(model).__name__} takes {main!r}; give its shape with --input-shape"
    )


# ------------------------------------------------------------------------------------ factories


def load_factory(target: str, attribute: str, options: InputOptions) -> ModelInputs:
    """FILE.py:FACTORY or package.module:FACTORY."""
    module = _import_target(target)
    factory = getattr(module, attribute, None)
    if factory is None or not callable(factory):
        raise ModelSpecError(f"{target} has no callable {attribute!r}")
    with _no_exit(f"the factory {target}:{attribute}"):
        produced = _call_factory(factory, f"{target}:{attribute}", _factory_arguments(factory, options))
    model, inputs = (produced if isinstance(produced, tuple) and len(produced) == 2
                     and isinstance(produced[0], nn.Module) else (produced, None))
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{target}:{attribute} returned {type(model).__name__}, not a torch.nn.Module")
    made_up = None
    if options.input_shapes or options.named_shapes:
        device = _device_of(model)
        args = _tensors_from_shapes(options.input_shapes, device, False, options.dtype)
        kwargs = _named_tensors(options, device)
        made_up = None if device.type == "meta" else ZERO_INPUTS
    elif inputs is None:
        raise ModelSpecError(f"{target}:{attribute} returned no inputs; give --input-shape")
    else:
        args, kwargs = _split_inputs(inputs)
    return _finish(ModelInputs(model, args, kwargs, f"{target}:{attribute}", made_up), options)


def _call_factory(factory: Any, name: str, arguments: dict[str, Any]) -> Any:
    """FACTORY(**arguments); one that moves its model to CUDA on a machine without a GPU gets a line
    saying what to change, not torch's driver message from deep inside `.cuda()`."""
    try:
        return factory(**arguments)
    except (RuntimeError, AssertionError) as error:
        if torch.cuda.is_available() or not _cuda_missing(error):
            raise
        torch_dir = str(Path(torch.__file__).parent)
        frames = [frame for frame in traceback.extract_tb(error.__traceback__) if not frame.filename.startswith(torch_dir)]
        where = f" ({frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line})" if frames and frames[-1].line else ""
        raise ModelSpecError(
            f"{name} puts the model on CUDA{where}, and this machine has no GPU: fxflops needs none. Have the "
            "factory build it on the CPU or under torch.device('meta') (no .cuda() / device='cuda'), and count that"
        ) from None


def _cuda_missing(error: BaseException) -> bool:
    """torch's ways of saying there is no GPU: a CPU-only build, no driver, no device."""
    text = str(error)
    return any(words in text for words in ("not compiled with CUDA", "NVIDIA driver", "No CUDA GPUs", "CUDA driver"))


def _import_error_in(path: Path, error: ImportError) -> str:
    """An import failing inside the user's model file is that file's missing dependency, not fxflops'."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    where = f"{path}:{frames[-1].lineno}" if frames else str(path)
    code = f" ({frames[-1].line.strip()})" if frames and frames[-1].line else ""
    return f"{where}{code}: {type(error).__name__}: {error} — an import in the model file failed, not one of fxflops'"


def _import_target(target: str) -> Any:
    path = Path(target)
    if target.endswith(".py") or path.is_file():
        if not path.is_file():
            raise ModelSpecError(f"file {target!r} not found")
        module_name = f"_fxflops_user_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:  # a file Python does not import (no .py)
            raise ModelSpecError(f"{target!r} is not a Python file: give FILE.py:FACTORY or package.module:FACTORY")
        module = importlib.util.module_from_spec(spec)
        # Registered so dataclasses / pickling inside the user's file can find their module.
        sys.modules[module_name] = module
        try:
            with _no_exit(f"importing {target}"):
                spec.loader.exec_module(module)
        except ImportError as error:
            raise ModelSpecError(_import_error_in(path, error)) from None
        return module
    try:
        with _no_exit(f"importing {target}"):
            return importlib.import_module(target)
    except ModuleNotFoundError as error:
        raise ModelSpecError(f"cannot import {target!r}: {error}") from None


@contextlib.contextmanager
def _no_exit(what: str) -> Iterator[None]:
    """A SystemExit from the user's code (sys.exit, argparse at import) is an error naming that code,
    not fxflops exiting with its status and no report."""
    try:
        yield
    except SystemExit as error:
        raise ModelSpecError(f"{what} raised SystemExit({error.code!r}) instead of returning; a factory returns "
                             "a model or (model, inputs), and a model file runs no script at import") from None


def _factory_arguments(factory: Any, options: InputOptions) -> dict[str, Any]:
    """batch / seq_len / dtype, for the factories whose signature names them (not to a **kwargs, which is
    often a builder's options: torchvision.models.resnet18(**kwargs) passes them to ResNet), plus --set values."""
    offered = {"batch": options.batch, "seq_len": options.seq_len, "dtype": options.dtype}
    offered.update(options.overrides)
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return dict(options.overrides)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if "seq_len" not in parameters:  # only a factory that names it gets it (a **kwargs may be a builder's)
        _refuse_seq_len(options, f"{getattr(factory, '__name__', 'the factory')}() takes no seq_len argument; "
                                 "give its inputs' sizes with --input-shape, or add seq_len to its signature")
    unknown = [key for key in options.overrides if not takes_any and key not in parameters]
    if unknown:  # batch, seq_len and dtype are offered; --set values are asked for, and must be taken
        name = getattr(factory, "__name__", "the factory")
        close = difflib.get_close_matches(unknown[0], list(parameters), n=1)
        raise ModelSpecError(
            f"--set {unknown[0]}=...: {name}() takes no argument {unknown[0]!r}"
            + (f"; did you mean {close[0]!r}?" if close else "")
            + f" ({name} takes: {', '.join(parameters) or 'no arguments'})"
        )
    named = {name for name, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return {key: value for key, value in offered.items() if key in named or key in options.overrides}


def _split_inputs(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if (isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[0], (tuple, list))
            and isinstance(inputs[1], dict)):
        return tuple(inputs[0]), dict(inputs[1])
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}
