"""The command line, end to end in a subprocess for every MODEL form and every error, plus the
report options in-process. Expected numbers are worked out by hand or taken from an independent
oracle (torch's FlopCounterMode, the model's own parameters)."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fxflops.cli import main as cli
from fxflops.cli import hf_specs, model_spec, options
from fxflops.cli.options import InputOptions, ModelSpecError
from tests.report_parsing import assert_shows, parse_aggregated, parse_detailed, parse_summary

LENET5_MACS_PER_SAMPLE = 6 * 28 * 28 * 25 + 16 * 10 * 10 * 6 * 25 + 120 * 16 * 25 + 120 * 84 + 84 * 10
LENET5_MODULES = 14

UNTRACEABLE = """
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: no graph can hold it
            return self.fc(x)
        return x


def build():
    with torch.device("meta"):
        return Branchy(), torch.zeros(2, 4, device="meta")
"""

MLP_FACTORY = """
import torch
from torch import nn


def build(batch=1):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, (torch.zeros(batch, 8),)
"""


def fxflops(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fxflops.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def assert_one_line_error(result: subprocess.CompletedProcess, code: int, words: str) -> None:
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fxflops: error: ") and words in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


# ------------------------------------------------------------------ each MODEL form, subprocess


def test_examples_are_listed():
    result = fxflops("examples")
    assert result.returncode == 0, result.stderr
    for name in ("lenet5", "gpt2-small", "bert-base"):
        assert f"  {name}" in result.stdout


def test_builtin_example_text_report():
    result = fxflops("lenet5", "--batch", "1024", "--top", "3")
    assert result.returncode == 0, result.stderr
    rows = parse_summary(result.stdout)
    assert_shows(rows["fwd MACs:"], 1024 * LENET5_MACS_PER_SAMPLE, "MACs")
    assert rows["input shapes:"] == "(1024, 1, 32, 32)"
    entries = parse_detailed(result.stdout)
    assert_shows(entries["feature_extractor.0"]["fields"][2], 1024 * 6 * 28 * 28 * 25, "MACs")
    assert list(parse_aggregated(result.stdout)[2]["MACs"]) == ["Conv2d", "Linear", "Tanh"]


def test_torchvision_model_json():
    import torchvision

    result = fxflops("torchvision:resnet18", "--input-shape", "1,3,64,64", "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    with torch.device("meta"):
        model = torchvision.models.resnet18()
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, 3, 64, 64, device="meta"))
    assert 2 * data["totals"]["macs"] == counter.get_total_flops()
    assert data["totals"]["params"] == sum(p.numel() for p in model.parameters())
    assert data["input_shapes"] == [[[1, 3, 64, 64]], {}]


def test_hf_name_from_config_defaults():
    from transformers import GPT2Config, GPT2LMHeadModel

    result = fxflops("hf:gpt2", "--set", "n_layer=1", "--seq-len", "8", "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=1))
    d, heads, seq, vocab = 768, 12, 8, 50257  # GPT2Config() defaults
    # the GPT-2 a user runs is the LM: the base model plus its (tied) head
    assert data["model_type"] == "GPT2LMHeadModel"
    assert data["totals"]["params"] == sum(p.numel() for p in model.parameters())
    # qkv (3 d^2) + proj (d^2) + MLP (8 d^2) per token, + SDPA B*H*S*S*(E+Ev), + the LM head
    assert data["totals"]["macs"] == seq * 12 * d * d + heads * seq * seq * 2 * (d // heads) + seq * d * vocab


def test_hf_task_base_builds_the_base_model():
    loaded = model_spec.load("hf:gpt2", InputOptions(seq_len=8, overrides={"n_layer": 1}, hf_task="base"))
    assert type(loaded.model).__name__ == "GPT2Model"


@pytest.mark.parametrize("name, expected", [
    ("llama", "LlamaForCausalLM"),  # decoder-only: the causal LM
    ("t5-small", "T5ForConditionalGeneration"),  # encoder-decoder: the seq2seq LM
    ("bert", "BertModel"),  # an encoder (it has a masked LM too): the base model
    ("bert-base-uncased", "BertForMaskedLM"),  # the class its published config.json names
])
def test_hf_builds_the_head_a_user_runs(name, expected):
    loaded = model_spec.load(f"hf:{name}", InputOptions(seq_len=4))
    assert type(loaded.model).__name__ == expected
    assert loaded.source == f"transformers {expected}"


def test_hf_encoder_decoder_is_never_its_decoder_alone():
    # whisper has a causal LM (its decoder) but no seq2seq-LM mapping: the whole model, not the decoder
    loaded = model_spec.load("hf:whisper", InputOptions(input_shapes=((1, 80, 3000),)))
    assert type(loaded.model).__name__ == "WhisperModel"


def test_hf_builds_the_class_config_architectures_names(tmp_path):
    values = dict(model_type="bert", vocab_size=100, hidden_size=32, num_hidden_layers=1,
                  num_attention_heads=2, intermediate_size=64, architectures=["BertForSequenceClassification"])
    (tmp_path / "config.json").write_text(json.dumps(values))
    loaded = model_spec.load(f"hf:{tmp_path}", InputOptions(seq_len=4))
    assert type(loaded.model).__name__ == "BertForSequenceClassification"


def test_hf_local_config_file(tmp_path):
    from transformers import BertConfig, BertModel

    values = dict(model_type="bert", vocab_size=100, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=16)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    result = fxflops(f"hf:{path}", "--batch", "2", "--seq-len", "8", "--format", "csv")
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    values.pop("model_type")
    with torch.device("meta"):
        model = BertModel(BertConfig(**values))
    assert [row["name"] for row in rows] == [name for name, _ in model.named_modules()]
    assert int(rows[0]["params"]) == sum(p.numel() for p in model.parameters())
    dense = {row["name"]: int(row["macs"]) for row in rows}
    assert dense["encoder.layer.0.intermediate.dense"] == 2 * 8 * 32 * 64


def test_file_factory(tmp_path):
    (tmp_path / "mlp.py").write_text(MLP_FACTORY)
    result = fxflops("mlp.py:build", "--batch", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    entries = parse_detailed(result.stdout)
    assert_shows(entries[""]["fields"][2], 3 * (8 * 16 + 16 * 4), "MACs")
    assert_shows(entries["0"]["fields"][0], 8 * 16 + 16)


def test_module_factory_with_input_shape():
    result = fxflops("fxflops.cli.examples:lenet5", "--input-shape", "2,1,32,32", "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["totals"]["macs"] == 2 * LENET5_MACS_PER_SAMPLE
    assert len(data["modules"]) == LENET5_MODULES


# ------------------------------------------------------------------------- errors, subprocess


def test_unknown_model_name():
    assert_one_line_error(fxflops("resnet-but-wrong"), 2, "unknown model 'resnet-but-wrong'")


def test_bad_shape_string():
    assert_one_line_error(fxflops("lenet5", "--input-shape", "1,x,32"), 2, "bad input shape '1,x,32'")


def test_untraceable_model(tmp_path):
    (tmp_path / "branchy.py").write_text(UNTRACEABLE)
    result = fxflops("branchy.py:build", cwd=tmp_path)
    assert_one_line_error(result, 1, "could not capture Branchy")


def test_debug_lets_the_exception_through(tmp_path):
    import fxflops as package

    (tmp_path / "branchy.py").write_text(UNTRACEABLE)
    with pytest.raises(package.CaptureError, match="every method failed"):
        cli.main([f"{tmp_path}/branchy.py:build", "--debug"])


# --------------------------------------------------------------------- options, in-process


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_formats_and_output_file(capsys, tmp_path):
    code, out, _ = run_main(capsys, "lenet5", "--format", "table", "--tablefmt", "plain")
    assert code == 0 and "Cost per module" in out and "|" not in out
    target = tmp_path / "lenet.json"
    code, out, err = run_main(capsys, "lenet5", "--batch", "4", "--format", "json", "--output", str(target))
    assert code == 0 and out == ""
    assert f"wrote the json report on LeNet5 to {target}" in err  # says what it wrote, where
    assert json.loads(target.read_text())["totals"]["macs"] == 4 * LENET5_MACS_PER_SAMPLE
    code, out, _ = run_main(capsys, "lenet5", "--format", "csv")
    assert code == 0 and len(out.strip().splitlines()) == 1 + LENET5_MODULES
    code, out, _ = run_main(capsys, "lenet5", "--format", "json", "--nodes")
    assert code == 0 and len(json.loads(out)["nodes"]) > 0


def test_depth_fold_and_detail_options(capsys):
    sizes = ["--set", "n_layer=3", "--set", "d_model=32", "--set", "n_head=4", "--set", "vocab_size=50"]
    code, folded, _ = run_main(capsys, "gpt2-small", "--seq-len", "8", *sizes)
    assert code == 0 and "h.0-2" in parse_detailed(folded)
    code, unfolded, _ = run_main(capsys, "gpt2-small", "--seq-len", "8", "--no-fold", *sizes)
    assert {"h.0", "h.1", "h.2"} <= set(parse_detailed(unfolded))
    code, shallow, _ = run_main(capsys, "gpt2-small", "--seq-len", "8", "--depth", "1", *sizes)
    assert max(entry["depth"] for entry in parse_detailed(shallow).values()) == 1
    code, brief, _ = run_main(capsys, "gpt2-small", "--seq-len", "8", "--no-detailed", *sizes)
    assert "Detailed Profile" not in brief


def test_conventions_and_dtype(capsys):
    code, out, _ = run_main(capsys, "lenet5", "--conventions", "torch", "--dtype", "bfloat16", "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["conventions"] == "torch"
    assert data["totals"]["macs"] == LENET5_MACS_PER_SAMPLE
    code, out, _ = run_main(capsys, "lenet5", "--method", "symbolic", "--format", "json")
    assert code == 0 and json.loads(out)["method"] == "symbolic"
    assert json.loads(out)["totals"]["macs"] == LENET5_MACS_PER_SAMPLE


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["torchvision:resnet5O"], "did you mean"),
        (["lenet5", "--dtype", "float8"], "unknown dtype"),
        (["lenet5", "--set", "oops"], "bad --set"),
        (["lenet5", "--set", "depth=3"], "--set does not fit example lenet5"),
        (["hf:no/such/config.json"], "not found"),
        (["hf:facebook/opt-2.7b"], "neither a checkpoint fxflops knows"),
        (["nowhere_module_xyz:build"], "cannot import"),
        (["lenet5", "--batch", "0"], "must be positive"),
    ],
)
def test_usage_errors_exit_2(capsys, args, words):
    code, out, err = run_main(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("fxflops: error: ") and words in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------- MODEL resolution details


def test_torchvision_default_input_size():
    loaded = model_spec.load("torchvision:inception_v3", InputOptions(batch=2))
    assert loaded.args[0].shape == (2, 3, 299, 299) and loaded.args[0].device.type == "meta"
    assert model_spec.load("torchvision:r3d_18").args[0].shape == (1, 3, 16, 112, 112)


def test_hf_names_resolve_to_config_defaults():
    assert type(hf_specs.hf_config("gpt2")).__name__ == "GPT2Config"
    assert type(hf_specs.hf_config("bert-base-uncased")).__name__ == "BertConfig"
    assert type(hf_specs.hf_config("openai-community/gpt2")).__name__ == "GPT2Config"
    assert hf_specs.hf_config("bert-base-uncased").hidden_size == 768


def test_hf_inputs_follow_the_model():
    loaded = model_spec.load("hf:t5-small", InputOptions(batch=2, seq_len=4, overrides={"num_layers": 1}))
    assert set(loaded.kwargs) == {"input_ids", "decoder_input_ids"}
    assert loaded.kwargs["input_ids"].shape == (2, 4)


def test_parse_helpers():
    assert options.parse_shape("1,3,224,224") == (1, 3, 224, 224)
    assert options.parse_shape("8x128") == (8, 128)
    for bad in ("", "1,,2", "1,-3", "a"):
        with pytest.raises(ModelSpecError):
            options.parse_shape(bad)
    assert options.parse_override("n_layer=2") == ("n_layer", 2)
    assert options.parse_override("act=gelu") == ("act", "gelu")
    assert options.parse_dtype("bf16") is torch.bfloat16


def test_factory_inputs_forms(tmp_path):
    (tmp_path / "forms.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def only_model():
            return nn.Linear(2, 2)

        def with_kwargs(seq_len):
            return nn.Linear(seq_len, 2), {"input": torch.zeros(1, seq_len)}

        def not_a_model():
            return 42
    """))
    loaded = model_spec.load(f"{tmp_path}/forms.py:with_kwargs", InputOptions(seq_len=5))
    assert loaded.kwargs["input"].shape == (1, 5) and loaded.args == ()
    with pytest.raises(ModelSpecError, match="returned no inputs"):
        model_spec.load(f"{tmp_path}/forms.py:only_model")
    shaped = model_spec.load(f"{tmp_path}/forms.py:only_model", InputOptions(input_shapes=((3, 2),)))
    assert shaped.args[0].shape == (3, 2)
    with pytest.raises(ModelSpecError, match="not a torch.nn.Module"):
        model_spec.load(f"{tmp_path}/forms.py:not_a_model")
    with pytest.raises(ModelSpecError, match="has no callable"):
        model_spec.load(f"{tmp_path}/forms.py:missing")


