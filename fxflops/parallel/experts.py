"""Expert parallelism: a mixture-of-experts layer's experts split over `ep` ranks, the torchtitan way.

torch has no expert-parallel API; torchtitan's `ExpertParallel` is the reference this follows. Each rank
holds `experts / ep` consecutive experts (the expert weights sliced along their expert dimension). The
tokens a rank routed are dispatched with an all-to-all(-v) to the ranks holding their experts, each rank
runs its local experts — the model's own expert code — on the tokens it received, and a second
all-to-all returns the results, which the layer combines as before. autograd's all-to-all sends the
gradients back the same two ways. Which experts the tokens go to is the routing assumption
(`estimate(routing=...)`: balanced by default, worst, or per-expert counts), the same on every rank:
a rank receives from each of the `ep` ranks the tokens it routed to the rank's experts.

Recognized experts (a module named `experts`, found in every MoE layer):

- grouped weights called with the routed tokens sorted by expert and the tokens per expert, as
  torchtitan's `GroupedExperts(x, num_tokens_per_expert)` (its for-loop or grouped-mm code alike); as in
  torchtitan, the per-expert counts are exchanged by an all-to-all of their own first;
- grouped weights called with every token, its top-k expert indices and weights, as Hugging Face's
  Mixtral / Qwen-MoE / OLMoE experts in transformers 5 (`experts(hidden_states, top_k_index, top_k_weights)`);
- a ModuleList of expert modules its MoE layer calls one by one on their tokens (Mixtral / Qwen-MoE
  before transformers 5, DeepSeek's code, most hand-written MoEs): each call's tokens go to the expert's
  rank by an all-to-all of their own, and an expert held elsewhere is replaced on this rank by a
  stand-in that runs nothing.

Grouped weights are the module's own parameters that are at least 3-D with the expert count first.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fxflops.capture.module_walk import walk_modules

GROUPED = "grouped"  # experts(routed tokens sorted by expert, tokens per expert): torchtitan
INDEXED = "indexed"  # experts(tokens, top_k_index, top_k_weights): Hugging Face transformers 5
LISTED = "listed"  # a ModuleList of experts the layer calls one by one

_COUNT_ATTRIBUTES = ("num_experts", "n_experts", "num_local_experts")
RECOGNIZED = ("a module named 'experts' that is a ModuleList of expert modules, or holds [experts, ...] weight "
              "tensors and is called as experts(tokens sorted by expert, tokens per expert) (torchtitan's "
              "GroupedExperts) or experts(tokens, top_k_index, top_k_weights) (Hugging Face's MixtralExperts)")


@dataclass(frozen=True)
class ExpertSite:
    """One MoE layer's experts: where, how they are laid out, how many."""

    path: str
    layout: str
    experts: int


def expert_sites(model: torch.nn.Module) -> list[ExpertSite]:
    """Every `experts` module of the model, with its layout; ValueError for one of a layout not recognized."""
    sites = []
    for name, module, alias in walk_modules(model):
        if alias is not None or name.rsplit(".", 1)[-1] != "experts":
            continue
        sites.append(ExpertSite(name, _layout(name, module), _count(module)))
    return sites


def moe_layers(model: torch.nn.Module) -> list[str]:
    """The modules holding a child named `experts` (whatever its layout): the MoE layers."""
    return [name for name, module, alias in walk_modules(model)
            if alias is None and "experts" in dict(module.named_children())]


def _count(module: torch.nn.Module) -> int:
    if isinstance(module, torch.nn.ModuleList):
        return len(module)
    return int(next(iter(module.parameters(recurse=False))).shape[0])


def _layout(name: str, module: torch.nn.Module) -> str:
    if isinstance(module, torch.nn.ModuleList):
        kinds = {type(child) for child in module}
        if len(module) >= 2 and len(kinds) == 1 and any(True for _ in module[0].parameters()):
            return LISTED
    else:
        params = list(module.parameters(recurse=False))
        leading = {int(p.shape[0]) for p in params if p.dim() >= 3}
        grouped = bool(params) and len(leading) == 1 and all(p.dim() >= 3 for p in params) \
            and not any(True for child in module.children() for _ in child.parameters())
        names = list(inspect.signature(module.forward).parameters)[:3]
        if grouped and len(names) >= 3 and "index" in names[1]:
            return INDEXED
        if grouped and len(names) >= 2:
            return GROUPED
    raise ValueError(f"parallel plan: ep cannot split the experts of '{name}' ({type(module).__name__}): its layout "
                     f"is not one fxflops recognizes; recognized is {RECOGNIZED}")


