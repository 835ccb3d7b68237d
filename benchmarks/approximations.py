"""Counted training FLOPs per token against the approximations training logs use instead.

    python benchmarks/approximations.py [--output benchmarks/results/approximations.md]

For each model (built on the meta device; nothing runs): fxflops' count of one training step,
forward + backward (estimate(backward=True), the loss being the model's own for language models),
per token; then 6N (N = parameters outside embedding tables, transformers' floating_point_ops) and
6N + 12·L·H·Q·T (nanoGPT's and torchtitan's attention term: L layers, H query heads, Q head dim,
T sequence length), each as a ratio to the count. What makes each approximation go wrong is read
from the count's own per-rule totals (attention, the LM head, the experts), printed below the table.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxflops  # noqa: E402
from benchmarks.common import environment  # noqa: E402
from fxflops.timing.meter import non_embedding_params  # noqa: E402


def gpt2():
    import transformers as tf

    with torch.device("meta"):
        return tf.GPT2LMHeadModel(tf.GPT2Config(bos_token_id=0, eos_token_id=0)), 1024, (12, 12, 64)


def llama_gqa():
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                            intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                            max_position_embeddings=4096)
    with torch.device("meta"):
        return tf.LlamaForCausalLM(config), 2048, (16, 32, 64)


def mixtral_moe():
    import transformers as tf

    config = tf.MixtralConfig(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                              intermediate_size=3584, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2)
    with torch.device("meta"):
        return tf.MixtralForCausalLM(config), 1024, (8, 16, 64)


def vit_b16():
    import torchvision

    with torch.device("meta"):
        return torchvision.models.vit_b_16(), 197, (12, 12, 64)


MODELS = {
    "GPT-2 small (124M), seq 1024": gpt2,
    "Llama, GQA 32q/8kv heads (1.2B), seq 2048": llama_gqa,
    "Mixtral-style MoE, 8 experts top-2, seq 1024": mixtral_moe,
    "ViT-B/16, 224px (197 tokens)": vit_b16,
}


def row(name: str, build) -> tuple[dict[str, str], str]:
    model, seq, (layers, heads, head_dim) = build()
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name.startswith("ViT"):
            result = fxflops.estimate(model, (torch.zeros(1, 3, 224, 224, device="meta"),), backward=True)
        else:
            ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
            result = fxflops.estimate(model, kwargs={"input_ids": ids, "labels": ids}, backward=True,
                                      loss=lambda output: output.loss)
    tokens = seq
    counted = result.total_flops / tokens
    n = non_embedding_params(model)
    six_n = 6 * n
    attention = 12 * layers * heads * head_dim * seq
    notes = f"{name}: N = {n / 1e6:.1f} M non-embedding params"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    if head is not None and id(head.weight) in embedded:
        notes += (f"; the LM head shares the embedding's weight, so N leaves out its matmul: "
                  f"6·d·V = {6 * head.weight.numel() / 1e9:.3f} GFLOPs/token")
    experts = getattr(getattr(model, "config", None), "num_local_experts", None)
    if experts:
        k = model.config.num_experts_per_tok
        notes += f"; N holds all {experts} experts of each layer, a token runs {k} of them"
    notes += f"; 12·L·H·Q·T = {attention / 1e9:.3f} GFLOPs/token at T = {seq}"
    return {
        "model": name,
        "counted GFLOPs/token": f"{counted / 1e9:.3f}",
        "6N GFLOPs/token": f"{six_n / 1e9:.3f}",
        "6N / counted": f"{six_n / counted:.2f}",
        "6N+12LHQT GFLOPs/token": f"{(six_n + attention) / 1e9:.3f}",
        "(6N+12LHQT) / counted": f"{(six_n + attention) / counted:.2f}",
    }, notes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output")
    parser.add_argument("--only", help="run one model whose name starts with this")
    options = parser.parse_args()
    rows, notes = [], []
    for name, build in MODELS.items():
        if options.only and not name.startswith(options.only):
            continue
        found, note = row(name, build)
        rows.append(found)
        notes.append(note)
        print(found, note, flush=True)
    from tabulate import tabulate

    text = ("# Counted training FLOPs per token vs 6N and 6N + 12·L·H·Q·T\n\n" + environment(("torch", "transformers", "torchvision")) + "\n\n"
            + tabulate(rows, headers="keys", tablefmt="github") + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    print(text)
    if options.output:
        Path(options.output).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