def test_capture_error_shows_the_decisive_reason(capsys):
    # LeNet5 takes 1 channel: eager's shape error is the reason, not "every method failed"
    code, _, err = run_main(capsys, "lenet5", "--input-shape", "1,3,32,32")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "could not capture LeNet5: eager:" in err and "to have 1 channels" in err
    assert "in module 'feature_extractor.0'" in err and "trace skipped" in err


def test_an_error_ending_in_a_colon_keeps_its_detail(capsys):
    code, _, err = run_main(capsys, "hf:llama", "--set", "num_hidden_layers=two")
    assert code != 0 and len(err.strip().splitlines()) == 1
    assert "num_hidden_layers" in err and "two" in err and not err.strip().endswith(":")


def test_a_misspelt_hf_model_gets_a_suggestion(capsys):
    code, _, err = run_main(capsys, "hf:lama")
    assert code == 2 and "did you mean hf:llama" in err and "use or" not in err


def test_an_import_failing_inside_the_model_file_names_the_file_and_line(capsys, tmp_path):
    model_file = tmp_path / "mine.py"
    model_file.write_text("import torch\nimport not_a_module_anyone_has\n\ndef build():\n    return torch.nn.Linear(2, 2)\n")
    code, _, err = run_main(capsys, f"{model_file}:build")
    assert code == 2 and f"{model_file}:2" in err and "not_a_module_anyone_has" in err
    assert "model file" in err


