"""Small mixture-of-experts models for the expert-parallel tests, in the layouts fxflops recognizes:
torchtitan's (GroupedExperts called with tokens sorted by expert and the tokens per expert), the
ModuleList of experts a layer calls one by one, and (in the tests) Hugging Face's Mixtral."""

from __future__ import annotations

from typing import Any

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


# ------------------------------------------------------------- torchtitan's expert parallelism, for the meter


class TitanExperts(torch.nn.Module):
    """torchtitan's GroupedExperts as it runs: (tokens sorted by expert, tokens per expert), its weights
    DTensors under expert parallelism (their local shard used), a for-loop over `.tolist()` splits or
    `torch._grouped_mm` over the counts' offsets (bfloat16: its CPU kernel's only dtype)."""

    def __init__(self, dim: int, hidden: int, experts: int, grouped_mm: bool) -> None:
        super().__init__()
        dtype = torch.bfloat16 if grouped_mm else torch.float32
        self.w1 = torch.nn.Parameter(torch.randn(experts, dim, hidden, dtype=dtype) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, dim, dtype=dtype) * 0.1)
        self.grouped_mm = grouped_mm

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        if self.grouped_mm:
            offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
            return torch._grouped_mm(F.silu(torch._grouped_mm(x, w1, offs=offsets)), w2, offs=offsets)
        sizes = num_tokens_per_expert.tolist()
        parts = torch.split(x[:sum(sizes)], split_size_or_sections=sizes, dim=0)
        return torch.cat([F.silu(part @ w1[e]) @ w2[e] for e, part in enumerate(parts)], dim=0)


class TitanMoE(torch.nn.Module):
    """Top-1 routing with a fixed router: a token goes to the expert named by its largest of the first
    `experts` features (the router's weight is the identity there); counts by histc, tokens sorted by
    expert, the experts, results scattered back."""

    def __init__(self, dim: int, hidden: int, experts: int, grouped_mm: bool = False) -> None:
        super().__init__()
        self.n_experts = experts
        self.router = torch.nn.Linear(dim, experts, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.eye(experts, dim))
        self.experts = TitanExperts(dim, hidden, experts, grouped_mm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        picks = self.router(flat).argmax(-1)
        counts = torch.histc(picks.float(), bins=self.n_experts, min=0, max=self.n_experts).long()
        order = torch.argsort(picks, stable=True)
        out = self.experts(flat[order].to(self.experts.w1.dtype), counts)
        return torch.zeros_like(flat).index_add(0, order, out.to(flat.dtype)).reshape(x.shape)


def routed_batch(picks: list[int], dim: int, seq: int) -> torch.Tensor:
    """A (tokens / seq, seq, dim) batch whose token t TitanMoE routes to expert picks[t]."""
    x = torch.rand(len(picks) // seq, seq, dim) * 0.1
    for token, expert in enumerate(picks):
        x.view(-1, dim)[token, expert] = 10.0
    return x


class ExpertParallel:
    """torchtitan's ExpertParallel style, as its `distribute_module` hooks run it: expert weights sharded
    on their expert dimension; before the experts, the tokens per expert exchanged by an all-to-all, the
    tokens sent to the ranks holding their experts (all_to_all_single_autograd by those splits) and
    regrouped by local expert; after them, the reverse."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh

    def apply(self, experts: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

        def partition(name: str, module: torch.nn.Module, mesh: Any) -> None:
            for key, param in list(module.named_parameters(recurse=False)):
                module.register_parameter(key, torch.nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        return distribute_module(experts, self.mesh, partition, self.dispatch, self.combine)

    def dispatch(self, module: torch.nn.Module, inputs: tuple, mesh: Any) -> tuple:
        from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
        from torch.distributed._functional_collectives import wait_tensor

        x, counts = inputs
        ep, group = mesh.size(), mesh.get_group()
        with torch.no_grad():
            received = wait_tensor(all_to_all_single(counts, None, None, group))  # per source rank, local expert
            self.sent = counts.view(ep, -1).sum(1).tolist()
            self.got = received.view(ep, -1).sum(1).tolist()
        x = all_to_all_single_autograd(x, self.got, self.sent, group)
        local = received.numel() // ep
        with torch.no_grad():  # rows per source rank then local expert -> per local expert
            ids = torch.repeat_interleave(torch.arange(ep * local) % local, received.view(-1), output_size=x.shape[0])
            self.order = torch.argsort(ids, stable=True)
        return x[self.order], received.view(ep, local).sum(0)

    def combine(self, module: torch.nn.Module, out: torch.Tensor, mesh: Any) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        back = torch.empty_like(out).index_copy(0, self.order, out)
        return all_to_all_single_autograd(back, self.sent, self.got, mesh.get_group())


def fake_all_to_all_writes_its_output() -> bool:
    """Whether torch's fake process group (initialised by the caller) writes all_to_all_single's output: newer
    torch copies this rank's own chunks (every rank routes as this one); torch 2.11's leaves the output as it
    was, so a model reading the received counts reads uninitialised memory."""
    import torch.distributed as dist

    out = torch.full((2,), -1)
    dist.all_to_all_single(out, torch.tensor([3, 4]))
    return out.tolist() == [3, 4]

