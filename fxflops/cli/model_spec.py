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

This module only dispatches on the form: `hf_specs` builds hf: models, `factories` the forms that
name Python (files, modules, torchvision, examples), `inputs` makes their example inputs from sizes,
and `options` holds the records and the parsers of the command line's small strings.
"""

from __future__ import annotations

from fxflops.cli.factories import load_example, load_factory, load_torchvision
from fxflops.cli.hf_specs import load_huggingface
from fxflops.cli.options import InputOptions, ModelInputs


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