def test_a_set_value_the_factory_does_not_take_is_an_error(capsys, tmp_path):
    model_file = tmp_path / "sized.py"
    model_file.write_text("import torch\n\ndef build(width=4):\n    return torch.nn.Linear(width, 2), (torch.randn(1, width),)\n")
    code, out, _ = run_main(capsys, f"{model_file}:build", "--set", "width=3")
    assert code == 0 and "in_features=3" in out  # the value reached the factory
    code, _, err = run_main(capsys, f"{model_file}:build", "--set", "widht=3")
    assert code == 2 and "widht" in err and "did you mean 'width'" in err


VALUE_DEPENDENT = """
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # all-zero inputs take this branch's other side
            return self.b(self.a(x))
        return self.a(x)


def build():
    return Gate()
"""


def test_a_count_that_ran_the_model_on_made_up_inputs_says_so(capsys, tmp_path):
    model_file = tmp_path / "gate.py"
    model_file.write_text(VALUE_DEPENDENT)
    code, out, err = run_main(capsys, f"{model_file}:build", "--input-shape", "2,8", "--format", "json")
    assert code == 0
    data = json.loads(out)
    assert data["method"] == "trace" and data["totals"]["macs"] == 2 * 8 * 8  # self.a only: zeros sum to 0
    assert data["input_values"] == "all-zero inputs made from --input-shape"
    assert "warning" in err and "all-zero inputs made from --input-shape" in err and "(model, inputs)" in err
    code, out, _ = run_main(capsys, f"{model_file}:build", "--input-shape", "2,8", "--no-detailed")
    assert "the model ran once, on all-zero inputs made from --input-shape" in out
    assert "static, nothing run" not in out and "on its real inputs" not in out
    # asked for by name, trace says it ran, not that the model needed it
    code, _, err = run_main(capsys, f"{model_file}:build", "--input-shape", "2,8", "--method", "trace")
    assert code == 0 and "was counted by running it (trace)" in err and "could only" not in err


