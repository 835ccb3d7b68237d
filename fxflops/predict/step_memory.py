"""Predicted memory per pipeline rank of a planned step: what `predict_step` reports and the plan search filters by.

One computation for both (`rank_memories`, called by `step.simulate_plan`): from one capture's per-layer costs
(`layers.LayerCosts`: parameters per layer, the bytes one layer's forward saves and each part's moments, read from
fxflops.memory's timeline of the capture) and the simulated schedule (how many micro-batch chunks each rank holds at
once), each pipeline rank's peak is the highest of the moments of its step, each the bytes alive then:

- always: the parameters and optimizer state of the layers the rank holds (tp- and ep-sharded as captured), divided
  over FSDP's shard group or, with a distributed optimizer or DeepSpeed's BF16_Optimizer, the state over dp x cp;
  FSDP's gathered parameters (two layers, the root unit), counted in `parameters` and named apart (`gathered`);
- the other micro-batches in flight: their saved bytes (one layer's times the layer-micro-batches in flight, 1F1B's
  first stage p micro-batches, GPipe all of them, interleaved as simulated; the embedding's and the head's per
  micro-batch of their chunk in flight; full recomputation keeps each layer's input, selective frees unfused
  attention's scores);
- the running micro-batch at each moment of its pass over the rank's chunk (`_moments`): the forward of the head and
  loss, of the last layer, of the embedding; the backward of the head and loss, of its last and its first layer
  (a layer's moment is a line in how many layers are done, so its highest is at one end), of the embedding: what
  it still saves (the parts before the one running; the running layer recomputed when it was) and the running
  part's excess read from the capture (`layers.part_moments`: its temporaries, the incoming gradient, the
  gradients it has made);
- the gradients that exist at that moment, as the engine keeps them (`gradient_keeping`): torch's .grad (EAGER)
  from the op that makes each (the parts done, the running part's own so far), none before the first micro-batch's
  backward, every one in a later micro-batch of the step (gradient accumulation); torch DDP's buckets all step
  beside them (DDP); Megatron-LM's and DeepSpeed's persistent buffers all step (BUFFER, the BF16_Optimizer's fp32
  gradients and bf16 .grad both); FSDP2's sharded .grad as each layer's reduce-scatter ends (SHARDED), with one
  layer's whole gradients in flight while a layer's backward runs (`unsharded_gradients`);
- the optimizer step: the gradients whole and the step's own temporaries (`_optimizer_step_temporaries`);
- the allowance beyond tensor bytes (fxflops.memory's `Allowance`: the CUDA context, NCCL's buffers), apart.

A prediction from a model of the step, not a measurement (docs/guide/predict.md states its error).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

OPTIMIZER_STATE_BYTES = 12  # Adam with fp32 master weights: master copy, first and second moments (4 B each)
# the kinds a rank's bytes are broken down by, in report order (all present on every rank, 0 where none)
MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations", "temporaries")


@dataclass(frozen=True)
class RankMemory:
    """One pipeline rank's predicted peak memory: tensor bytes by kind (`MEMORY_KINDS`) and the allowance."""

    role: str  # as the step's RankTime: "first stage", "stage 3", "last stage", "every rank"
    by_kind: dict[str, int] = field(default_factory=dict)
    allowance: int = 0  # bytes beyond tensors: the CUDA context and NCCL's buffers (fxflops.memory.Allowance)
    in_flight: int = 1  # micro-batch chunks whose activations the rank holds at once (the schedule's)
    gathered: int = 0  # of `parameters`: FSDP's gathered layers and root unit (its all-gather buffers)
    # of `gradients` at a layer's backward: one layer's whole gradients (the input of FSDP's reduce-scatter)
    unsharded_gradients: int = 0
    moment: str = ""  # when the peak is: "backward of the head and loss", "optimizer step", ... (`_moments`)
    gradients_kept: str = ""  # how the engine keeps the gradients (`gradient_keeping`)

    @property
    def tensor_bytes(self) -> int:
        return sum(self.by_kind.values())

    @property
    def total(self) -> int:
        """What the device must have free: tensor bytes and the allowance."""
        return self.tensor_bytes + self.allowance

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.role, "by_kind": dict(self.by_kind), "allowance": self.allowance,
                "in_flight": self.in_flight, "gathered": self.gathered,
                "unsharded_gradients": self.unsharded_gradients, "moment": self.moment,
                "gradients_kept": self.gradients_kept, "total": self.total}


