"""Context parallelism: the sequence split over `cp` ranks, attention as ring attention.

torch's own `context_parallel` (torch.distributed.tensor.experimental) replaces only the CUDA attention
kernels (flash, efficient, cuDNN) — a capture on fake CPU tensors runs none of them — and does so by
rebinding `F.scaled_dot_product_attention` for the duration. fxflops does the same per-rank work itself,
following torch's ring attention (`_templated_ring_attention`) step by step:

- the inputs' sequence (dim 1 of every input that has the first input's sequence length) is cut into
  2·cp chunks and rank r holds chunks r and 2·cp−1−r, torch's head-tail load balancing for causal
  attention; every op but attention runs on those S/cp positions;
- each `scaled_dot_product_attention` call: the rank's keys and values are all-gathered over the cp
  ranks once (torch's default rotation, "allgather"), then cp steps as torch runs them — step 0 its own
  queries against its own keys, causal; step i ≤ rank all its queries against the first chunk of rank
  (rank−i)'s keys; step i > rank its second query chunk against all of that rank's keys — each an SDPA
  op returning its logsumexp, merged as torch's `_SDPAMerger` does. Non-causal attention: every step
  all queries against all of that rank's keys. autograd differentiates these ops: the backward is each
  step's SDPA backward (the FLOPs torch's ring backward runs) and the all-gather's gradient, a
  reduce-scatter of dk and dv (torch's ring backward instead gathers k and v again and passes dk and
  dv around the ring: those bytes are not what this records).

An attention call with an explicit mask is not split (one clear error): torch's ring attention takes
is_causal or no mask as well. The mode that sees the model's attention calls is entered by a forward
pre-hook on the model and left by its forward hook (also when the forward raises).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_SDPA = (torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)


def sequence_length(args: tuple, kwargs: dict) -> int | None:
    """The inputs' sequence length: dim 1 of the first input tensor with two dims or more."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[1])
    return None


def check_context(cp: int, args: tuple, kwargs: dict) -> None:
    """One clear ValueError for a context-parallel degree the inputs cannot take."""
    length = sequence_length(args, kwargs)
    if length is None:
        raise ValueError(f"parallel plan: cp={cp} splits the inputs' sequence (dim 1), and no input tensor has one")
    if length % (2 * cp):
        raise ValueError(f"parallel plan: cp={cp} does not divide the sequence of {length} positions into 2*cp = "
                         f"{2 * cp} chunks (torch's head-tail load balancing); pick a cp with {length} a multiple "
                         "of 2*cp")


def apply_context(model: torch.nn.Module, cp_mesh: Any) -> None:
    """Split the inputs' sequence over `cp_mesh` (1-D) as this rank and run attention as ring attention,
    on the model's twins (hooks the capture's isolation removes)."""
    ring = _RingAttention(cp_mesh.size(), cp_mesh.get_local_rank(), cp_mesh.get_group())

    def enter(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        length = sequence_length(args, kwargs)
        args = tuple(ring.local(value, length) for value in args)
        kwargs = {key: ring.local(value, length) for key, value in kwargs.items()}
        ring.__enter__()
        return args, kwargs

    def leave(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        ring.__exit__(None, None, None)

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)


class _RingAttention(TorchFunctionMode):
    """Each scaled_dot_product_attention call the model makes, as torch's ring attention on this rank."""

    def __init__(self, cp: int, rank: int, group: Any) -> None:
        super().__init__()
        self.cp, self.rank, self.group = cp, rank, group

    def local(self, value: Any, length: int | None) -> Any:
        """This rank's positions of an input: chunks rank and 2·cp−1−rank of its sequence."""
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or int(value.shape[1]) != length:
            return value
        chunks = value.chunk(2 * self.cp, dim=1)
        return torch.cat([chunks[self.rank], chunks[2 * self.cp - 1 - self.rank]], dim=1)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _SDPA:
            return func(*args, **kwargs)
        return self._ring(*args, **kwargs)

    def _ring(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        if attn_mask is not None:
            raise NotImplementedError("context parallelism: attention with an explicit mask (attn_mask) is not "
                                      "split yet; ring attention takes is_causal=True or no mask")
        repeat = query.shape[-3] // key.shape[-3]  # grouped-query attention: a key/value head serves a group
        key, value = key.contiguous(), value.contiguous()
        # every rank's keys and values, once (torch's "allgather" rotation)
        gathered = all_gather_tensor_autograd(torch.cat([key.flatten(), value.flatten()]), 0, self.group)
        size = key.numel() + value.numel()
        out = lse = None
        for step in range(self.cp):
            source = (self.rank - step) % self.cp
            block = gathered[source * size:(source + 1) * size]
            k, v = block[:key.numel()].view(key.shape), block[key.numel():].view(value.shape)
            if repeat > 1:  # (gathered as given, repeated here)
                k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
            q, partial = query, False
            if is_causal and step > 0:
                if step <= self.rank:  # the source's first chunk is before both of this rank's chunks
                    k, v = k.chunk(2, dim=-2)[0], v.chunk(2, dim=-2)[0]
                else:  # only this rank's second chunk comes after the source's chunks
                    q, partial = query.chunk(2, dim=-2)[1], True
            block_out, block_lse = _attention(q, k, v, dropout_p, is_causal and step == 0, scale)
            out, lse = _merge(out, lse, block_out, block_lse, partial)
        return out.to(query.dtype)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, is_causal: bool,
               scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA with its logsumexp, by the kernel torch's ring attention runs on this device (flash)."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)[:2]
    else:
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[:2]
    return out, lse


def _merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor,
           partial: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's _SDPAMerger.step: the running output and logsumexp updated by one block (`partial`: the
    block covers the second half of the queries only)."""
    block_out, block_lse = block_out.float(), block_lse.unsqueeze(-1).float()
    if out is None:
        return block_out, block_lse
    if partial:
        head_out, tail_out = out.chunk(2, dim=-2)
        head_lse, tail_lse = lse.chunk(2, dim=-2)
        tail_out, tail_lse = _merge(tail_out, tail_lse, block_out, block_lse.squeeze(-1), False)
        return torch.cat([head_out, tail_out], dim=-2), torch.cat([head_lse, tail_lse], dim=-2)
    out = out - torch.sigmoid(block_lse - lse) * (out - block_out)
    lse = lse - torch.nn.functional.logsigmoid(lse - block_lse)
    return out, lse