def test_static_counts_on_shapes_give_no_warning(capsys):
    code, out, err = run_main(capsys, "lenet5", "--input-shape", "1,1,32,32", "--no-detailed")
    assert code == 0 and err == "" and "static, nothing run" in out


def test_input_shape_on_real_weights_names_the_inputs_not_the_device(tmp_path):
    import importlib.util

    import fxflops

    model_file = tmp_path / "gate_api.py"
    model_file.write_text(VALUE_DEPENDENT)
    spec = importlib.util.spec_from_file_location("gate_api", model_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(fxflops.CaptureError) as caught:
        fxflops.estimate(module.build(), input_shape=(2, 8))
    message = str(caught.value)
    assert "inputs are given as shapes (input_shape=)" in message
    assert "weights are on the meta device" not in message


def _custom_code_folder(folder, marker, model_type="tinything"):
    """A model folder whose config.json points auto_map at its own Python, which leaves `marker` when run."""
    (folder / "configuration_tiny.py").write_text(textwrap.dedent(f"""
        import pathlib
        from transformers import PretrainedConfig
        pathlib.Path({str(marker)!r}).write_text("ran")

        class TinyConfig(PretrainedConfig):
            model_type = "tinything"

            def __init__(self, width=4, **kwargs):
                self.width = width
                super().__init__(**kwargs)
    """))
    (folder / "modeling_tiny.py").write_text(textwrap.dedent("""
        import torch
        from transformers import PreTrainedModel
        from .configuration_tiny import TinyConfig

        class TinyModel(PreTrainedModel):
            config_class = TinyConfig
            main_input_name = "x"

            def __init__(self, config):
                super().__init__(config)
                self.fc = torch.nn.Linear(config.width, config.width)

            def forward(self, x):
                return self.fc(x)
    """))
    config = dict(model_type=model_type, width=4, architectures=["TinyModel"],
                  auto_map={"AutoConfig": "configuration_tiny.TinyConfig", "AutoModel": "modeling_tiny.TinyModel"})
    (folder / "config.json").write_text(json.dumps(config))


def test_hf_never_runs_a_folders_code_unless_trusted(capsys, tmp_path):
    marker = tmp_path / "ran.txt"
    _custom_code_folder(tmp_path, marker)
    code, out, err = run_main(capsys, f"hf:{tmp_path}", "--input-shape", "2,4")
    assert code == 2 and "--trust-remote-code" in err and "configuration_tiny.TinyConfig" in err
    assert not marker.exists() and out == ""
    code, out, err = run_main(capsys, f"hf:{tmp_path}", "--input-shape", "2,4", "--trust-remote-code",
                              "--format", "json")
    assert code == 0, err
    assert marker.exists()
    data = json.loads(out)
    assert data["model_type"] == "TinyModel" and data["totals"]["macs"] == 2 * 4 * 4


def test_hf_known_type_with_custom_code_builds_transformers_own_class(tmp_path):
    marker = tmp_path / "ran.txt"
    _custom_code_folder(tmp_path, marker, model_type="gpt2")
    loaded = model_spec.load(f"hf:{tmp_path}", InputOptions(seq_len=4, overrides={"n_layer": 1}))
    assert not marker.exists()
    assert type(loaded.model).__name__ == "GPT2LMHeadModel"
    assert len(loaded.notes) == 1 and "--trust-remote-code" in loaded.notes[0]


def test_hf_skipped_folder_code_is_a_note_on_the_cli(capsys, tmp_path):
    marker = tmp_path / "ran.txt"
    _custom_code_folder(tmp_path, marker, model_type="gpt2")
    code, _, err = run_main(capsys, f"hf:{tmp_path}", "--set", "n_layer=1", "--seq-len", "4", "--no-detailed")
    assert code == 0 and "fxflops: note:" in err and "GPT2LMHeadModel was built instead" in err
    assert not marker.exists()
    # a tokenizer's code alone is not the model's: no note
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_tiny.TinyTokenizer", None]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_spec.load(f"hf:{tmp_path}", InputOptions(seq_len=4, overrides={"n_layer": 1})).notes == []


def test_hf_trusted_known_type_runs_its_folder_code(capsys, tmp_path):
    marker = tmp_path / "ran.txt"
    _custom_code_folder(tmp_path, marker, model_type="gpt2")
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_tiny.TinyModel"}  # the config class is transformers' GPT2Config
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "modeling_tiny.py").write_text((tmp_path / "modeling_tiny.py").read_text().replace(
        "from .configuration_tiny import TinyConfig", "from transformers import GPT2Config as TinyConfig").replace(
        "config.width, config.width", "4, 4"))
    code, out, err = run_main(capsys, f"hf:{tmp_path}", "--input-shape", "2,4", "--trust-remote-code",
                              "--format", "json")
    assert code == 0, err
    assert json.loads(out)["model_type"] == "TinyModel"


