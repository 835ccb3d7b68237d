"""The MODEL specs that name Python: FILE.py:FACTORY, package.module:FACTORY, torchvision:NAME, examples.

A factory is imported (a file as its own module) and called with whichever of `batch`, `seq_len`,
`dtype` and `--set` values its signature names; it returns a model, or (model, inputs). A
SystemExit or a CUDA-only model in the user's code becomes one line naming that code. torchvision
models are built on the meta device with every weights argument None (nothing is downloaded), fed an
image at the size their weights' metadata names; a built-in example brings its own inputs, and an
unknown NAME gets the other forms it most likely meant.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxflops.cli import examples
from fxflops.cli.hf_specs import checkpoint_names, hf_model_types
from fxflops.cli.inputs import (
    check_token_ranks,
    _device_of,
    finish_inputs,
    named_tensors,
    refuse_seq_len,
    tensors_from_shapes,
)
from fxflops.cli.options import InputOptions, ModelInputs, ModelSpecError


ZERO_INPUTS = "all-zero inputs made from --input-shape"


# ------------------------------------------------------------------------------------ factories


def load_factory(target: str, attribute: str, options: InputOptions) -> ModelInputs:
    """FILE.py:FACTORY or package.module:FACTORY."""
    module = _import_target(target)
    factory = getattr(module, attribute, None)
    if factory is None or not callable(factory):
        raise ModelSpecError(f"{target} has no callable {attribute!r}")
    with _no_exit(f"the factory {target}:{attribute}"):
        produced = _call_factory_guarded(factory, f"{target}:{attribute}", _factory_arguments(factory, options))
    model, inputs = (produced if isinstance(produced, tuple) and len(produced) == 2
                     and isinstance(produced[0], nn.Module) else (produced, None))
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{target}:{attribute} returned {type(model).__name__}, not a torch.nn.Module")
    real_inputs = None
    if options.input_shapes or options.named_shapes:
        # shapes become meta tensors, as input_shape= makes them: nothing is allocated for a count. Only a
        # run (method trace) needs values: then all-zero tensors on the model's device, made when it runs
        meta = torch.device("meta")
        args = tensors_from_shapes(options.input_shapes, meta, False, options.dtype, options.input_dtype)
        kwargs = named_tensors(options, meta)
        device = _device_of(model)
        if device.type != "meta":
            def real_inputs() -> tuple[tuple, dict]:
                return (tensors_from_shapes(options.input_shapes, device, False, options.dtype, options.input_dtype),
                        named_tensors(options, device))
    elif inputs is None:
        raise ModelSpecError(f"{target}:{attribute} returned no inputs; give --input-shape")
    else:
        args, kwargs = _split_inputs(inputs)
    loaded = finish_inputs(ModelInputs(model, args, kwargs, f"{target}:{attribute}"), options)
    loaded.real_inputs = real_inputs
    return loaded


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


class FactoryError(RuntimeError):
    """The user's factory raised: one line with the exception's type, message and the user's line."""


def _call_factory_guarded(factory: Any, name: str, arguments: dict[str, Any]) -> Any:
    try:
        return _call_factory(factory, name, arguments)
    except (ModelSpecError, FactoryError):
        raise
    except Exception as error:  # the user's code: its type and line, not only str(error) ('no such layer')
        raise FactoryError(_raised_in(name, error)) from error


def _raised_in(name: str, error: BaseException) -> str:
    """'the factory f.py:build raised KeyError: 'x' (at f.py:3: raise KeyError("x"))': the innermost frame
    outside torch and fxflops, where the user's code raised or called what did."""
    libraries = (str(Path(torch.__file__).parent), str(Path(__file__).resolve().parent.parent))
    frames = traceback.extract_tb(error.__traceback__)
    own = [frame for frame in frames if not frame.filename.startswith(libraries)] or frames[-1:]
    where = f" (at {own[-1].filename}:{own[-1].lineno}: {(own[-1].line or '').strip()})" if own else ""
    message = str(error).strip().splitlines()
    return f"the factory {name} raised {type(error).__name__}" + (f": {message[0]}" if message else "") + where


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
        refuse_seq_len(options, f"{getattr(factory, '__name__', 'the factory')}() takes no seq_len argument; "
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
        with torch.device(options.device):
            model = example.build(**options.overrides)
    except TypeError as error:
        raise ModelSpecError(f"--set does not fit example {example.name}: {error}") from None
    if not example.takes_tokens:
        refuse_seq_len(options, f"{example.name} takes images, not token sequences; give the input size with "
                                 "--input-shape, e.g. 1,1,32,32")
    elif options.input_shapes or options.named_shapes:
        refuse_seq_len(options, "--input-shape gives the sequence length already; give one of the two")
    if options.input_shapes and example.takes_tokens:
        check_token_ranks(example.name, {"input_ids": options.input_shapes[0]})
    if options.input_shapes or options.named_shapes:
        args = tensors_from_shapes(options.input_shapes, torch.device(options.device), example.takes_tokens,
                                   options.dtype, options.input_dtype)
    else:
        args = example.inputs(batch=options.batch, seq_len=options.seq_len, device=options.device)
    loaded = ModelInputs(model, args, named_tensors(options, torch.device(options.device)),
                         f"built-in example {example.name}")
    return finish_inputs(loaded, options)


def _other_forms_of(name: str) -> list[str]:
    """What a bare NAME most likely meant: hf:gpt2, torchvision:resnet50, or a built-in example close to it."""
    found = []
    lowered = name.lower()
    if lowered in (checkpoint.lower() for checkpoint in checkpoint_names()):
        found.append(f"hf:{name}")
    elif importlib.util.find_spec("transformers") is not None and lowered in hf_model_types():
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
    with torch.device(options.device):
        model = torchvision.models.get_model(name, **_no_weights(torchvision, name, options.overrides))
    model.eval()
    refuse_seq_len(options, f"torchvision {name} takes images, not token sequences; give the image size with "
                             "--input-shape, e.g. 1,3,224,224 (or --sweep size=...)")
    shapes = options.input_shapes
    if not shapes and not options.named_shapes:
        shapes = (_torchvision_input_shape(torchvision, name, model, options.batch),)
    device = torch.device(options.device)
    return finish_inputs(ModelInputs(model, tensors_from_shapes(shapes, device, False, options.dtype,
                                                                options.input_dtype),
                                     named_tensors(options, device), f"torchvision {name}"), options)


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
