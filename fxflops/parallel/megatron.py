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
style fc1/fc2, GPT-2's c_attn/c_fc/c_proj); a user's tp_plan replaces the derived one.

GPT-2 (the Megatron-LM block) differs in two ways. Its projections are transformers' Conv1D, a linear whose
weight is stored (in, out): column parallel shards the weight's dim 1, row parallel its dim 0. Its q, k
and v come from one fused projection (c_attn, output [q | k | v]) that the attention splits at its
`split_size`: the fused weight is sharded block by block, so that each rank holds its heads' q, k and v
together (as Megatron does), and the attention's width attributes become the rank's share.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from functools import partial

from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInputOutput, RowwiseParallel, SequenceParallel,
)

from fxflops.capture.module_walk import walk_modules
from fxflops.parallel.plan import repeated_blocks

COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "wq", "wk", "wv", "query", "key", "value",
                    "gate_proj", "up_proj", "w1", "w3", "fc1", "fc_in", "c_fc", "dense_h_to_4h"})
ROW = frozenset({"o_proj", "wo", "out_proj", "down_proj", "w2", "fc2", "fc_out", "dense_4h_to_h", "c_proj"})
# fused projections whose output is whole blocks side by side ([q | k | v], each the input's width), which
# the attention splits at a width attribute: sharded block by block. (GPT-NeoX's query_key_value is laid
# out head by head, (heads, 3, head_dim): a plain column shard keeps a rank's q, k, v together already.)
FUSED = frozenset({"c_attn"})
# an attention's attributes that give the fused projection's (or the heads') full width: each rank's share
WIDTH_ATTRIBUTES = ("split_size", "embed_dim", "num_heads")
NORMS = (torch.nn.LayerNorm, torch.nn.RMSNorm)
NORM_SUFFIXES = ("RMSNorm", "LayerNorm")  # a model's own norm class (LlamaRMSNorm, Qwen2RMSNorm, T5LayerNorm)
HEAD_NAMES = ("lm_head", "output")
# embeddings indexed by positions (kept whole under sequence parallelism), and the config fields of their rows
POSITION_NAMES = frozenset({"wpe", "position_embeddings", "embed_positions", "pos_embed", "pos_embedding",
                            "position_embedding"})
POSITION_ATTRIBUTES = ("n_positions", "max_position_embeddings")