def test_hf_trusted_code_elsewhere_or_outside_config_json_is_refused(capsys, tmp_path):
    marker = tmp_path / "ran.txt"
    _custom_code_folder(tmp_path, marker)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "other.json").write_text(json.dumps(config))
    code, _, err = run_main(capsys, f"hf:{tmp_path / 'other.json'}", "--trust-remote-code")
    assert code == 2 and f"hf:{tmp_path}" in err and not marker.exists()
    config["auto_map"]["AutoModel"] = "someone/repo--modeling_tiny.TinyModel"
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = run_main(capsys, f"hf:{tmp_path}", "--trust-remote-code")
    assert code == 2 and "another repository" in err and not marker.exists()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "weird", "auto_map": ["x"]}))
    code, _, err = run_main(capsys, f"hf:{tmp_path}")
    assert code == 2 and "auto_map" in err


def test_torchvision_never_downloads(monkeypatch):
    from torchvision.models._api import WeightsEnum

    def download(self, *args, **kwargs):
        raise AssertionError(f"tried to download {self.url}")

    monkeypatch.setattr(WeightsEnum, "get_state_dict", download)
    loaded = model_spec.load("torchvision:fasterrcnn_mobilenet_v3_large_320_fpn")
    assert type(loaded.model).__name__ == "FasterRCNN"
    with pytest.raises(ModelSpecError, match="never downloads"):
        model_spec.load("torchvision:resnet18", InputOptions(overrides={"weights": "DEFAULT"}))
    loaded = model_spec.load("torchvision:googlenet", InputOptions(overrides={"init_weights": False}))
    assert type(loaded.model).__name__ == "GoogLeNet"  # init_weights is not a download


