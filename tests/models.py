"""Small models the tests share."""

from __future__ import annotations

import torch
from torch import nn


class LeNet5(nn.Module):
    """LeNet5 as in the DeepSpeed flops profiler tutorial (seeds/000)."""

    def __init__(self, n_classes: int = 10) -> None:
        super().__init__()
        self.feature_extractor = nn.Sequential(
            nn.Conv2d(1, 6, kernel_size=5, stride=1), nn.Tanh(), nn.AvgPool2d(kernel_size=2),
            nn.Conv2d(6, 16, kernel_size=5, stride=1), nn.Tanh(), nn.AvgPool2d(kernel_size=2),
            nn.Conv2d(16, 120, kernel_size=5, stride=1), nn.Tanh(),
        )
        self.classifier = nn.Sequential(nn.Linear(120, 84), nn.Tanh(), nn.Linear(84, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.feature_extractor(x)
        x = torch.flatten(x, 1)
        return torch.softmax(self.classifier(x), dim=1)


class SharedTwice(nn.Module):
    """One Linear called twice, plus an alias of it under a second name."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.again = self.proj
        self.out = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.again(torch.relu(self.proj(x))))


class ValueDependent(nn.Module):
    """A Linear whose forward branches on the values of its output: fake tensors cannot decide it (the
    weights do; a branch on the input's values alone is decided from the example input)."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y if y.sum() > 0 else -y


def tiny_transformers_model(kind: str, device: str = "cpu") -> tuple[nn.Module, dict]:
    """A 2-layer BERT / GPT-2 / Llama from its config class (never from a hub) and its inputs."""
    import transformers as tf

    configs = {
        "bert": (tf.BertModel, tf.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                             intermediate_size=128, vocab_size=1000)),
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000,
                                                   bos_token_id=0, eos_token_id=0)),
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                      num_key_value_heads=2, intermediate_size=128,
                                                      vocab_size=1000)),
    }
    cls, config = configs[kind]
    with torch.device(device):
        model = cls(config).eval()
        input_ids = torch.randint(0, 1000, (2, 16)) if device != "meta" else torch.zeros(2, 16, dtype=torch.long)
    return model, {"input_ids": input_ids}
