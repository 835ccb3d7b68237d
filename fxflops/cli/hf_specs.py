"""hf: MODEL specs: a transformers model built on the meta device from a config, never downloading.

The config comes from a local config.json (or a folder holding one), from a checkpoint whose
published config fxflops knows (`fxflops/cli/checkpoints.toml`, names and Hub aliases), or from a
model type's class defaults (flagged, so the report says so). `--set` changes its fields,
`--hf-task` picks the auto class (default: the class config.architectures names), and a config's own
code (auto_map) runs only with `--trust-remote-code`. The inputs are named after the model's main
input: token ids, or pixels at the config's image size.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxflops.cli.inputs import check_token_ranks, finish_inputs, named_tensors, refuse_seq_len, tensors_from_shapes
from fxflops.cli.options import InputOptions, ModelInputs, ModelSpecError


HF_TASKS = {
    "auto": "",  # the class config.architectures names, else the head a user runs (see _hf_builder)
    "base": "AutoModel",
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "image-classification": "AutoModelForImageClassification",
}


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
        with torch.device(options.device):
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
    return finish_inputs(loaded, options)


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


def hf_model_types() -> list[str]:
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


def checkpoint_names() -> list[str]:
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
    model_types = hf_model_types()
    if name in model_types:
        return CONFIG_MAPPING[name](), True
    raise ModelSpecError(_unknown_hf_name(name, model_types))


def _unknown_hf_name(name: str, model_types: list[str]) -> str:
    checkpoints = {checkpoint.lower(): checkpoint for checkpoint in checkpoint_names()}
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
    device = torch.device(options.device)
    if options.input_shapes or options.named_shapes:
        refuse_seq_len(options, "--input-shape gives the input sizes already; give one of the two")
        given = dict(options.named_shapes)
        if options.input_shapes:
            given = {main: options.input_shapes[0], **given}
        check_token_ranks(type(model).__name__, given)
        tensors = tensors_from_shapes(options.input_shapes, device, main == "input_ids", options.dtype,
                                      options.input_dtype)
        kwargs = {main: tensors[0]} if tensors else {}
        return tuple(tensors[1:]), {**kwargs, **named_tensors(options, device)}
    if main != "input_ids":
        refuse_seq_len(options, f"{type(model).__name__} takes {main}, not token sequences; give its shape "
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
