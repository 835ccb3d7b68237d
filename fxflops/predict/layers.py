"""One rank's work per micro-batch, read from one capture as per-layer costs: what a step's simulation needs.

A model's repeated blocks (its transformer layers) run the same ops, so one capture under a tensor-parallel
degree (and sequence parallelism) tells the time, FLOPs, collectives, parameters and saved activations of
one layer, and of what runs before the first layer (the embedding: the first pipeline stage carries it)
and after the last (final norm, output head, loss: the last stage carries them). Every pipeline depth,
virtual-stage split, data-parallel degree and recomputation choice is then derived from these numbers
without capturing again; a model built at a shallower depth (the same blocks, fewer of them) gives the
same per-layer numbers, which is how the plan search stays fast.

Times are predicted: each node by `op_time.node_seconds`, each collective by `comm_time`.

Each captured collective is classified by what issued it (`collective_kind`): the data-parallel wrapper
(FSDP2's fully_shard or replicate, which call torch's in-place c10d collectives; the step simulation models
these itself from the parameter counts, so they are left out here), context parallelism's ring attention
(fxflops.parallel.context: the keys and values all-gathered in the module that runs attention, their
gradients reduce-scattered), expert dispatch (fxflops.parallel.experts: all-to-alls issued in an `experts`
module) or tensor parallelism (DTensor's collectives: the rest). A capture under cp or ep also applies FSDP
(over dp x cp, or over the dp ranks ep borrows), so the per-module parameter counts it reports are FSDP
shards: `fsdp_shard` / `expert_shard` undo that factor, giving the parameters a rank holds before FSDP.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fxflops.parallel.plan import repeated_blocks
from fxflops.predict.comm_time import collective_record_seconds
from fxflops.predict.hardware import Cluster
from fxflops.predict.op_time import FLASH, GEMM, NONE, Kernels, gemm_shape, node_seconds, node_times, op_kind
from fxflops.results import BACKWARD, FORWARD

TP, DP, CP, EP = "tp", "dp", "cp", "ep"  # what issued a collective (collective_kind)
PRE = "pre"  # before the first block: the embedding
POST = "post"  # after the last block: final norm, output head, loss


@dataclass(frozen=True)
class Part:
    """Costs of one part of the model (one block, or what runs before / after the blocks) for one micro-batch
    on one rank: seconds predicted per pass, FLOPs counted per pass, parameters held."""

    forward: float = 0.0  # s, compute of the forward's ops
    backward: float = 0.0  # s, compute of the backward's ops
    comm_forward: float = 0.0  # s, collectives in the forward (tensor parallel: on the critical path)
    comm_backward: float = 0.0
    attention_forward: float = 0.0  # s, the attention kernels of the forward (selective recomputation)
    forward_flops: int = 0
    backward_flops: int = 0
    attention_flops: int = 0  # FLOPs of those attention kernels
    params: int = 0  # parameter elements this rank holds of the part (sharded by tp and ep, not by FSDP)
    expert_params: int = 0  # of `params`, those in experts (FSDP shards them over dp / ep ranks, not dp)
    # trainable parameter tensors of the part (a tensor shared with another part once, where registered first):
    # the optimizer's kernel launches (`optimizer_time`: multi-tensor launches hold at most so many tensors, the
    # loop launches per tensor); FSDP and tp shard each tensor, so a rank holds as many
    tensors: int = 0
    # s, context parallelism's ring-attention collectives (k/v all-gather; dk/dv reduce-scatter), whole;
    # the part of them not hidden behind attention compute is in comm_forward / comm_backward
    cp_comm_forward: float = 0.0
    cp_comm_backward: float = 0.0
    # s, expert dispatch all-to-alls (token counts, tokens out and back); all of it in comm_forward/backward
    ep_comm_forward: float = 0.0
    ep_comm_backward: float = 0.0
    # s of comm_forward / comm_backward that overlapping each tensor-parallel collective with the GEMMs it feeds
    # or follows would save (`tp_overlap_seconds`); subtracted only under tp_comm_overlap
    tp_overlap_forward: float = 0.0
    tp_overlap_backward: float = 0.0
    saved_bytes: int = 0  # activation bytes the forward leaves for the backward
    kernels: int = 0  # ops counted (forward + backward)
    # of `saved_bytes`, the (batch, heads, query, key) tensors unfused attention keeps for its backward
    # (`unfused_attention_saved_bytes`; 0 under a fused kernel): what selective recomputation frees
    attention_saved_bytes: int = 0
    # of `params`, the weights of Linear modules: their gradient is a GEMM's output (what Megatron-LM's
    # gradient_accumulation_fusion accumulates inside that GEMM; `step._accumulation`)
    gemm_weight_params: int = 0
    # the part's moments in the capture's memory timeline (`part_moments`): the most bytes alive while one of its
    # ops runs beyond what stays saved for the backward (the parts before it and its own `saved_bytes`): in its
    # forward; in its backward with the gradients it makes counted from when they are made (torch's .grad, freed
    # by zero_grad(set_to_none=True)); in its backward when the gradients exist already (a persistent buffer, or a
    # later micro-batch's), only the gradient an op is making counted (it is added into the buffer and freed)
    forward_excess: int = 0
    backward_excess: int = 0
    backward_excess_held: int = 0
    backward_excess_grads: int = 0  # of `backward_excess`, the part's own gradients made by then
    # elements of the part's two largest parameter tensors this rank holds before FSDP, each bounded by a module's own
    # parameters (a Linear's weight and bias as one): what torch.optim's for-loop step holds temporaries of
    # (`step_memory._optimizer_step_temporaries`)
    largest_tensors: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class LayerCosts:
    """One rank's work for one micro-batch under a tensor-parallel degree: a block (the mean of the captured
    blocks) and the parts before and after the blocks."""

    tp: int
    sequence_parallel: bool
    micro_batch: int
    tokens: int  # tokens per micro-batch (batch x sequence)
    layers: int  # the model's depth these costs stand for
    block: Part
    pre: Part
    post: Part
    boundary_bytes: int  # activation bytes one pipeline stage hands the next per micro-batch
    param_bytes: int  # bytes per parameter element (the model's dtype)
    dtype: str
    device: str
    captured_layers: int  # depth of the model that was captured
    notes: tuple[str, ...] = ()
    # temporaries alive at the capture's memory peak (workspaces of the op running there, gradients in flight
    # between ops), for the record: the memory per rank reads each part's own moments instead (`Part`'s excesses)
    transient_bytes: int = 0
    # the capture ran under FSDP (cp / ep captures): FSDP2's own copies (all-gather copy-in and copy-out, the
    # reduce-scatter's chunk_cat) are among its ops already, so the step does not add them again
    fsdp_in_capture: bool = False
    # one block's gradients in the order its backward makes them (its modules' own parameter elements, in reverse
    # registration order, before FSDP), each with whether it is in the experts: DDP's buckets are filled so
    block_gradients: tuple[tuple[int, bool], ...] = ()
    # the capture read the memory timeline (memory=True): saved_bytes and transient_bytes are known, so a step's
    # memory per rank can be predicted from these costs
    memory_captured: bool = True
    # each captured block's (saved_bytes, attention_saved_bytes, forward_excess, backward_excess,
    # backward_excess_held, backward_excess_grads), in model order: blocks of one class can differ (DeepSeek-V3's
    # dense first layers), so a pipeline rank holds its own blocks' bytes, not the mean's (`Part`)
    block_saved: tuple[tuple[int, ...], ...] = ()

    @property
    def params(self) -> int:
        """Parameter elements of one tp rank of the whole model."""
        return self.layers * self.block.params + self.pre.params + self.post.params

    @property
    def param_tensors(self) -> int:
        """Trainable parameter tensors of one tp rank of the whole model (0: unknown)."""
        return self.layers * self.block.tensors + self.pre.tensors + self.post.tensors

    def at_depth(self, layers: int) -> LayerCosts:
        """The same costs standing for a model of `layers` blocks."""
        return dataclasses.replace(self, layers=layers)


def layer_costs(estimate: Any, model: torch.nn.Module, cluster: Cluster, dtype: torch.dtype,
                ranks_per_node: Callable[[str], int], tp: int = 1, sequence_parallel: bool = False,
                micro_batch: int = 1, tokens: int = 0, layers: int | None = None, fsdp_shard: int = 1,
                expert_shard: int = 1, cp: int = 1, ep: int = 1, kernels: Kernels = FLASH) -> LayerCosts:
    """Per-layer costs from an estimate of `model` (backward=True; memory=True for the saved activations).

    `ranks_per_node(kind, group_desc)` says how many ranks of a collective's group share a node (the plan's
    placement; `kind` from `collective_kind`); `layers` is the depth the costs stand for (default: the captured
    model's). `fsdp_shard` / `expert_shard`: the FSDP degree the capture sharded the parameters outside / inside
    the experts over (1: no FSDP in the capture), undone in the parameter counts. `cp` / `ep`: the capture's
    context / expert parallel degrees (a collective is ring attention's or the expert dispatch's only when its
    degree is above 1: a tp-only capture's one group is the default one, and sequence parallelism's all-gather
    is issued in the attention module too). `kernels`: what the run's software launches where the ops do not say
    it (`op_time.Kernels`: fused or unfused attention)."""
    blocks = [name for name, _ in repeated_blocks(model)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no repeated blocks (a ModuleList of same-class layers): "
                         "a step prediction splits the model into layers; give a model built from such blocks")
    device = cluster.device
    of_module = _part_of(blocks)
    nodes = list(estimate.nodes)
    # what runs before the first block goes with the embedding; a module seen there keeps its backward there
    first_block = next((i for i, n in enumerate(nodes) if n.phase == FORWARD and of_module(n.module) >= 0), len(nodes))
    pre_nodes = {n.name for n in nodes[:first_block] if n.phase == FORWARD}
    pre_modules = {nodes[i].module for i in range(first_block) if nodes[i].module}
    forward_part: dict[str, str] = {}

    def part(node: Any) -> int | str:
        index = of_module(node.module)
        if index >= 0:
            return index
        if node.phase == FORWARD:
            where = PRE if node.name in pre_nodes else POST
            forward_part[node.name] = where
            return where
        if node.differentiates in forward_part:
            return forward_part[node.differentiates]
        return PRE if node.module in pre_modules else POST

    sums: dict[Any, dict[str, float]] = {}
    times: list[float] = []
    linear_weights: set[str] = set()  # Linear modules whose weight is counted in gemm_weight_params
    for index, (node, timing) in enumerate(zip(nodes, node_times(nodes, device, dtype, kernels))):
        key = part(node)
        seconds = timing.seconds
        entry = sums.setdefault(key, {})
        if accumulate_grad_copy(nodes, index):
            # the capture's AccumulateGrad copy, which a real step does not run (see `accumulate_grad_copy`): not
            # timed; the step times each engine's own gradient accumulation (`step._accumulation`)
            times.append(0.0)
            continue
        times.append(seconds)
        weight = _linear_weight(node)
        if weight and node.module not in linear_weights:
            linear_weights.add(node.module)
            _add(entry, "gemm_weight_params", weight)
        forward = node.phase == FORWARD
        _add(entry, "forward" if forward else "backward", seconds)
        _add(entry, "forward_flops" if forward else "backward_flops", node.flops)
        _add(entry, "kernels", 1 if node.status == "counted" else 0)
        if forward and _is_attention(node.op):
            _add(entry, "attention_forward", seconds)
            _add(entry, "attention_flops", node.flops)
    by_name = {n.name: n for n in nodes}
    position = {n.name: i for i, n in enumerate(nodes)}
    experts = _expert_paths(model)
    attention_modules = {n.module for n in nodes if n.phase == FORWARD and _is_attention(n.op)} if cp > 1 else set()
    dispatching = experts if ep > 1 else ()
    collective_nodes = {record.node for record in estimate.collectives}
    claimed: set[int] = set()  # GEMMs already overlapped with a collective
    fed: dict[str, set[str]] = {}  # a forward all-gather's module: the modules of the GEMMs its output feeds
    for record in estimate.collectives:
        kind = collective_kind(record, dispatching, attention_modules)
        if kind == DP:  # FSDP / DDP: the step simulation models them from the parameter counts
            continue
        node = by_name.get(record.node)
        key = part(node) if node is not None else of_module(record.module)
        key = POST if key == -1 else key
        seconds = collective_record_seconds(record, cluster, ranks_per_node(kind, record.group_desc))
        phase = "forward" if record.phase == FORWARD else "backward"
        entry = sums.setdefault(key, {})
        exposed = seconds
        if kind == CP:
            _add(entry, f"cp_comm_{phase}", seconds)
            if phase == "forward":  # torch's ring: the gather overlaps step 0, attention on the rank's own keys
                exposed = max(0.0, seconds - _next_attention_seconds(nodes, position.get(record.node), record.module,
                                                                     device, dtype, kernels))
        elif kind == EP:
            _add(entry, f"ep_comm_{phase}", seconds)
        elif record.node in position:
            gemms = _overlapped_gemms(nodes, times, position[record.node], record.op, collective_nodes, claimed,
                                      max(tokens // max(cp, 1), 1), fed)
            _add(entry, f"tp_overlap_{phase}", tp_overlap_seconds(seconds, gemms, cluster.tp_overlap_gemm_slowdown))
        _add(entry, f"comm_{phase}", exposed)
    params = _params(estimate, of_module, pre_modules, experts, fsdp_shard, expert_shard)
    tensors = _tensors(model, of_module, pre_modules, experts, ep)
    largest = _largest_tensors(estimate, of_module, pre_modules, experts, fsdp_shard, expert_shard)
    gradients = _block_gradients(estimate, of_module, experts, fsdp_shard, expert_shard)
    memory = getattr(estimate, "memory", None)
    saved = {}
    if memory is not None:
        # by the op that made them (its part: a block, or before / after the blocks, the model's own forward running
        # ops on both sides), else by the module
        made = {name: size for name, size in memory.saved_by_node.items() if name in by_name}
        module_of = {point.node: point.module for point in memory.timeline}
        by_module: dict[str, int] = {}
        for name, size in memory.saved_by_node.items():
            if name not in made:
                module = module_of.get(name, "")
                by_module[module] = by_module.get(module, 0) + size
        for name, size in made.items():
            key = part(by_name[name])
            saved[key] = saved.get(key, 0) + size
        for name, size in (by_module if memory.saved_by_node else memory.saved_by_module).items():
            key = of_module(name)
            key = key if key >= 0 else (PRE if name in pre_modules else POST)
            saved[key] = saved.get(key, 0) + size
    element = torch.empty((), dtype=dtype).element_size()
    unfused: dict[Any, int] = {}
    # the capture's one attention op saves no scores: unfused kernels keep them, added to the block's activations
    if kernels.attention == "math" and memory is not None:
        for node in nodes:
            if node.phase == FORWARD and _is_attention(node.op) and "flex" not in node.op \
                    and "backward" not in node.op.lower():
                key = part(node)
                unfused[key] = unfused.get(key, 0) + unfused_attention_saved_bytes(node, element,
                                                                                   kernels.attention_dropout)
    count = len(blocks)
    moments = part_moments(memory, by_name, part, saved, count) if memory is not None else {}
    for key, size in unfused.items():  # the scores are saved beside what the capture's timeline holds
        saved[key] = saved.get(key, 0) + size
    block_moments = {name: max((moments[i][index] for i in range(count) if i in moments), default=0)
                     for index, name in enumerate(_MOMENTS)}
    worst = max((moments[i] for i in range(count) if i in moments), key=lambda m: m[1], default=None)
    if worst is not None:  # the own gradients inside the highest backward excess: that block's
        block_moments["backward_excess_grads"] = worst[3]
    block = Part(**block_moments, **{f: _mean(sums, range(count), f) for f in _SECONDS},
                 **{f: int(round(_mean(sums, range(count), f))) for f in ("forward_flops", "backward_flops",
                                                                           "attention_flops", "kernels")},
                 params=params["block"], expert_params=params["experts"], tensors=tensors["block"],
                 largest_tensors=largest["block"],
                 gemm_weight_params=int(round(_mean(sums, range(count), "gemm_weight_params"))),
                 saved_bytes=int(round(sum(saved.get(i, 0) for i in range(count)) / count)),
                 attention_saved_bytes=int(round(sum(unfused.get(i, 0) for i in range(count)) / count)))
    pre = dataclasses.replace(_whole(sums.get(PRE, {}), params[PRE], saved.get(PRE, 0)), tensors=tensors[PRE],
                              largest_tensors=largest[PRE],
                              **dict(zip(_MOMENTS, moments.get(PRE, (0, 0, 0, 0)))))
    post = dataclasses.replace(_whole(sums.get(POST, {}), params[POST], saved.get(POST, 0)), tensors=tensors[POST],
                               largest_tensors=largest[POST],
                               **dict(zip(_MOMENTS, moments.get(POST, (0, 0, 0, 0)))))
    boundary = _boundary_bytes(nodes, of_module, element)
    notes: list[str] = []
    transient = memory.by_kind.get("temporaries", 0) if memory is not None else 0
    return LayerCosts(tp, sequence_parallel, micro_batch, tokens, layers or count, block, pre, post, boundary, element,
                      str(dtype).removeprefix("torch."), device.name, count, tuple(notes), transient,
                      fsdp_in_capture=fsdp_shard > 1 or expert_shard > 1, block_gradients=gradients,
                      memory_captured=memory is not None,
                      block_saved=tuple((saved.get(i, 0), unfused.get(i, 0), *moments.get(i, (0, 0, 0, 0)))
                                        for i in range(count)))


_MOMENTS = ("forward_excess", "backward_excess", "backward_excess_held", "backward_excess_grads")


def part_moments(memory: Any, by_name: dict[str, Any], part: Callable[[Any], int | str], saved: dict[Any, int],
                 count: int) -> dict[Any, tuple[int, int, int, int]]:
    """Part (block index, PRE, POST) -> its (forward_excess, backward_excess, backward_excess_held,
    backward_excess_grads), read from the
    capture's memory timeline (`Part`): at each op of a part, the activation and temporary bytes alive less what the
    parts before it (in the forward's order) and the part itself save for the backward, which are all alive then;
    in the backward, plus the gradients made since the part's backward began (they stay), or, held, plus only those
    the op itself made. A step of any depth or pipeline split is then composed from these (`step_memory`)."""
    order = [PRE, *range(count), POST]
    before: dict[Any, int] = {}
    running = 0
    for key in order:
        before[key] = running
        running += saved.get(key, 0)
    found: dict[Any, list[int | None]] = {}
    grads_before: dict[Any, int] = {}
    key: Any = PRE
    grads = 0
    for point in memory.timeline:
        node = by_name.get(point.node)
        if point.phase in ("start", "optimizer step"):
            grads = point.by_kind.get("gradients", 0)
            continue
        if node is not None:
            key = part(node)
        kinds = point.by_kind
        alive = kinds.get("activations", 0) + kinds.get("temporaries", 0) - before[key] - saved.get(key, 0)
        made = kinds.get("gradients", 0)
        entry = found.setdefault(key, [None, None, None, 0])
        if point.phase == FORWARD:
            entry[0] = alive if entry[0] is None else max(entry[0], alive)
        else:
            since = made - grads_before.setdefault(key, grads)
            if entry[1] is None or alive + since > entry[1]:
                entry[1], entry[3] = alive + since, since
            this_op = alive + max(0, made - grads)
            entry[2] = this_op if entry[2] is None else max(entry[2], this_op)
        grads = made
    return {key: tuple(value or 0 for value in entry) for key, entry in found.items()}  # type: ignore[misc]


def _part_of(blocks: list[str]) -> Callable[[str], int]:
    """module name -> the index of the block it is in, or -1."""
    index = {name: i for i, name in enumerate(blocks)}
    cache: dict[str, int] = {}

    def of(module: str) -> int:
        found = cache.get(module)
        if found is None:
            found = -1
            name = module
            while name:
                if name in index:
                    found = index[name]
                    break
                name = name.rpartition(".")[0]
            cache[module] = found
        return found

    return of


def accumulate_grad_copy(nodes: list[Any], index: int) -> bool:
    """Whether nodes[index] is the capture's AccumulateGrad copy of a leaf's gradient into a new .grad (a backward
    copy_ into the tensor new_empty_strided made just before, differentiating no forward op), which a real step
    does not run: torch's AccumulateGrad (torch/csrc/autograd/functions/accumulate_grad.h, accumulateGrad) keeps
    the incoming gradient itself as .grad when nothing else holds it and it has the parameter's layout (what the
    capture's record, holding every value, never sees), and adds it in place (`variable_grad += new_grad`) once
    .grad exists; `fxflops.memory.timeline.stolen_grads` takes the copy so for the memory. A gradient made in
    another layout than its parameter's is copied by a real step too: not told apart here (Linear, LayerNorm and
    Embedding make theirs in the parameter's)."""
    node = nodes[index]
    return node.phase != FORWARD and node.op == "aten.copy_.default" and node.differentiates is None \
        and index > 0 and nodes[index - 1].op == "aten.new_empty_strided.default" \
        and nodes[index - 1].phase != FORWARD


def _linear_weight(node: Any) -> int:
    """Elements of the weight (this rank's shard) a Linear module's forward GEMM multiplies by: linear's and mm's
    second operand, addmm's third (the weight or its transpose), 0 for any other op."""
    operand = _WEIGHT_OPERAND.get(node.op)
    if node.phase != FORWARD or operand is None or not (node.module_type or "").endswith("Linear") \
            or len(node.input_shapes) <= operand:
        return 0
    return math.prod(node.input_shapes[operand])


_WEIGHT_OPERAND = {"aten.linear.default": 1, "aten.mm.default": 1, "aten.addmm.default": 2}


def _add(entry: dict[str, float], key: str, value: float) -> None:
    entry[key] = entry.get(key, 0.0) + value


def _mean(sums: dict[Any, dict[str, float]], keys: range, field: str) -> float:
    return sum(sums.get(k, {}).get(field, 0.0) for k in keys) / len(keys)


_SECONDS = ("forward", "backward", "comm_forward", "comm_backward", "attention_forward", "cp_comm_forward",
            "cp_comm_backward", "ep_comm_forward", "ep_comm_backward", "tp_overlap_forward", "tp_overlap_backward")


def tp_overlap_seconds(comm: float, gemm: float, slowdown: float = 1.0) -> float:
    """Seconds saved by running a tensor-parallel collective of `comm` s beside GEMMs of `gemm` s on another
    stream (Megatron-LM's --tp-comm-overlap, torchtitan's async TP): the pair takes max(comm, gemm x slowdown)
    instead of comm + gemm (`slowdown`: the GEMMs' time multiplier while they share the SMs, 1: none)."""
    return comm + gemm - max(comm, gemm * slowdown)


def _overlapped_gemms(nodes: list[Any], times: list[float], index: int, op: str, collectives: set[str],
                      claimed: set[int], tokens: int = 0, fed: dict[str, set[str]] | None = None) -> float:
    """Seconds of the GEMMs a tensor-parallel collective overlaps with: an all-gather the GEMMs right after it
    (those it feeds: q, k and v projections of one gathered input), a reduce-scatter or all-reduce the GEMMs
    right before it (those it follows), in the same pass; views and the collective's own layout copy (a `cat`
    in its module) lie between, any other op ends the run. A reduce-scatter of the backward (the input gradient
    of the column-parallel linears a forward all-gather fed) overlaps instead the weight-gradient GEMMs of those
    linears: Transformer Engine's bulk overlap, which runs that reduce-scatter beside the linear's wgrad GEMM
    (TE's ub_bulk_wgrad, BULK_OVERLAP_RS in LayerNormLinear's backward; Megatron-Core's tp_comm_bulk_wgrad, on by
    default with --tp-comm-overlap, model_parallel_config.py and arguments.py of core_r0.8.0), and Megatron's own
    ColumnParallelLinear under sequence parallelism (its async reduce-scatter of the input gradient beside the
    wgrad GEMM). `fed` (forward all-gather's module -> the modules of the GEMMs it claimed) is filled by the
    forward all-gathers and read by the backward reduce-scatter issued in the same module; a weight-gradient GEMM
    reduces over the micro-batch's `tokens` (its K), an input-gradient GEMM, which makes what the reduce-scatter
    sends, over the output features. A GEMM overlaps one collective at most."""
    phase, module = nodes[index].phase, nodes[index].module
    if op == "reduce_scatter" and phase == BACKWARD and tokens:
        return _wgrad_gemms_before(nodes, times, index, collectives, claimed, tokens, (fed or {}).get(module))
    step = 1 if op == "all_gather" else -1
    found = 0.0
    i = index + step
    while 0 <= i < len(nodes) and nodes[i].phase == phase and nodes[i].name not in collectives:
        kind = op_kind(nodes[i])
        if kind == GEMM:
            if i not in claimed:
                claimed.add(i)
                found += times[i]
                if op == "all_gather" and phase == FORWARD and fed is not None:
                    fed.setdefault(module, set()).add(nodes[i].module)
        elif not (kind == NONE or (not found and "cat" in nodes[i].op and _under(nodes[i].module, module))):
            break
        i += step
    return found


def _wgrad_gemms_before(nodes: list[Any], times: list[float], index: int, collectives: set[str], claimed: set[int],
                        tokens: int, modules: set[str] | None) -> float:
    """Seconds of the weight-gradient GEMMs (K = `tokens`) of `modules` (the linears the reduce-scatter's forward
    all-gather fed; None: not known, any module) between a backward reduce-scatter and the pass's previous
    collective, each claimed. The walk stops at a GEMM another collective claimed: the linear before those (a
    row-parallel one, whose gradient an all-gather brought) ran its wgrad before the reduce-scatter's payload was
    made, so it cannot hide it."""
    phase = nodes[index].phase
    found = 0.0
    i = index - 1
    while i >= 0 and nodes[i].phase == phase and nodes[i].name not in collectives:
        if op_kind(nodes[i]) == GEMM:
            if i in claimed:
                break
            if gemm_shape(nodes[i])[2] == tokens and (modules is None or nodes[i].module in modules):
                claimed.add(i)
                found += times[i]
        i -= 1
    return found


def collective_kind(record: Any, expert_paths: tuple[str, ...], attention_modules: set[str]) -> str:
    """What issued a captured collective: DP (FSDP2's fully_shard / replicate, the only callers of torch's
    in-place c10d ops: "c10d._allgather_base_", ...; DTensor, ring attention and the expert dispatch call the
    functional collectives), EP (an all-to-all issued inside an `experts` module), CP (an all-gather or
    reduce-scatter issued in a module that runs attention, on a group that is not the tensor-parallel mesh
    dimension: ring attention's keys and values) or TP (the rest: DTensor's redistributions)."""
    if record.target.startswith("c10d."):
        return DP
    if record.op == "all_to_all" and any(_under(record.module, path) for path in expert_paths):
        return EP
    if record.op in ("all_gather", "reduce_scatter") and record.module in attention_modules \
            and record.group_desc != "mesh_tp":
        return CP
    return TP


def _under(module: str, path: str) -> bool:
    return module == path or module.startswith(path + ".")


def _expert_paths(model: torch.nn.Module) -> tuple[str, ...]:
    from fxflops.parallel.experts import moe_layers

    return tuple(f"{layer}.experts" if layer else "experts" for layer in moe_layers(model))


def _next_attention_seconds(nodes: list[Any], start: int | None, module: str, device: Any, dtype: torch.dtype,
                            kernels: Kernels = FLASH) -> float:
    """Predicted seconds of the first forward attention kernel of `module` after node `start`: ring attention's
    step 0 (the rank's queries against its own keys), which runs while the keys and values are gathered."""
    if start is None:
        return 0.0
    for node in nodes[start + 1:]:
        if node.phase == FORWARD and node.module == module and _is_attention(node.op):
            return node_seconds(node, device, dtype, kernels)
    return 0.0


def _whole(entry: dict[str, float], params: int, saved: int) -> Part:
    floats = {f: entry.get(f, 0.0) for f in _SECONDS}
    ints = {f: int(entry.get(f, 0)) for f in ("forward_flops", "backward_flops", "attention_flops", "kernels")}
    return Part(**floats, **ints, params=params, saved_bytes=saved,
                gemm_weight_params=int(entry.get("gemm_weight_params", 0)))


def unfused_attention_saved_bytes(node: Any, element: int, dropout: float = 0.0) -> int:
    """Bytes unfused attention keeps for the backward of one captured forward attention op, beyond what the
    fused op saves: the probabilities P (batch x heads x query x key elements, read by softmax's backward and
    by P V's), and with `dropout` > 0 its one-byte mask and the dropped probabilities (P V's input), as
    torch's math SDPA backend and Megatron-LM's CoreAttention keep them (Korthikanti et al. 2022, Sec. 4.1:
    5 a s^2 b bytes in 2-byte elements). The scores Q K^T are not kept (the softmax's backward reads its
    output). 0 for an op whose query, key and value are not three 4-D tensors."""
    from fxflops.predict.op_time import attention_dims

    dims = attention_dims(node)
    if dims is None:
        return 0
    groups, lq, lk, _, _ = dims
    per_pair = element + (element + 1 if dropout > 0 else 0)
    return groups * lq * lk * per_pair


def _is_attention(op: str) -> bool:
    return "attention" in op or "flash" in op


def _params(estimate: Any, of_module: Callable[[str], int], pre_modules: set[str], experts: tuple[str, ...] = (),
            fsdp_shard: int = 1, expert_shard: int = 1) -> dict[str, int]:
    """Parameter elements this rank holds before FSDP (the capture's own count: local shards under tp and ep, a
    shared parameter once; FSDP's shards times its degree, `expert_shard` inside the experts, `fsdp_shard`
    elsewhere): in the largest block (and of those, in its experts; blocks of one class can differ, as DeepSeek-V3's
    dense first layers and its MoE ones: a layer is counted as the largest, never under), before the blocks and after
    them."""
    found = {"block": 0, "experts": 0, PRE: 0, POST: 0}
    blocks: dict[int, list[int]] = {}  # block index -> [its parameter elements, of them in experts]
    for name, own in _own_params(estimate):
        expert = any(_under(name, path) for path in experts)
        own *= expert_shard if expert else fsdp_shard
        index = of_module(name)
        if index >= 0:
            entry = blocks.setdefault(index, [0, 0])
            entry[0] += own
            entry[1] += own if expert else 0
        else:
            found[PRE if name in pre_modules else POST] += own
    found["block"], found["experts"] = max(blocks.values(), default=[0, 0])
    return found


def _tensors(model: torch.nn.Module, of_module: Callable[[str], int], pre_modules: set[str],
             experts: tuple[str, ...] = (), ep: int = 1) -> dict[str, int]:
    """Trainable parameter tensors (requires_grad; a shared one once, with the module registering it first, as
    model.parameters() yields it) one rank holds in the first block, before the blocks and after them: the tensors
    an optimizer over model.parameters() steps. Under ep a ModuleList of experts is split ep ways (each rank holds
    experts / ep of them); grouped expert weights are sliced, as many tensors on every rank."""
    found = {"block": 0.0, PRE: 0.0, POST: 0.0}
    split = tuple(path for path in experts if ep > 1 and isinstance(model.get_submodule(path), torch.nn.ModuleList))
    seen: set[int] = set()
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            index = of_module(name)
            share = 1 / ep if any(_under(name, path) for path in split) else 1.0
            if index == 0:
                found["block"] += share
            elif index < 0:
                found[PRE if name in pre_modules else POST] += share
    return {key: math.ceil(count - 1e-9) for key, count in found.items()}


def _largest_tensors(estimate: Any, of_module: Callable[[str], int], pre_modules: set[str],
                     experts: tuple[str, ...] = (), fsdp_shard: int = 1,
                     expert_shard: int = 1) -> dict[str, tuple[int, int]]:
    """The two largest parameter tensors this rank holds before FSDP in any block, before the blocks and after
    them (`Part.largest_tensors`), each bounded by a module's own parameter elements (as `_params` counts them)."""
    found: dict[str, list[int]] = {"block": [], PRE: [], POST: []}
    for name, own in _own_params(estimate):
        own *= expert_shard if any(_under(name, path) for path in experts) else fsdp_shard
        index = of_module(name)
        if index >= 0:  # any block's (blocks of one class can differ in size)
            found["block"].append(own)
        elif index < 0:
            found[PRE if name in pre_modules else POST].append(own)
    return {key: tuple((sorted(sizes, reverse=True) + [0, 0])[:2]) for key, sizes in found.items()}  # type: ignore[misc]


def _own_params(estimate: Any) -> list[tuple[str, int]]:
    """(module, parameter elements it holds itself, not in its children), for the modules holding some, in the
    estimate's module order (registration order)."""
    modules = estimate.modules
    own = [(name, stats.params - sum(modules[child].params for child in stats.children if child in modules))
           for name, stats in modules.items()]
    return [(name, count) for name, count in own if count > 0]


def _block_gradients(estimate: Any, of_module: Callable[[str], int], experts: tuple[str, ...], fsdp_shard: int,
                     expert_shard: int) -> tuple[tuple[int, bool], ...]:
    """The first block's modules' own parameter elements before FSDP, in reverse registration order (DDP's
    order of ready gradients), each with whether it is in the experts."""
    found = []
    for name, own in _own_params(estimate):
        if of_module(name) == 0:
            expert = any(_under(name, path) for path in experts)
            found.append((own * (expert_shard if expert else fsdp_shard), expert))
    return tuple(reversed(found))


def _boundary_bytes(nodes: list[Any], of_module: Callable[[str], int], element: int) -> int:
    """Bytes of the first block's output, as this rank holds it (sequence-sharded under sequence parallelism):
    what a pipeline stage sends the next per micro-batch, and receives back as a gradient."""
    last = None
    for node in nodes:
        if node.phase == FORWARD and of_module(node.module) == 0 and node.output_shapes:
            last = node
    if last is None:
        return 0
    numel = 1
    for size in last.output_shapes[0]:
        numel *= int(size)
    return numel * element  # the residual stream is in the model's dtype