def test_a_sequence_longer_than_the_positions_is_a_caution(capsys):
    code, out, err = run_main(capsys, "gpt2-small", "--seq-len", "4096", "--format", "json")
    assert code == 0
    (caution,) = json.loads(out)["cautions"]
    assert "'wpe'" in caution and "rows 0..4095 of a table of 1024 rows" in caution
    assert err.strip() == f"fxflops: warning: {caution}"
    code, out, err = run_main(capsys, "gpt2-small", "--seq-len", "1024", "--format", "json")
    assert json.loads(out)["cautions"] == [] and err == ""


def test_a_caution_names_the_hf_position_table():
    import fxflops

    loaded = model_spec.load("hf:gpt2", InputOptions(seq_len=1025, overrides={"n_layer": 1}))
    with pytest.warns(fxflops.CautionWarning, match=r"'transformer.wpe' .*rows 0\.\.1024 of a table of 1024 rows"):
        result = fxflops.estimate(loaded.model, loaded.args, loaded.kwargs)
    assert len(result.cautions) == 1


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_each_stage_on_a_terminal(monkeypatch, capsys, tmp_path):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["lenet5", "--no-detailed"]) == 0
    shown = terminal.getvalue()
    stages = ["loading lenet5", "capturing the forward", "counting every op", "writing the report"]
    assert all(f"fxflops: {stage}..." in shown for stage in stages), shown
    assert [shown.index(stage) for stage in stages] == sorted(shown.index(stage) for stage in stages)
    assert shown.endswith("\r\033[K")  # the line is cleared: the report is not interleaved with it
    assert "Estimate Summary" in capsys.readouterr().out

    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    target = tmp_path / "lenet.json"
    assert cli.main(["lenet5", "--quiet", "--format", "json", "--output", str(target)]) == 0
    assert quiet.getvalue() == "" and target.exists()