def fits(total: int, capacity: int, margin: int = 0) -> bool:
    """Whether `total` bytes (tensors and allowance) and `margin` more kept free are within `capacity`."""
    return total + margin <= capacity


def busiest(memories: Sequence[RankMemory]) -> RankMemory:
    """The rank with the most bytes (the first of equals)."""
    return max(memories, key=lambda m: m.total)



# how an engine keeps a step's gradients (`gradient_keeping`)
EAGER = "eager"  # torch's .grad: AccumulateGrad allocates it in the backward, zero_grad(set_to_none=True) frees it
DDP = "ddp"  # torch DDP's flat bucket buffers all step, and the .grad tensors as EAGER (gradient_as_bucket_view=False)
BUFFER = "buffer"  # a persistent gradient buffer all step (Megatron-LM's DDP, DeepSpeed's engine)
SHARDED = "sharded"  # FSDP2: each layer's sharded .grad made after its reduce-scatter, freed by zero_grad


def gradient_keeping(plan: Any, bf16_optimizer: bool = False) -> str:
    """How the plan's software keeps the gradients through a step (docs/guide/memory.md, "Gradients in a planned
    step", cites the code): FSDP its sharded .grad (SHARDED); Megatron-LM's DDP (its bucketing, main_grad
    accumulation, the distributed optimizer) and DeepSpeed's engine a persistent buffer (BUFFER); torch's DDP
    (its Reducer's buckets, or replicate() per layer) over dp x cp > 1 ranks its buckets and the .grad (DDP);
    plain torch (one data-parallel rank, torch.distributed.pipelining) the .grad only (EAGER)."""
    if plan.fsdp and plan.dp * plan.cp > 1:
        return SHARDED
    if bf16_optimizer or plan.pipeline_engine == "deepspeed" or plan.grad_buckets in ("deepspeed", "megatron") \
            or plan.distributed_optimizer or plan.grad_accumulation in ("main_grad", "fused"):
        return BUFFER
    return DDP if plan.grad_group > 1 else EAGER


