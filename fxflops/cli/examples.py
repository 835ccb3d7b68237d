"""Built-in example models in plain torch, so the quick start needs nothing but fxflops.

- `lenet5`: the LeNet5 of DeepSpeed's Flops Profiler tutorial (1x32x32 images).
- `gpt2-small`: a GPT-2-small-shaped causal decoder (12 layers, 768 wide, 50257 tokens).
- `bert-base`: a BERT-base-shaped encoder (12 layers, 768 wide, 30522 tokens), with the
  module names of Hugging Face's BertModel so reports read like DeepSpeed's BERT samples.

Every builder takes size overrides (tests build two-layer versions) and works under
`torch.device("meta")`; `Example.inputs` makes matching example inputs on any device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


# ------------------------------------------------------------------------------------ LeNet5


class LeNet5(nn.Module):
    """LeNet5 as in DeepSpeed's flops-profiler tutorial: returns (logits, probabilities)."""

    def __init__(self, n_classes: int = 10) -> None:
        super().__init__()
        self.feature_extractor = nn.Sequential(
            nn.Conv2d(in_channels=1, out_channels=6, kernel_size=5, stride=1),
            nn.Tanh(),
            nn.AvgPool2d(kernel_size=2),
            nn.Conv2d(in_channels=6, out_channels=16, kernel_size=5, stride=1),
            nn.Tanh(),
            nn.AvgPool2d(kernel_size=2),
            nn.Conv2d(in_channels=16, out_channels=120, kernel_size=5, stride=1),
            nn.Tanh(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(in_features=120, out_features=84),
            nn.Tanh(),
            nn.Linear(in_features=84, out_features=n_classes),
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.feature_extractor(x)
        x = torch.flatten(x, 1)
        logits = self.classifier(x)
        probs = F.softmax(logits, dim=1)
        return logits, probs


def lenet5(n_classes: int = 10) -> LeNet5:
    return LeNet5(n_classes=n_classes).eval()


def lenet5_inputs(batch: int = 1, device: Any = "meta", **_: Any) -> tuple[torch.Tensor]:
    return (torch.zeros(batch, 1, 32, 32, device=device),)


# -------------------------------------------------------------------------------- GPT-2 small


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        # (batch, heads, seq, head_dim) as SDPA wants it.
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class GPT2Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2-shaped language model; the output head shares the token embedding's weight."""

    def __init__(
        self,
        vocab_size: int = 50257,
        n_positions: int = 1024,
        d_model: int = 768,
        n_layer: int = 12,
        n_head: int = 12,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(n_positions, d_model)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPT2Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt2_small(**sizes: Any) -> GPT2:
    return GPT2(**sizes).eval()


def token_inputs(batch: int = 1, seq_len: int = 128, device: Any = "meta", **_: Any) -> tuple[torch.Tensor]:
    return (torch.zeros(batch, seq_len, dtype=torch.long, device=device),)


# ---------------------------------------------------------------------------------- BERT base


class BertEmbeddings(nn.Module):
    def __init__(self, vocab_size: int, max_positions: int, type_vocab_size: int, hidden: int,
                 dropout: float) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden, padding_idx=0)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        token_types = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = x + self.token_type_embeddings(token_types)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    """Attention written out as matmul + softmax, the way BERT's eager implementation does."""

    def __init__(self, hidden: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        return x.view(batch, seq, self.n_head, hidden // self.n_head).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        probs = self.dropout(F.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).transpose(1, 2)
        return context.reshape(x.shape)


class BertSelfOutput(nn.Module):
    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    def __init__(self, hidden: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.self = BertSelfAttention(hidden, n_head, dropout)
        self.output = BertSelfOutput(hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class BertIntermediate(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate)
        self.intermediate_act_fn = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(x))


class BertOutput(nn.Module):
    def __init__(self, intermediate: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.dense = nn.Linear(intermediate, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertLayer(nn.Module):
    def __init__(self, hidden: int, n_head: int, intermediate: int, dropout: float) -> None:
        super().__init__()
        self.attention = BertAttention(hidden, n_head, dropout)
        self.intermediate = BertIntermediate(hidden, intermediate)
        self.output = BertOutput(intermediate, hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attended = self.attention(x)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, n_layer: int, hidden: int, n_head: int, intermediate: int, dropout: float) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(hidden, n_head, intermediate, dropout) for _ in range(n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


class BertPooler(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.activation = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(x[:, 0]))


class BertModel(nn.Module):
    """BERT-base-shaped encoder; returns (sequence output, pooled output)."""

    def __init__(
        self,
        vocab_size: int = 30522,
        max_positions: int = 512,
        type_vocab_size: int = 2,
        hidden: int = 768,
        n_layer: int = 12,
        n_head: int = 12,
        intermediate: int = 3072,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(vocab_size, max_positions, type_vocab_size, hidden, dropout)
        self.encoder = BertEncoder(n_layer, hidden, n_head, intermediate, dropout)
        self.pooler = BertPooler(hidden)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sequence = self.encoder(self.embeddings(input_ids))
        return sequence, self.pooler(sequence)


def bert_base(**sizes: Any) -> BertModel:
    return BertModel(**sizes).eval()


# ----------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Example:
    """A built-in model: `build(**sizes)` makes it, `inputs(batch=, seq_len=, device=)` feeds it."""

    name: str
    description: str
    build: Callable[..., nn.Module]
    inputs: Callable[..., tuple[torch.Tensor, ...]]
    takes_tokens: bool  # inputs are token ids (--seq-len applies, --dtype does not)


EXAMPLES = MappingProxyType(
    {
        example.name: example
        for example in (
            Example("lenet5", "LeNet5 of DeepSpeed's tutorial, 1x32x32 images (try --batch 1024)",
                    lenet5, lenet5_inputs, takes_tokens=False),
            Example("gpt2-small", "GPT-2-small-shaped decoder, plain torch + SDPA (124 M params)",
                    gpt2_small, token_inputs, takes_tokens=True),
            Example("bert-base", "BERT-base-shaped encoder, plain torch, HF module names (109 M params)",
                    bert_base, token_inputs, takes_tokens=True),
        )
    }
)


def _key(name: str) -> str:
    return name.lower().replace("_", "-")


def get_example(name: str) -> Example:
    """The example called `name` (case and `-`/`_` do not matter); KeyError lists the others."""
    for example in EXAMPLES.values():
        if _key(example.name) == _key(name):
            return example
    raise KeyError(f"no built-in example {name!r}; known: {', '.join(EXAMPLES)}")