def test_progress_line_is_cleared_before_an_error(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["lenet5", "--input-shape", "1,3,32,32"]) == 1
    shown = terminal.getvalue()
    assert "\r\033[Kfxflops: error: could not capture LeNet5" in shown


def test_rules_option_counts_with_the_users_rule_file(capsys, tmp_path):
    rules = tmp_path / "mine.toml"
    rules.write_text('[[rule]]\nname = "my_linear"\nops = ["aten.linear", "aten.lineer"]\n'
                     'macs = "numel(out) * weight.shape[1]"\nflops = "3 * macs"\n')
    code, out, err = run_main(capsys, "lenet5", "--rules", str(rules), "--format", "json", "-q")
    assert code == 0
    modules = {module["name"]: module for module in json.loads(out)["modules"]}
    # LeNet5's first classifier layer, Linear(120, 84) on one image: 120 x 84 MACs, three FLOPs each by the rule
    assert (modules["classifier.0"]["macs"], modules["classifier.0"]["flops"]) == (120 * 84, 3 * 120 * 84)
    assert "op 'aten.lineer' (did you mean 'aten.linear'?) names nothing" in err  # shown despite the quiet CLI


def test_rules_option_refuses_a_bad_file_before_building_the_model(capsys, tmp_path):
    rules = tmp_path / "bad.toml"
    rules.write_text('[[rule]]\nname = "x"\nops = ["aten.linear"]\nmacs = "numel(outt)"\nflops = "macs"\n')
    code, _, err = run_main(capsys, "lenet5", "--rules", str(rules))
    assert code == 2
    assert f"{rules}: rule 'x': 'macs'" in err and "did you mean 'out'?" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["lenet5", "--format", "xml"], "argument --format: invalid choice: 'xml'"),
    (["lenet5", "--top", "-1"], "argument --top: must be 1 or more, got -1"),
    (["lenet5", "--depth", "-5"], "argument --depth: must be -1 or more, got -5"),
    (["lenet5", "--device", "A100"], "--device 'A100' could be any of A100 80GB PCIe, A100 80GB SXM, A100 40GB"),
])
def test_argument_mistakes_cost_one_line(capsys, argv, message):
    try:
        code = cli.main(argv)
    except SystemExit as exited:  # argparse's own checks exit from parse_args
        code = exited.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_argument_mistakes_exit_2_before_estimating(capsys, tmp_path):
    code, out, err = run_main(capsys, "lenet5", "--output", str(tmp_path / "missing" / "report.txt"))
    assert code == 2 and out == "" and "the folder" in err and "does not exist" in err
    code, out, err = run_main(capsys, "lenet5", "--output", str(tmp_path))
    assert code == 2 and "is a folder" in err


# ------------------------------------------------------- input shapes: ranks, names, --seq-len (issue 21)

KEYWORD_ONLY = """
import torch
from torch import nn


class KeywordOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, *, input_ids, scale=None):
        return self.fc(self.embed(input_ids))


def build():
    return KeywordOnly()
"""


