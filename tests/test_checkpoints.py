"""hf:NAME builds a checkpoint from its published config (fxflops/cli/checkpoints.toml), never from a config
class's defaults passed off as it: every entry's parameter count equals the count published for the
checkpoint and a count by hand from its fields; anything else is refused with the ways forward, and
a model type built from its class's defaults says so in the report."""

from __future__ import annotations

import json

import pytest

from fxflops.cli import main as cli
from fxflops.cli import hf_specs, model_spec
from fxflops.cli.options import InputOptions, ModelSpecError

pytest.importorskip("transformers")

# Parameter counts published for these checkpoints (model cards, papers, the Hub's safetensors totals).
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "facebook/opt-125m": 125_239_296,
    "facebook/opt-350m": 331_196_416,
    "facebook/opt-1.3b": 1_315_758_080,
    "bert-base-uncased": 109_514_298,  # BertForMaskedLM: BertModel's 109,482,240 less the pooler, plus the MLM head
    "bert-large-uncased": 335_174_458,
    "t5-small": 60_506_624,
    "t5-base": 222_903_552,
    "meta-llama/Llama-2-7b-hf": 6_738_415_616,
    "meta-llama/Llama-2-13b-hf": 13_015_864_320,
    "meta-llama/Llama-2-70b-hf": 68_976_648_192,
    "Qwen/Qwen2-7B": 7_615_616_512,
    "mistralai/Mistral-7B-v0.1": 7_241_732_096,
}


def gpt2_params(c: dict) -> int:
    d = c["n_embd"]  # per layer: ln 2d, qkv 3d^2+3d, proj d^2+d, ln 2d, fc 4d^2+4d, proj 4d^2+d; head tied
    return c["vocab_size"] * d + c["n_positions"] * d + c["n_layer"] * (12 * d * d + 13 * d) + 2 * d


def opt_params(c: dict) -> int:
    d, e, f = c["hidden_size"], c["word_embed_proj_dim"], c["ffn_dim"]
    layer = 4 * (d * d + d) + 4 * d + (d * f + f) + (f * d + d)  # attention, two norms, fc1, fc2
    projections = 2 * e * d if e != d else 0  # project_in / project_out, no bias
    final_norm = 2 * d if c["do_layer_norm_before"] else 0
    positions = (c["max_position_embeddings"] + 2) * d  # OPT's learned positions are offset by 2
    return c["vocab_size"] * e + positions + projections + c["num_hidden_layers"] * layer + final_norm


def bert_mlm_params(c: dict) -> int:
    d, inner = c["hidden_size"], c["intermediate_size"]
    embeddings = (c["vocab_size"] + c["max_position_embeddings"] + c["type_vocab_size"]) * d + 2 * d
    layer = 4 * (d * d + d) + 2 * d + (d * inner + inner) + (inner * d + d) + 2 * d
    head = d * d + d + 2 * d + c["vocab_size"]  # transform + norm + decoder bias (its weight is tied)
    return embeddings + c["num_hidden_layers"] * layer + head


def t5_params(c: dict) -> int:
    d, inner, ff = c["d_model"], c["num_heads"] * c["d_kv"], c["d_ff"]
    attention = 4 * d * inner  # q, k, v, o without bias
    relative = c["relative_attention_num_buckets"] * c["num_heads"]  # in each stack's first layer
    encoder = c["num_layers"] * (attention + 2 * d * ff + 2 * d) + relative + d
    decoder = c["num_layers"] * (2 * attention + 2 * d * ff + 3 * d) + relative + d
    return c["vocab_size"] * d + encoder + decoder  # the LM head is tied to the shared embedding


def llama_params(c: dict, qkv_bias: bool = False) -> int:
    d, inner, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = d // heads
    attention = d * heads * head_dim + 2 * d * kv * head_dim + heads * head_dim * d
    attention += (heads + 2 * kv) * head_dim if qkv_bias else 0
    layer = attention + 3 * d * inner + 2 * d  # gate, up, down; two RMS norms
    embeddings = c["vocab_size"] * d * (1 if c.get("tie_word_embeddings", True) else 2)
    return embeddings + c["num_hidden_layers"] * layer + d


BY_HAND = {"gpt2": gpt2_params, "opt": opt_params, "bert": bert_mlm_params, "t5": t5_params,
           "llama": llama_params, "mistral": llama_params, "qwen2": lambda c: llama_params(c, qkv_bias=True)}


def test_every_known_checkpoint_has_a_published_count():
    assert set(hf_specs.known_checkpoints()) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_known_checkpoint_builds_its_published_size(name):
    fields = hf_specs.known_checkpoints()[name]
    loaded = model_spec.load(f"hf:{name}", InputOptions(seq_len=4))
    params = sum(p.numel() for p in loaded.model.parameters())
    assert params == BY_HAND[fields["model_type"]](fields) == PUBLISHED[name]
    assert loaded.cautions == []  # a published config: nothing to caution about


def test_aliases_name_the_same_checkpoint():
    assert hf_specs.hf_config("openai-community/gpt2-xl").n_layer == 48
    assert hf_specs.hf_config("Google-BERT/bert-large-uncased").hidden_size == 1024


def test_opt_350m_counted_from_its_published_config(capsys):
    # issue 21: hf:facebook/opt-350m reported 125.24 M params (OPTConfig's defaults, the 125m model)
    code = cli.main(["hf:facebook/opt-350m", "--seq-len", "8", "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["totals"]["params"] == 331_196_416 and data["cautions"] == []
    s, d, e, f, layers, vocab = 8, 1024, 512, 4096, 24, 50272
    per_layer = s * 4 * d * d + s * s * 2 * d + 2 * s * d * f  # q k v o, attention (all heads), fc1 fc2
    assert data["totals"]["macs"] == 2 * s * e * d + layers * per_layer + s * e * vocab


@pytest.mark.parametrize("name", ["facebook/opt-2.7b", "Qwen/Qwen2-72B", "someone/my-llama"])
def test_an_unknown_checkpoint_is_refused_with_the_ways_forward(capsys, name):
    code = cli.main([f"hf:{name}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "hf:path/to/config.json" in err and "--set key=value" in err and "never downloads" in err


def test_a_close_name_gets_a_suggestion():
    with pytest.raises(ModelSpecError, match=r"did you mean hf:Qwen/Qwen2-7B\?"):
        hf_specs.hf_config("Qwen/Qwen2-7b-instruct")


def test_a_model_type_built_from_class_defaults_says_so(capsys):
    args = ["hf:llama", "--set", "num_hidden_layers=1", "--set", "hidden_size=64", "--set", "intermediate_size=128",
            "--set", "num_attention_heads=2", "--set", "num_key_value_heads=2", "--seq-len", "4"]
    assert cli.main([*args, "--format", "json"]) == 0
    cautions = json.loads(capsys.readouterr().out)["cautions"]
    assert "LlamaConfig's defaults but for --set num_hidden_layers" in cautions[0]
    assert "not a published checkpoint" in cautions[0]
    assert cli.main([*args, "--no-detailed"]) == 0
    captured = capsys.readouterr()
    summary = [line for line in captured.out.splitlines() if line.startswith("caution:")]
    assert summary and "LlamaConfig's defaults" in summary[0]
    assert "LlamaConfig's defaults" in captured.err  # and as a warning
    assert cli.main([*args, "--sweep", "seq=4,8"]) == 0  # a sweep says so too (on stderr)
    assert "LlamaConfig's defaults" in capsys.readouterr().err