def check_experts(model: torch.nn.Module, ep: int, ranks: int, source: str = "dp") -> None:
    """One clear ValueError for an expert-parallel degree this model or plan cannot take; `ranks`: the
    ranks ep borrows from (`source` names them: dp, dp*cp, dp_shard*cp)."""
    if ranks % ep:
        raise ValueError(f"parallel plan: ep={ep} splits the experts over data-parallel ranks (as torchtitan borrows "
                         f"its expert-parallel ranks from dp); {source}={ranks} is not a multiple of {ep}")
    sites = expert_sites(model)
    if not sites:
        raise ValueError(f"parallel plan: ep={ep} found no experts in {type(model).__name__} to split; recognized is "
                         f"{RECOGNIZED}")
    for site in sites:
        if site.experts % ep:
            raise ValueError(f"parallel plan: ep={ep} does not divide the {site.experts} experts of '{site.path}'; "
                             f"pick an ep that divides {site.experts}")


@dataclass
class RoutedCounts:
    """What the ranks' MoE layers route, as a capture's hooks see it: per expert site, in call order, the
    tokens (rows) routed to each expert. The same on every rank (one routing assumption)."""

    calls: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def received(self, ep: int, index: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """What the rank at expert-parallel index `index` receives: per call, per local expert, from all ranks."""
        found = []
        for path, sizes in self.calls:
            per = len(sizes) // ep
            found.append((path, tuple(ep * size for size in sizes[index * per:(index + 1) * per])))
        return tuple(found)


def apply_experts(model: torch.nn.Module, ep_mesh: Any, seen: RoutedCounts) -> list[torch.nn.Parameter]:
    """Split every MoE layer's experts over `ep_mesh` (a 1-D DeviceMesh) on the model's twins, as this
    rank; hooks dispatch and combine the tokens. Returns the rank's expert parameters (FSDP shards them over
    the data-parallel ranks that hold the same experts, not over the whole dp)."""
    ep, index = ep_mesh.size(), ep_mesh.get_local_rank()
    group = ep_mesh.get_group()
    held: list[torch.nn.Parameter] = []
    for site in expert_sites(model):
        module = model.get_submodule(site.path)
        per = site.experts // ep
        exchange = _Exchange(site.path, ep, index, per, group, seen)
        if site.layout == LISTED:
            for number, expert in enumerate(list(module)):
                if number // per != index:
                    module[number] = _Elsewhere()
                else:
                    held.extend(expert.parameters())
                # dispatch before any tensor-parallel input hook of the expert (torchtitan's order: the
                # tokens reach the expert's rank first, its tp then replicates them over the tp ranks),
                # combine after its output hooks: the all-to-alls see the plain tensors they exchange
                module[number].register_forward_pre_hook(exchange.listed_dispatch(number, site.experts),
                                                         prepend=True)
                module[number].register_forward_hook(exchange.listed_combine)
            continue
        for attribute in _COUNT_ATTRIBUTES:  # the experts' own count (Hugging Face's code sizes its bins by it)
            if module.__dict__.get(attribute) == site.experts:
                setattr(module, attribute, per)
        for key, param in list(module.named_parameters(recurse=False)):
            local = torch.nn.Parameter(param.detach()[index * per:(index + 1) * per], requires_grad=param.requires_grad)
            module.register_parameter(key, local)
            held.append(local)
        if site.layout == GROUPED:
            module.register_forward_pre_hook(exchange.grouped_dispatch, with_kwargs=True)
            module.register_forward_hook(exchange.grouped_combine)
        else:
            module.register_forward_pre_hook(exchange.indexed_dispatch, with_kwargs=True)
            module.register_forward_hook(exchange.indexed_combine)
    return held


class _Elsewhere(torch.nn.Module):
    """An expert another rank holds: it receives no tokens here and runs nothing."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return x


def _constant(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small tensor of known values made by factory ops (the capture knows their values, as of any constant)."""
    if not values:
        return torch.zeros(0, dtype=dtype, device=device)
    return torch.cat([torch.full((1,), value, dtype=dtype, device=device) for value in values])


def _regroup(rows: torch.Tensor, outer: int, sizes: list[int], by_inner: bool) -> torch.Tensor:
    """Rows in `outer` blocks of len(sizes) groups (`sizes` rows each), regrouped group-major (by_inner) or
    back block-major: received rows come per source rank, then per local expert; the experts read them per
    expert, then per source rank. Views and one copy, whatever the row count."""
    if outer == 1 or len(sizes) == 1 or not sum(sizes):
        return rows
    if by_inner:
        pieces = [block.split(sizes) for block in rows.split(sum(sizes))]
        return torch.cat([pieces[source][group] for group in range(len(sizes)) for source in range(outer)])
    pieces = rows.split([size for size in sizes for _ in range(outer)])
    return torch.cat([pieces[group * outer + source] for source in range(outer) for group in range(len(sizes))])


class _Exchange:
    """The dispatch and combine hooks of one MoE layer's experts on one rank."""

    def __init__(self, path: str, ep: int, index: int, per: int, group: Any, seen: RoutedCounts) -> None:
        self.path, self.ep, self.index, self.per, self.group, self.seen = path, ep, index, per, group, seen
        self._pending: list[tuple[list[int], list[int], list[int] | None, Any]] = []
        self._last = -1  # the last listed expert called: a lower number starts the layer's next call

    # --- the all-to-alls ---------------------------------------------------------------------------

    def _dispatch(self, routed: torch.Tensor, sizes: list[int], extra: Any = None) -> tuple[torch.Tensor, list[int]]:
        """Rows sorted by (global) expert to the ranks holding the experts; the rows this rank's experts
        received, per local expert then per source rank, and how many each local expert has. `extra`: what
        the combine needs besides."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        self.seen.calls.append((self.path, tuple(sizes)))
        per, ep = self.per, self.ep
        send = [sum(sizes[r * per:(r + 1) * per]) for r in range(ep)]
        local = sizes[self.index * per:(self.index + 1) * per]
        receive = [sum(local)] * ep  # each rank routes its tokens as this one does (one routing assumption)
        received = all_to_all_single_autograd(routed, receive, send, self.group)
        self._pending.append((send, receive, local, extra))
        return _regroup(received, ep, local, by_inner=True), [ep * size for size in local]

    def _return(self, output: torch.Tensor) -> tuple[torch.Tensor, Any]:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        send, receive, local, extra = self._pending.pop()
        back = _regroup(output, self.ep, local, by_inner=False)
        return all_to_all_single_autograd(back, send, receive, self.group), extra

    # --- torchtitan: experts(x sorted by expert, tokens per expert) ----------------------------------

    def grouped_dispatch(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        names = list(bound.signature.parameters)
        routed, counts = bound.arguments[names[0]], bound.arguments[names[1]]
        sizes = [int(c) for c in counts.tolist()]  # the routing assumption's values
        if routed.shape[0] != sum(sizes):
            raise ValueError(f"expert parallelism: '{self.path}' got {routed.shape[0]} rows for {sum(sizes)} routed "
                             "tokens; rows padded before the experts are not split yet")
        # torchtitan first tells each rank how many rows of each of its experts come (its output's values
        # are the routing assumption's, as every rank routes alike: the constant below)
        from torch.distributed._functional_collectives import all_to_all_single, wait_tensor

        wait_tensor(all_to_all_single(counts, None, None, self.group))
        received, local = self._dispatch(routed, sizes)
        bound.arguments[names[0]] = received
        bound.arguments[names[1]] = _constant(local, counts.dtype, counts.device)
        return bound.args, bound.kwargs

    def grouped_combine(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return self._return(output)[0]

    # --- Hugging Face: experts(tokens, top_k_index, top_k_weights) ----------------------------------

    def indexed_dispatch(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        names = list(bound.signature.parameters)
        tokens, picks, weights = (bound.arguments[name] for name in names[:3])
        experts = self.per * self.ep
        flat = picks.reshape(-1)
        sizes = [int(c) for c in torch.bincount(flat, minlength=experts).tolist()]  # the routing assumption's
        order = torch.argsort(flat, stable=True)
        k = picks.shape[-1]
        received, local = self._dispatch(tokens[order // k], sizes, (order, weights, tokens.shape))
        rows = sum(local)
        bound.arguments[names[0]] = received
        bound.arguments[names[1]] = torch.repeat_interleave(
            torch.arange(self.per, device=picks.device), _constant(local, torch.long, picks.device),
            output_size=rows).reshape(rows, 1).to(picks.dtype)
        bound.arguments[names[2]] = torch.ones(rows, 1, dtype=weights.dtype, device=weights.device)
        return bound.args, bound.kwargs

    def indexed_combine(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        back, (order, weights, shape) = self._return(output)
        # back in this rank's routed order: each (token, pick) row to its place, weighted, summed per token
        rows = torch.empty_like(back).index_copy(0, order, back)
        k = weights.shape[-1]
        return (rows.view(shape[0], k, -1) * weights.reshape(shape[0], k, 1).to(rows.dtype)).sum(1).to(back.dtype)

    # --- a ModuleList the layer calls one expert at a time ---------------------------------------------

    def listed_dispatch(self, number: int, experts: int) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: tuple) -> tuple:
            from torch.distributed._functional_collectives import all_to_all_single_autograd

            x = args[0]
            rows = int(x.shape[0])
            if number <= self._last:  # (a layer may call only the experts its tokens picked)
                self._last = -1
            if self._last < 0:
                self.seen.calls.append((self.path, tuple([0] * experts)))
            self._last = number
            path, sizes = self.seen.calls[-1]
            self.seen.calls[-1] = (path, tuple(rows if e == number else s for e, s in enumerate(sizes)))
            owner = number // self.per
            send = [rows if r == owner else 0 for r in range(self.ep)]
            receive = [rows if owner == self.index else 0] * self.ep  # each rank sends it as many
            self._pending.append((send, receive, None, None))
            return (all_to_all_single_autograd(x, receive, send, self.group), *args[1:])
        return hook

    def listed_combine(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        send, receive, _, _ = self._pending.pop()
        return all_to_all_single_autograd(output, send, receive, self.group)


def ep_index(rank: int, degrees: dict[str, int], dims: tuple[str, ...] = ("ep",)) -> int:
    """The expert-parallel coordinate of a global rank on a mesh of `degrees` (outermost first): its
    coordinate in the mesh dimensions `dims` the expert-parallel group spans, flattened (outer one first)."""
    names = list(degrees)
    index = 0
    for name in dims:
        inner = math.prod(degrees[n] for n in names[names.index(name) + 1:])
        index = index * degrees[name] + (rank // inner) % degrees[name]
    return index


def expert_roles(seen: RoutedCounts, degrees: dict[str, int], size: int,
                 dims: tuple[str, ...] = ("ep",)) -> list[tuple[str, tuple[int, ...]]]:
    """(name, ranks) per rank role under expert parallelism: ranks whose experts receive the same token
    counts in every MoE layer run the same ops; the role of rank 0 first. `dims`: the mesh dimensions the
    expert-parallel group spans."""
    ep = math.prod(degrees[name] for name in dims)
    by_received: dict[tuple, list[int]] = {}
    for index in range(ep):
        by_received.setdefault(seen.received(ep, index), []).append(index)
    if len(by_received) == 1:
        return [("every rank", tuple(range(size)))]
    roles = []
    for received, indices in by_received.items():
        ranks = tuple(rank for rank in range(size) if ep_index(rank, degrees, dims) in indices)
        rows = [sum(sizes) for _, sizes in received]
        named = ", ".join(map(str, indices))
        roles.append((f"expert-parallel index{'es' if len(indices) > 1 else ''} {named}: its experts receive "
                      f"{', '.join(f'{r:,}' for r in rows)} rows (per MoE layer call)", ranks))
    return roles
