"""Turn a MODEL string of the command line into a model and example inputs, all on the meta device.

Forms (checked in this order):
    torchvision:NAME          torchvision.models.get_model(NAME, weights=None); never downloads
    hf:NAME                   a transformers config class whose defaults are NAME ("hf:gpt2",
                              "hf:bert-base-uncased", or a model type such as "hf:llama")
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
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxflops import examples

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

# Transformers config docstrings say which checkpoint their defaults reproduce.
_DEFAULTS_OF = re.compile(r"similar configuration to that of the.*?\[([^\]]+)\]", re.S)


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


@dataclass(frozen=True)
class InputOptions:
    """What the command line says about the inputs."""

    batch: int = 1
    seq_len: int = 128
    input_shapes: tuple[tuple[int, ...], ...] = ()
    dtype: torch.dtype | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)  # config / constructor values
    hf_task: str = "auto"
    trust_remote_code: bool = False  # hf: may run the Python a config's auto_map names


# ------------------------------------------------------------------------------- small parsers


def parse_shape(text: str) -> tuple[int, ...]:
    """`1,3,224,224` (or `1x3x224x224`) -> (1, 3, 224, 224)."""
    parts = [part.strip() for part in re.split(r"[,x]", text.strip())]
    if not text.strip() or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ModelSpecError(
            f"bad input shape {text!r}: expected positive integers separated by commas, "
            "such as 1,3,224,224"
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
    """Apply --dtype to the model and its floating-point inputs."""
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
        raise ModelSpecError(
            f"unknown model {name!r}: not a built-in example (`fxflops examples` lists them); "
            "other forms: torchvision:NAME, hf:NAME, hf:path/config.json, file.py:factory, "
            "package.module:factory"
        ) from None
    try:
        with torch.device("meta"):
            model = example.build(**options.overrides)
    except TypeError as error:
        raise ModelSpecError(f"--set does not fit example {example.name}: {error}") from None
    if options.input_shapes:
        args = _tensors_from_shapes(options.input_shapes, torch.device("meta"), example.takes_tokens, options.dtype)
    else:
        args = example.inputs(batch=options.batch, seq_len=options.seq_len, device="meta")
    loaded = ModelInputs(model, args, {}, f"built-in example {example.name}")
    return _finish(loaded, options)


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
    shapes = options.input_shapes or (_torchvision_input_shape(torchvision, name, model, options.batch),)
    args = _tensors_from_shapes(shapes, torch.device("meta"), False, options.dtype)
    return _finish(ModelInputs(model, args, {}, f"torchvision {name}"), options)


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
        raise ModelSpecError("hf: models need the transformers package") from None
    if options.hf_task not in HF_TASKS:
        raise ModelSpecError(f"unknown --hf-task {options.hf_task!r}; use one of {', '.join(HF_TASKS)}")
    config = hf_config(name, options.trust_remote_code)
    for key, value in options.overrides.items():
        if not hasattr(config, key):
            raise ModelSpecError(f"--set {key}: {type(config).__name__} has no such field")
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
    if _custom_code(config) and not options.trust_remote_code:
        loaded.notes.append(f"hf:{name}'s config names its own model code (auto_map); it was not run, and "
                            f"transformers' {type(model).__name__} was built instead (--trust-remote-code runs it)")
    return _finish(loaded, options)


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
    """A transformers config: from a local file, a model type, or a checkpoint its class defaults to."""
    path = Path(name)
    if path.is_dir() and (path / "config.json").is_file():
        return _config_from_file(path / "config.json", trust_remote_code)
    if path.is_file():
        return _config_from_file(path, trust_remote_code)
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


def _defaults_checkpoint(model_type: str) -> str | None:
    """The checkpoint `model_type`'s config defaults reproduce, as its docstring names it."""
    from transformers import CONFIG_MAPPING

    try:
        config_class = CONFIG_MAPPING[model_type]
    except Exception:  # a config module that fails to import is simply not a candidate
        return None
    match = _DEFAULTS_OF.search(config_class.__doc__ or "")
    return match.group(1) if match else None


def _names_checkpoint(name: str, checkpoint: str | None) -> bool:
    if checkpoint is None:
        return False
    wanted = name.lower()
    return wanted in (checkpoint.lower(), checkpoint.lower().rsplit("/", 1)[-1])


def _candidate_types(name: str, model_types: list[str]) -> list[str]:
    """Model types the name starts with, longest first (`bert-base-uncased` -> `bert`)."""
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


def _source_mentions(model_type: str, name: str) -> bool:
    """Whether the config module's source names `name` (True when the file cannot be found).

    Reading ~500 small files takes milliseconds; importing them all takes seconds.
    """
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)
    path = Path(transformers.__file__).parent / "models" / module / f"configuration_{module}.py"
    try:
        return name.lower() in path.read_text(encoding="utf-8").lower()
    except OSError:
        return True


def _config_by_name(name: str) -> Any:
    from transformers import CONFIG_MAPPING

    model_types = _model_types()
    if name in model_types:
        return CONFIG_MAPPING[name]()
    candidates = _candidate_types(name, model_types)
    # Likely classes first, then any whose source mentions the name at all.
    others = [t for t in model_types if t not in candidates and _source_mentions(t, name)]
    for model_type in candidates + others:
        if _names_checkpoint(name, _defaults_checkpoint(model_type)):
            return CONFIG_MAPPING[model_type]()
    close = difflib.get_close_matches(name, model_types, n=3)
    guess = f"did you mean {' or '.join('hf:' + t for t in close)}? " if close else ""
    hint = (f"hf:{candidates[0]} (defaults: {_defaults_checkpoint(candidates[0])}) with --set"
            if candidates else "a model type such as hf:llama, hf:gpt2 or hf:bert")
    raise ModelSpecError(
        f"hf: no transformers config class defaults to {name!r} and it is not a model type; "
        f"{guess}use {hint}, or hf:path/to/config.json (nothing is downloaded)"
    )


def _hf_inputs(model: nn.Module, config: Any, options: InputOptions) -> tuple[tuple, dict]:
    """Keyword inputs named after the model's main input; token ids unless it takes pixels."""
    main = getattr(model, "main_input_name", "input_ids")
    device = torch.device("meta")
    if options.input_shapes:
        tokens = main == "input_ids"
        tensors = _tensors_from_shapes(options.input_shapes, device, tokens, options.dtype)
        kwargs = {main: tensors[0]}
        return tuple(tensors[1:]), kwargs
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
        produced = factory(**_factory_arguments(factory, options))
    model, inputs = (produced if isinstance(produced, tuple) and len(produced) == 2
                     and isinstance(produced[0], nn.Module) else (produced, None))
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{target}:{attribute} returned {type(model).__name__}, not a torch.nn.Module")
    made_up = None
    if options.input_shapes:
        device = _device_of(model)
        args, kwargs = _tensors_from_shapes(options.input_shapes, device, False, options.dtype), {}
        made_up = None if device.type == "meta" else ZERO_INPUTS
    elif inputs is None:
        raise ModelSpecError(f"{target}:{attribute} returned no inputs; give --input-shape")
    else:
        args, kwargs = _split_inputs(inputs)
    return _finish(ModelInputs(model, args, kwargs, f"{target}:{attribute}", made_up), options)


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
