"""The Megatron-style tensor-parallel plan of a Llama/GPT-style model, in torch's own ParallelStyles.

In each attention and MLP, the linears that read the block's input are column parallel and the one that
writes its output row parallel: one all-reduce forward and one backward per attention and per MLP
(Megatron's f and g). With sequence parallelism, norms (and the residual stream between blocks) are
sharded along the sequence: the all-reduce becomes an all-gather before and a reduce-scatter after;
the embedding is then vocabulary-parallel and the output head gathers the sequence back. The residual
stream between them stays a DTensor sharded along the sequence (embedding and row-parallel outputs are
not made local): code that reads its length — Hugging Face models make the rotary positions and the
causal mask from the embeddings' shape — sees the whole sequence, as the attention does. Modules are
found by the names common architectures give them (Hugging Face Llama/Mistral/Qwen, torchtitan, GPT-NeoX
style fc1/fc2); a user's tp_plan replaces the derived one.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from fxflops.capture.module_walk import walk_modules
from fxflops.parallel.plan import repeated_blocks

COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "wq", "wk", "wv", "query", "key", "value",
                    "gate_proj", "up_proj", "w1", "w3", "fc1", "fc_in", "c_fc", "dense_h_to_4h"})
ROW = frozenset({"o_proj", "wo", "out_proj", "down_proj", "w2", "fc2", "fc_out", "dense_4h_to_h"})
NORMS = (torch.nn.LayerNorm, torch.nn.RMSNorm)
NORM_SUFFIXES = ("RMSNorm", "LayerNorm")  # a model's own norm class (LlamaRMSNorm, Qwen2RMSNorm, T5LayerNorm)
HEAD_NAMES = ("lm_head", "output")


class BlockInput(ParallelStyle):
    """The block's first input (positional, or the forward's first parameter given by name) becomes one
    DTensor, replicated over the tp ranks (from `layout`: Replicate, or Shard(1) = the sequence), which
    every column-parallel linear of the block reads: its gradient is reduced once, not once per linear.
    PrepareModuleInput does this for a fixed number of positional inputs; blocks are called both ways."""

    def __init__(self, layout: Any = None) -> None:
        super().__init__()
        self.layout = layout if layout is not None else Replicate()

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters), None)

        def hook(_: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args and isinstance(args[0], torch.Tensor):
                return (self._replicated(args[0], device_mesh), *args[1:]), kwargs
            if first in kwargs and isinstance(kwargs[first], torch.Tensor):
                return args, {**kwargs, first: self._replicated(kwargs[first], device_mesh)}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def _replicated(self, tensor: torch.Tensor, mesh: Any) -> torch.Tensor:
        if not isinstance(tensor, DTensor):
            tensor = DTensor.from_local(tensor, mesh, (self.layout,), run_check=False)
        return tensor.redistribute(mesh, (Replicate(),))


def megatron_plan(model: torch.nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """{module path: ParallelStyle} for parallelize_module; {} when no attention/MLP pair is recognized."""
    plan: dict[str, ParallelStyle] = {}
    for name, module, alias in walk_modules(model):
        if alias is not None:
            continue
        linears = {key for key, child in module.named_children() if isinstance(child, torch.nn.Linear)}
        columns, rows = sorted(linears & COLUMN), sorted(linears & ROW)
        if not columns or len(rows) != 1:
            continue
        prefix = f"{name}." if name else ""
        plan[name] = BlockInput(Shard(1) if sequence_parallel else Replicate())
        for key in columns:
            plan[prefix + key] = ColwiseParallel()
        plan[prefix + rows[0]] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False) \
            if sequence_parallel else RowwiseParallel()
    if sequence_parallel and plan:
        plan.update(_sequence_plan(model))
    return plan


def _sequence_plan(model: torch.nn.Module) -> dict[str, ParallelStyle]:
    """Norms sharded along the sequence; the embedding vocabulary-parallel with a sequence-sharded output;
    the output head reads the sequence-sharded stream and returns replicated logits."""
    plan: dict[str, ParallelStyle] = {}
    blocks = {name for name, _ in repeated_blocks(model)}
    for name, module, alias in walk_modules(model):
        if alias is None and _is_norm(module):
            plan[name] = SequenceParallel()
        elif alias is None and isinstance(module, torch.nn.Embedding) and not any(name.startswith(b + ".") for b in blocks):
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
        elif alias is None and isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in HEAD_NAMES:
            plan[name] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return plan


def _is_norm(module: torch.nn.Module) -> bool:
    """torch's norms, and a model's own (its class named ...RMSNorm / ...LayerNorm) holding only 1-D
    parameters (a scale, maybe a shift): they normalize each position alone, so they run sequence-sharded."""
    if isinstance(module, NORMS):
        return True
    params = list(module.parameters(recurse=False))
    return type(module).__name__.endswith(NORM_SUFFIXES) and not list(module.children()) and bool(params) \
        and all(p.dim() == 1 for p in params)