class BlockInput(ParallelStyle):
    """The block's first input (positional, or the forward's first parameter given by name) becomes one
    DTensor, replicated over the tp ranks (from `layout`: Replicate, or Shard(1) = the sequence), which
    every column-parallel linear of the block reads: its gradient is reduced once, not once per linear.
    PrepareModuleInput does this for a fixed number of positional inputs; blocks are called both ways."""

    def __init__(self, layout: Any = None, local_widths: bool = False) -> None:
        super().__init__()
        self.layout = layout if layout is not None else Replicate()
        self.local_widths = local_widths  # the module splits a fused projection: its WIDTH_ATTRIBUTES / tp

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters), None)
        if self.local_widths:  # set on the capture's model, whose attributes the capture's isolation restores
            for attribute in WIDTH_ATTRIBUTES:
                value = module.__dict__.get(attribute)
                if isinstance(value, int) and not isinstance(value, bool):
                    if value % device_mesh.size():
                        raise ValueError(f"parallel plan: tp={device_mesh.size()} does not divide "
                                         f"{type(module).__name__}.{attribute}={value}; pick a tp that divides it")
                    setattr(module, attribute, value // device_mesh.size())

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


def megatron_plan(model: torch.nn.Module, sequence_parallel: bool = False,
                  loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """{module path: ParallelStyle} for parallelize_module; {} when no attention/MLP pair is recognized.
    `loss_parallel`: the output head column parallel with its logits left sharded along the vocabulary (a
    DTensor, Shard(-1)) for torch's loss_parallel() cross-entropy, as torchtitan's plan does."""
    from fxflops.parallel.experts import moe_layers

    plan: dict[str, ParallelStyle] = {}
    layers = moe_layers(model) if sequence_parallel else []  # (see moe_boundary)
    for name, module, alias in walk_modules(model):
        if alias is not None:
            continue
        linears = {key: child for key, child in module.named_children()
                   if isinstance(child, torch.nn.Linear) or is_conv1d(child)}
        columns, rows = sorted(linears.keys() & (COLUMN | FUSED)), sorted(linears.keys() & ROW)
        if not columns or len(rows) != 1:
            continue
        prefix = f"{name}." if name else ""
        fused = {key: _blocks(linears[key]) for key in columns if key in FUSED}
        # a block inside an MoE layer (a shared expert) reads the layer's gathered, replicated tokens
        sequence = sequence_parallel and not any(name.startswith(layer + ".") for layer in layers)
        plan[name] = BlockInput(Shard(1) if sequence else Replicate(), local_widths=bool(fused))
        for key in columns:
            transposed = is_conv1d(linears[key])
            plan[prefix + key] = ColumnParallel(transposed=transposed, blocks=fused.get(key, 1)) \
                if transposed or key in fused else ColwiseParallel()
        row = RowParallel if is_conv1d(linears[rows[0]]) else RowwiseParallel
        plan[prefix + rows[0]] = row(output_layouts=Shard(1), use_local_output=False) if sequence else row()
    if (sequence_parallel or loss_parallel) and plan:
        plan.update({key: style for key, style in _outer_plan(model, sequence_parallel, loss_parallel).items()
                     if not any(key.startswith(layer + ".") for layer in layers)})
    plan.update({layer: moe_boundary() for layer in layers})
    return plan


def moe_boundary() -> ParallelStyle:
    """A mixture-of-experts layer under sequence parallelism: its sequence-sharded input all-gathered into
    plain replicated tokens (the router sees every token, as in torchtitan), the layer run as under tp
    without sequence parallelism (routed experts whole on every tp rank, a shared expert column/row
    parallel with its all-reduce), its replicated output split back along the sequence (a local slice,
    no communication; an all-gather of its gradient). torchtitan reduce-scatters a partial output instead,
    which needs routed experts tensor-parallel over their hidden size or given 1/tp of the tokens: fxflops
    does not split routed experts over tp, and a partial output of replicated experts would sum them tp
    times."""
    return PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_input=True, output_layouts=(Replicate(),),
                                    desired_output_layouts=(Shard(1),), use_local_output=False)


def is_conv1d(module: torch.nn.Module) -> bool:
    """transformers' Conv1D (GPT-2, GPT-1): a linear y = x @ W + b whose weight W is stored (in, out)."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2 \
        and weight.shape[1] == getattr(module, "nf", None)


def _blocks(module: torch.nn.Module) -> int:
    """How many input-wide blocks a fused projection writes side by side (3: q, k, v; 2: a cross-attention's k, v)."""
    inputs, outputs = _widths(module)
    if outputs % inputs:
        raise ValueError(f"parallel plan: the fused projection {type(module).__name__} writes {outputs} features "
                         f"from {inputs}, not whole blocks of q, k, v; give your own tp_plan")
    return outputs // inputs


def _widths(module: torch.nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear or a Conv1D."""
    weight = module.weight
    return (int(weight.shape[0]), int(weight.shape[1])) if is_conv1d(module) else (int(weight.shape[1]), int(weight.shape[0]))


class ColumnParallel(ColwiseParallel):
    """torch's ColwiseParallel, also for transformers' Conv1D (`transposed`: the output features are the
    weight's dim 1) and for fused projections writing `blocks` blocks side by side: each block is sharded
    alone and a rank's pieces are put side by side ([q_r | k_r | v_r]), so the rank's local output is what
    the attention splits. The parameter is a DTensor sharded along the output features of the blocks so
    regrouped (its full_tensor() is that regrouped order); the work and traffic are Megatron's."""

    def __init__(self, *, transposed: bool = False, blocks: int = 1, **layouts: Any) -> None:
        super().__init__(**layouts)
        self.transposed, self.blocks = transposed, blocks

    def _partition(self, _: str, module: torch.nn.Module, device_mesh: Any) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            dim = 1 if self.transposed and param.dim() == 2 else 0  # a bias is along the output features
            tensor = _regrouped(param.detach(), dim, self.blocks, device_mesh.size())
            module.register_parameter(key, torch.nn.Parameter(
                distribute_tensor(tensor, device_mesh, [Shard(dim)], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        return distribute_module(module, device_mesh, self._partition,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class RowParallel(RowwiseParallel):
    """torch's RowwiseParallel for transformers' Conv1D: the weight (in, out) sharded along dim 0 (its input
    features), the bias replicated."""

    def _partition(self, _: str, module: torch.nn.Module, device_mesh: Any) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if param.dim() == 2 else Replicate()
            module.register_parameter(key, torch.nn.Parameter(
                distribute_tensor(param.detach(), device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh, self._partition,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def _regrouped(tensor: torch.Tensor, dim: int, blocks: int, ranks: int) -> torch.Tensor:
    """`tensor` with its `blocks` blocks along `dim` reordered so that an even split along `dim` over `ranks`
    gives rank r its r-th piece of every block: [b0_0 b0_1 | b1_0 b1_1] -> [b0_0 b1_0 | b0_1 b1_1]."""
    if blocks == 1:
        return tensor
    if tensor.shape[dim] % (blocks * ranks):
        raise ValueError(f"parallel plan: tp={ranks} does not split each of the {blocks} fused blocks of "
                         f"{tensor.shape[dim]} features evenly; pick a tp that divides {tensor.shape[dim] // blocks}")
    return tensor.unflatten(dim, (blocks, ranks, -1)).transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()


def _outer_plan(model: torch.nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The modules outside the blocks. Under sequence parallelism: norms sharded along the sequence; the token
    embedding vocabulary-parallel with a sequence-sharded output, a position embedding replicated with its
    output split (PositionEmbedding); the output head reads the sequence-sharded stream and returns
    replicated logits (vocabulary-sharded ones under loss parallelism). Under loss parallelism alone: the
    head column parallel, its logits vocabulary-sharded; a token embedding whose weight the head shares
    vocabulary-parallel (its output all-reduced, Megatron's VocabParallelEmbedding) so the tie holds."""
    plan: dict[str, ParallelStyle] = {}
    blocks = {name for name, _ in repeated_blocks(model)}
    sharded: dict[int, tuple[torch.Tensor, torch.nn.Parameter]] = {}  # the embeddings' weights: see TiedHead
    heads = [module for name, module, alias in walk_modules(model) if alias is None
             and isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in HEAD_NAMES]
    tied = {id(head.weight) for head in heads}
    for name, module, alias in walk_modules(model):
        if alias is not None:
            continue
        if sequence_parallel and _is_norm(module):
            plan[name] = SequenceParallel()
        elif isinstance(module, torch.nn.Embedding) and not any(name.startswith(b + ".") for b in blocks):
            if sequence_parallel:
                plan[name] = PositionEmbedding() if is_position_embedding(model, name, module) \
                    else VocabularyParallel(sharded)
            elif id(module.weight) in tied:
                plan[name] = VocabularyParallel(sharded, Replicate())
        elif isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in HEAD_NAMES:
            plan[name] = TiedHead(sharded, Shard(1) if sequence_parallel else Replicate(), loss_parallel)
    return plan


def is_position_embedding(model: torch.nn.Module, name: str, module: torch.nn.Embedding) -> bool:
    """An embedding indexed by positions, not tokens: named like one (GPT-2's wpe, BERT's and OPT's
    position_embeddings / embed_positions), or as many rows as the config's positions and not its vocabulary."""
    if name.rsplit(".", 1)[-1] in POSITION_NAMES:
        return True
    config = getattr(model, "config", None)
    positions = {getattr(config, key, None) for key in POSITION_ATTRIBUTES} - {None}
    return module.num_embeddings in positions and module.num_embeddings != getattr(config, "vocab_size", None)


class PositionEmbedding(ParallelStyle):
    """A position embedding under sequence parallelism, as Megatron-LM keeps it: the weight replicated on
    every tp rank (it is not vocabulary-split: its rows are positions), looked up whole, the output split
    along the sequence where it joins the sequence-sharded stream (no communication forward; its gradient
    is all-gathered back, from which each rank computes the weight's whole gradient)."""

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        def inputs(_: torch.nn.Module, args: tuple, mesh: Any) -> tuple:
            return tuple(DTensor.from_local(a, mesh, (Replicate(),), run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

        def output(_: torch.nn.Module, out: torch.Tensor, mesh: Any) -> torch.Tensor:
            return out.redistribute(mesh, (Shard(1),))

        return distribute_module(module, device_mesh, input_fn=inputs, output_fn=output)


class VocabularyParallel(RowwiseParallel):
    """A vocabulary-parallel embedding with a sequence-sharded output; records its weight as it was and as
    sharded (in `sharded`, by id) for an output head that shares it."""

    def __init__(self, sharded: dict[int, tuple[torch.Tensor, torch.nn.Parameter]], output: Any = None) -> None:
        output = Shard(1) if output is None else output
        super().__init__(input_layouts=Replicate(), output_layouts=output, use_local_output=output == Replicate())
        self.sharded = sharded

    def _partition_embedding_fn(self, name: str, module: torch.nn.Module, device_mesh: Any) -> None:
        original = module.weight
        super()._partition_embedding_fn(name, module, device_mesh)
        self.sharded[id(original)] = (original, module.weight)


class TiedHead(ColwiseParallel):
    """A column-parallel output head reading the stream as `layout` (the sequence-sharded one: Shard(1)),
    returning replicated logits, or under `loss_parallel` logits left sharded along the vocabulary (a
    DTensor, for torch's loss_parallel()). A head whose weight is the embedding's (GPT-2 ties them) keeps
    sharing it: the embedding's (vocab, hidden) shard is the head's column shard too, so the rank holds it
    once, as Megatron's shared word embedding."""

    def __init__(self, sharded: dict[int, tuple[torch.Tensor, torch.nn.Parameter]], layout: Any = None,
                 loss_parallel: bool = False) -> None:
        super().__init__(input_layouts=Shard(1) if layout is None else layout,
                         output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel)
        self.sharded = sharded

    def _partition_linear_fn(self, name: str, module: torch.nn.Module, device_mesh: Any) -> None:
        original, shard = self.sharded.get(id(module.weight), (None, None))
        if original is not module.weight:
            super()._partition_linear_fn(name, module, device_mesh)
            return
        module.register_parameter("weight", shard)
        if module.bias is not None:
            module.register_parameter("bias", torch.nn.Parameter(distribute_tensor(
                module.bias.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                requires_grad=module.bias.requires_grad))


def _is_norm(module: torch.nn.Module) -> bool:
    """torch's norms, and a model's own (its class named ...RMSNorm / ...LayerNorm) holding only 1-D
    parameters (a scale, maybe a shift): they normalize each position alone, so they run sequence-sharded."""
    if isinstance(module, NORMS):
        return True
    params = list(module.parameters(recurse=False))
    return type(module).__name__.endswith(NORM_SUFFIXES) and not list(module.children()) and bool(params) \
        and all(p.dim() == 1 for p in params)