def rank_memories(costs: Any, plan: Any, layers: Sequence[int], timeline: Any,
                  optimizer_state_bytes: int = OPTIMIZER_STATE_BYTES, roles: Sequence[str] | None = None,
                  allowance: Any = None, bf16_optimizer: bool = False) -> list[RankMemory]:
    """Each pipeline rank's predicted peak memory (see the module's docstring). `costs`: a `LayerCosts`;
    `plan`: a `StepPlan`; `layers[r]`: the layers rank r holds; `timeline`: the simulated schedule (None: one
    micro-batch in flight); `optimizer_state_bytes`: the optimizer's state per parameter element (default Adam
    with fp32 master weights; 4 for torch's AdamW on a bf16 model, 8 on an fp32 one); `roles`: the ranks'
    names; `allowance`: an `fxflops.memory.Allowance` (default: its 0.5 GiB CUDA context); `bf16_optimizer`:
    DeepSpeed's BF16_Optimizer runs the step (`step._bf16_optimizer`; bf16_optimizer.py at DeepSpeed 56c5223,
    #1801): the fp32 master weights and Adam state its rank's 1/dp (x cp) partition, the fp32 gradients
    (`plan.grad_bytes`, 4 by default there) whole, beside the bf16 .grad of the last backward, which
    `update_hp_grads(clear_lp_grads=False)` leaves until the next backward's `clear_lp_grads`."""
    from fxflops.memory import Allowance

    allowance = allowance or Allowance()
    extra = allowance.context_bytes + allowance.collective_bytes
    p, v = plan.pp, plan.virtual_stages
    chunks = p * v
    block, pre, post = costs.block, costs.pre, costs.post
    grad_bytes = plan.grad_bytes or costs.param_bytes
    keeping = gradient_keeping(plan, bf16_optimizer)
    fsdp = keeping == SHARDED
    # FSDP shards over its shard group (all of dp x cp, or HSDP's dp_shard x cp), the distributed optimizer its
    # state over dp x cp; the experts over the ranks holding the same experts
    shard = plan.shard_group if fsdp else 1
    sharded_state = plan.distributed_optimizer or bf16_optimizer
    state_shard = shard if fsdp else plan.grad_group if sharded_state else 1
    expert_shard = plan.expert_shard_group if fsdp else 1
    expert_state_shard = expert_shard if fsdp else plan.expert_group if sharded_state else 1
    if bf16_optimizer:  # the fp32 accumulators and the bf16 .grad, both whole
        grad_bytes += costs.param_bytes
    # each model chunk's layers, as the schedule splits them (`step._split`: the first chunks take the remainder)
    base, remainder = divmod(sum(layers), chunks)
    depths = [base + (1 if c < remainder else 0) for c in range(chunks)]
    found = []
    for rank, rank_layers in enumerate(layers):
        first, last = rank == 0, rank == (chunks - 1) % p
        outside = (pre.params if first else 0) + (post.params if last else 0)
        experts = rank_layers * block.expert_params  # split ep ways already, FSDP-sharded over dp x cp / ep
        params = rank_layers * block.params + outside - experts
        local = params // shard + experts // expert_shard  # parameter elements the rank steps
        kinds = {"parameters": params * costs.param_bytes // shard + experts * costs.param_bytes // expert_shard,
                 "gradients": params * grad_bytes // shard + experts * grad_bytes // expert_shard,
                 "optimizer": params * optimizer_state_bytes // state_shard
                 + experts * optimizer_state_bytes // expert_state_shard}
        gathered = unsharded = 0
        if fsdp:  # FSDP2 keeps its root unit (what is outside the blocks) gathered from forward to backward,
            # and a layer's gradients are whole until their reduce-scatter has run (the previous layer's while the
            # next one's backward runs: FSDP2 waits for a reduce-scatter in the next post-backward)
            gathered = (2 * block.params + outside) * costs.param_bytes
            unsharded = block.params * grad_bytes
            kinds["parameters"] += gathered
        in_flight = timeline.in_flight(rank) if timeline is not None else 1
        if plan.recompute == "full":  # each layer's input kept, one layer's activations while it is recomputed
            per_layer = costs.boundary_bytes
        elif plan.recompute == "selective":  # the attention core recomputed: unfused attention's scores freed,
            # one layer's of them alive while its backward recomputes them
            per_layer = block.saved_bytes - block.attention_saved_bytes
        else:
            per_layer = block.saved_bytes
        # each model chunk's own blocks when the capture is the plan's depth and recomputation does not make every
        # layer keep the same input (blocks of one class can differ: DeepSeek-V3's dense first layers): per block its
        # bytes kept while other layers run (`per`) and its saved bytes (all alive while its backward runs)
        own_blocks = len(costs.block_saved) == sum(layers) and plan.recompute != "full"
        selective = plan.recompute == "selective"
        running_chunks = [None]  # the chunks a micro-batch's pass can run on this rank: (layers' kept, first, last)
        if own_blocks:
            chunk_blocks = [costs.block_saved[sum(depths[:c]):sum(depths[:c]) + depths[c]] for c in range(chunks)]
            chunk_bytes = [sum(b[0] - (b[1] if selective else 0) for b in blocks) for blocks in chunk_blocks]
            running_chunks = [(chunk_bytes[c], chunk_blocks[c][0], chunk_blocks[c][-1],
                               max(b[2] for b in chunk_blocks[c])) for c in range(rank, chunks, p) if chunk_blocks[c]] \
                or [None]
        if own_blocks:
            held = timeline.in_flight(rank, weights=chunk_bytes) if timeline is not None \
                else max(chunk_bytes[rank::p], default=0)
        elif timeline is not None and len(set(depths)) > 1:  # each chunk in flight by its own layers (uneven
            # chunks are not equally in flight); even ones: the chunks in flight times their depth
            held = timeline.in_flight(rank, weights=depths) * per_layer
        else:
            held = int(in_flight * (rank_layers / v) * per_layer)
        # the embedding's and the head's activations, per micro-batch of their chunk in flight (1F1B's last stage:
        # one; GPipe's: every micro-batch). Under full recomputation the first layer's kept input is the tensor the
        # embedding made, which `pre.saved_bytes` holds already (attributed to the op that made it): held once; and
        # the last layer's output, which the head's first op saves (attributed to the layer that made it), is no
        # layer's input: held beside the head's
        full = plan.recompute == "full" and rank_layers > 0
        pre_saved = (max(pre.saved_bytes - costs.boundary_bytes, 0) if full else pre.saved_bytes) if first else 0
        post_saved = (post.saved_bytes + costs.boundary_bytes if full else post.saved_bytes) if last else 0
        if first:
            held += (timeline.in_flight(rank, 0) if timeline is not None else 1) * pre_saved
        if last:
            held += (timeline.in_flight(rank, chunks - 1) if timeline is not None else 1) * post_saved
        # the micro-batch whose pass runs now, on its chunk's layers; the others' saved bytes held beside it
        chunk_layers = -(-rank_layers // v)
        block_grads = (block.params - block.expert_params) * grad_bytes // shard \
            + block.expert_params * grad_bytes // expert_shard
        whole = kinds["gradients"]
        buckets = whole if keeping == DDP else 0  # DDP's flat buckets, beside the .grad
        static = kinds["parameters"] + kinds["optimizer"]
        # the rank's two largest parameter tensors (a layer's twice when it holds two or more), as it steps them
        sizes = sorted([*block.largest_tensors * min(rank_layers, 2), *(pre.largest_tensors if first else ()),
                        *(post.largest_tensors if last else ())], reverse=True) + [0, 0]
        largest = tuple(-(-size // min(shard, expert_shard)) for size in sizes[:2])
        step_temporaries = _optimizer_step_temporaries(plan, local, costs.param_bytes, largest)
        candidates: list[tuple[int, str, int, int, int]] = []  # (total, moment, gradients, activations, temporaries)
        # the first micro-batch on the rank: its gradients made as its backward runs (none exist before it) unless
        # the engine keeps a buffer; later micro-batches (gradient accumulation) find the first one's there, with as
        # many others in flight (1F1B's steady state) or, when every micro-batch was in flight at once, one fewer
        for chunk in running_chunks:
            current = (chunk[0] if chunk else chunk_layers * per_layer) + pre_saved + post_saved
            others = max(held - current, 0)
            moments = _moments(block, pre if first else None, post if last else None, chunk_layers, per_layer,
                               pre_saved, post_saved, block_grads, (post.params * grad_bytes // shard) if last else 0,
                               chunk, selective)
            passes = [(keeping != BUFFER, others)]
            if plan.microbatches > 1:
                passes.append((False, others if plan.microbatches > in_flight else max(others - current, 0)))
            candidates += _candidates(moments, passes, static, buckets, whole, unsharded if fsdp else 0)
        candidates.append((static + buckets + whole + step_temporaries, "optimizer step", buckets + whole, 0,
                           step_temporaries))
        total, moment, gradients, activations, temporaries = max(candidates, key=lambda c: c[0])
        if temporaries < 0:  # the running micro-batch's saved bytes already freed at that moment
            activations, temporaries = activations + temporaries, 0
        kinds.update(gradients=gradients, activations=activations, temporaries=temporaries)
        found.append(RankMemory(roles[rank] if roles else f"stage {rank}", kinds, extra, in_flight, gathered,
                                unsharded if fsdp and moment.startswith("backward of a layer") else 0, moment, keeping))
    return found


def _candidates(moments: list[tuple[str, int, int, int, int, int, bool]], passes: list[tuple[bool, int]], static: int,
                buckets: int, whole: int, unsharded: int) -> list[tuple[int, str, int, int, int]]:
    """(total, moment, gradients, activations, temporaries) of each moment of a pass, for each pass: (whether it is
    the step's first micro-batch on the rank, the other micro-batches' saved bytes held beside it)."""
    found = []
    for first_pass, other in passes:
        for name, activations, done, excess, excess_held, own, backward in moments:
            if first_pass:  # (the running part's own gradients made by then are among its excess)
                gradients = buckets + (done + own if backward else 0)
                temporaries = excess - (own if backward else 0)
            else:
                gradients = buckets + whole
                temporaries = excess_held if backward else excess
            if backward and name.startswith("backward of a layer"):  # FSDP's layer gradients before reduce-scatter
                gradients += unsharded
            found.append((static + other + activations + gradients + temporaries, name, gradients,
                          other + activations, temporaries))
    return found


def _moments(block: Any, pre: Any, post: Any, layers: int, per_layer: int, pre_saved: int, post_saved: int,
             block_grads: int, post_grads: int, chunk: Any = None,
             selective: bool = False) -> list[tuple[str, int, int, int, int, int, bool]]:
    """The moments of one micro-batch's pass over a chunk of `layers` blocks (with the embedding `pre` and the head
    `post` when the chunk holds them, else None) at which its bytes can peak: (name, its saved bytes alive then,
    its other parts' gradients made by then, the part's excess with its own gradients made by then, that excess when
    the gradients exist already, the part's own gradients in the first excess, whether it is in the backward).
    Each part's excess (`layers.part_moments`) is read from the capture; a layer's moment in the backward is a line
    in how many layers are done (their saved bytes freed, their gradients made), so its highest is at the first or
    the last layer of the chunk. `chunk`: (its layers' kept bytes, its first and its last block's
    `LayerCosts.block_saved`, its blocks' highest forward excess) when its own blocks are known: the layer whose
    backward runs is that block, with its own excess; else every layer is `block` and keeps `per_layer`."""
    found = []
    below = pre_saved + (chunk[0] if chunk else layers * per_layer)
    if post is not None:
        found.append(("forward of the head and loss", below + post_saved, 0, post.forward_excess,
                      post.forward_excess, 0, False))
        found.append(("backward of the head and loss", below + post_saved, 0, post.backward_excess,
                      post.backward_excess_held, post.backward_excess_grads, True))
    if layers:
        forward_excess = chunk[3] if chunk else block.forward_excess
        found.append(("forward of a layer", below, 0, forward_excess, forward_excess, 0, False))
        for done in sorted({0, layers - 1}):  # the current layer recomputed (if it was) and all its saved alive
            if chunk:  # the last layer's scores recomputed under selective; the first layer alone left
                this = chunk[2] if done == 0 else chunk[1]
                alive = below + (this[1] if selective else 0) if done == 0 else pre_saved + this[0]
                excess, excess_held, own = this[3], this[4], this[5]
            else:
                alive = pre_saved + (layers - 1 - done) * per_layer + block.saved_bytes
                excess, excess_held, own = block.backward_excess, block.backward_excess_held, block.backward_excess_grads
            found.append((f"backward of a layer ({'the last' if done == 0 else 'the first'} of the chunk)", alive,
                          post_grads + done * block_grads, excess, excess_held, own, True))
    if pre is not None:
        found.append(("forward of the embedding", pre_saved, 0, pre.forward_excess, pre.forward_excess, 0, False))
        found.append(("backward of the embedding", pre_saved, post_grads + layers * block_grads, pre.backward_excess,
                      pre.backward_excess_held, pre.backward_excess_grads, True))
    return found


def _optimizer_step_temporaries(plan: Any, elements: int, param_bytes: int, largest: Sequence[int] = (0, 0)) -> int:
    """The most bytes the optimizer step's own temporaries hold, over `elements` parameter elements of
    `param_bytes`: torch.optim's foreach Adam / AdamW keeps `_foreach_sqrt` of every exp_avg_sq of a group (like the
    parameters; torch/optim/adam.py `_multi_tensor_adam`, which deletes its negated or weight-decayed gradient copies
    before it), the largest group's when the instance has several (each steps in its own call); its for-loop form
    (`_single_tensor_adam`) one parameter at a time `denom = (exp_avg_sq.sqrt() / ...).add_(eps)`, the sqrt and the
    quotient alive together while the previous parameter's `denom` is still bound, and under maximize or Adam's
    (coupled) weight decay that parameter's gradient copy beside them: at most twice (three times) the largest of
    `largest` (the rank's two largest parameter tensors' elements) and the second; the fused form none, nor
    fxflops' default fused mixed-precision kernel (`optimizer_kernels` None). torch's SGD (torch/optim/sgd.py): under
    weight decay or maximize the foreach form a copy of every gradient to the step's end, the for-loop form one
    parameter's (with nesterov's `grad.add(buf)`, two at once), the fused form none."""
    kernels = plan.optimizer_kernels
    if kernels is None:
        return 0
    groups = kernels.groups or ((1.0, 1.0, kernels),)
    found = [0]
    for share, _, group in groups:
        if group.optimizer not in ("adam", "adamw"):
            continue
        if group.implementation == "foreach":
            found.append(int(share * elements) * param_bytes)
        elif group.implementation == "for_loop":
            copies = 3 if any(p.op in ("neg(grad)", "add(grad, param)") for p in group.passes) else 2
            found.append((copies * largest[0] + largest[1]) * param_bytes)
    for share, _, group in groups:
        if group.optimizer != "sgd" or group.implementation not in ("foreach", "for_loop"):
            continue
        ops = {p.op for p in group.passes}
        maximize, decay = "neg(grad)" in ops, "add(grad, param)" in ops
        if group.implementation == "foreach":  # the negated / weight-decayed copy of every gradient, to the end
            found.append(int(share * elements) * param_bytes if maximize or decay else 0)
        else:  # one parameter's copies, two at once at most (`grad.add(...)` beside the copy it reads), and under
            # maximize the previous parameter's while `-grads[i]` is made
            copies = min(int(maximize) + int(decay) + int("add_(grad, momentum_buffer)" in ops), 2)
            found.append((copies * largest[0] + (largest[1] if maximize else 0)) * param_bytes)
    return max(found)
