"""Small mixture-of-experts models for the expert-parallel tests, in the layouts fxflops recognizes:
torchtitan's (GroupedExperts called with tokens sorted by expert and the tokens per expert), the
ModuleList of experts a layer calls one by one, and (in the tests) Hugging Face's Mixtral."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.parallel_models import FeedForward as Expert  # w1, w3, w2 with SiLU: an expert or a shared expert


class GroupedExperts(torch.nn.Module):
    """torchtitan's GroupedExperts: [experts, ...] weights; a for-loop over the experts or grouped mm."""

    def __init__(self, dim: int, hidden: int, experts: int, grouped_mm: bool) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = torch.nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = torch.nn.Parameter(torch.empty(experts, hidden, dim))
        self.grouped_mm = grouped_mm

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if self.grouped_mm:
            offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
            h = F.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offsets))
            h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offsets)
        sizes = num_tokens_per_expert.tolist()
        parts = torch.split(x, [int(size) for size in sizes], dim=0)
        out = [torch.matmul(F.silu(torch.matmul(part, self.w1[e].transpose(-2, -1)))
                            * torch.matmul(part, self.w3[e].transpose(-2, -1)), self.w2[e].transpose(-2, -1))
               for e, part in enumerate(parts)]
        return torch.cat(out, dim=0)


class MoE(torch.nn.Module):
    """torchtitan's MoE forward: router topk, tokens per expert by histc, tokens sorted by expert and
    scaled by their score, the experts, results scattered back (plus a shared expert)."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, layout: str) -> None:
        super().__init__()
        self.top_k, self.n_experts, self.layout = top_k, experts, layout
        self.gate = torch.nn.Linear(dim, experts, bias=False)
        if layout == "list":
            self.experts = torch.nn.ModuleList(Expert(dim, hidden) for _ in range(experts))
        else:
            self.experts = GroupedExperts(dim, hidden, experts, grouped_mm=layout == "grouped_mm")
        self.shared_expert = Expert(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        x = x.view(-1, dim)
        scores = torch.sigmoid(self.gate(x).float())
        top, picks = torch.topk(scores, k=self.top_k, dim=1)
        counts = torch.histc(picks.view(-1).float(), bins=self.n_experts, min=0, max=self.n_experts)
        order = torch.argsort(picks.view(-1), stable=True)
        token = order // self.top_k
        routed = x[token] * top.view(-1)[order].reshape(-1, 1)
        if self.layout == "list":
            parts = torch.split(routed, [int(c) for c in counts.tolist()], dim=0)
            out = torch.cat([expert(part) for expert, part in zip(self.experts, parts)])
        else:
            out = self.experts(routed, counts.long())
        shared = self.shared_expert(x)
        return shared.scatter_add(0, token.reshape(-1, 1).expand(-1, dim), out).view(b, s, dim)


class Block(torch.nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, layout: str) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.moe = MoE(dim, hidden, experts, top_k, layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoEModel(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int, experts: int, top_k: int, layers: int,
                 layout: str = "loop") -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Block(dim, hidden, experts, top_k, layout) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)