@pytest.mark.parametrize("args", [
    ["hf:gpt2", "--input-shape", "1,3,224,224"],  # counted 19.22 TMACs for a 4-d input_ids before
    ["hf:gpt2", "--input-shape", "input_ids=16"],
    ["gpt2-small", "--input-shape", "1,3,224,224"],
])
def test_token_ids_of_the_wrong_rank_are_refused(capsys, args):
    code, out, err = run_main(capsys, *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "input_ids of shape (batch, seq)" in err


@pytest.mark.parametrize("args, words", [
    (["torchvision:resnet18", "--seq-len", "64"], "takes images, not token sequences"),
    (["lenet5", "--seq-len", "64"], "takes images, not token sequences"),
    (["hf:gpt2", "--input-shape", "1,16", "--seq-len", "64"], "give one of the two"),
])
def test_seq_len_that_would_be_ignored_is_refused(capsys, args, words):
    code, _, err = run_main(capsys, *args)
    assert code == 2 and err.startswith("fxflops: error: --seq-len: ") and words in err


def test_named_input_shapes_feed_keyword_inputs(capsys, tmp_path):
    (tmp_path / "kw.py").write_text(KEYWORD_ONLY)
    code, out, err = run_main(capsys, f"{tmp_path}/kw.py:build", "--input-shape", "input_ids=2,16", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert data["input_shapes"] == [[], {"input_ids": [2, 16]}]
    assert data["totals"]["macs"] == 2 * 16 * 8 * 4  # the Linear on every token; the lookup is free
    # a positional shape for a keyword-only input: the error says how to name it, before any capture
    code, _, err = run_main(capsys, f"{tmp_path}/kw.py:build", "--input-shape", "2,16")
    assert code == 2 and "--input-shape input_ids=2,16" in err and "KeywordOnly.forward takes (input_ids, scale)" in err
    code, _, err = run_main(capsys, f"{tmp_path}/kw.py:build", "--input-shape", "input_idz=2,16")
    assert code == 2 and "did you mean input_ids=...?" in err


def test_named_input_shapes_of_an_hf_model():
    loaded = model_spec.load("hf:gpt2", InputOptions(named_shapes=(("input_ids", (2, 16)), ("attention_mask", (2, 16))),
                                                    overrides={"n_layer": 1}))
    assert {name: (tuple(t.shape), t.dtype) for name, t in loaded.kwargs.items()} == {
        "input_ids": ((2, 16), torch.long), "attention_mask": ((2, 16), torch.long)}
    assert options.parse_input_shape("input_ids=2x16") == ("input_ids", (2, 16))
    assert options.parse_input_shape("2,16") == (None, (2, 16))


def test_step_time_prints_the_steps_flops_and_mfu_against_the_device_peak(capsys, tmp_path):
    from fxflops.cli.main import main

    factory = tmp_path / "one_linear.py"
    factory.write_text("import torch\ndef build():\n    return torch.nn.Linear(16, 8, bias=False)\n")
    code = main([f"{factory}:build", "--input-shape", "4,16", "--step-time", "0.5", "--device", "H100 SXM",
                 "--dtype", "bf16", "-q"])
    out = capsys.readouterr().out
    assert code == 0, out
    # forward 4x16x8 MACs; backward only the weight's gradient (the input needs none): as many again
    flops = 2 * (2 * 4 * 16 * 8)
    assert f"step FLOPs      {flops / 1e3:.2f} kFLOPs" in out
    assert f"achieved        {flops / 0.5 / 1e12:.2f} TFLOP/s" in out
    assert f"MFU             {flops / 0.5 / 989.4e12:.2%} of 989.40 TFLOP/s (H100 SXM bf16 dense" in out
    assert "samples/s       8.00" in out


def test_step_time_must_be_positive_and_alone(capsys):
    from fxflops.cli.main import main

    assert main(["lenet5", "--step-time", "0"]) == 2
    assert "--step-time is a step's seconds, more than 0; got 0" in capsys.readouterr().err
    assert main(["lenet5", "--step-time", "1", "--format", "json"]) == 2
    assert "does not combine with" in capsys.readouterr().err
