"""Published training runs the step prediction is checked against, and the models they trained.

Megatron-LM GPT runs on DGX A100 (Narayanan et al. 2021 at the settings of the authors' script, Korthikanti et al.
2022, MT-NLG 530B), BLOOM-176B (BigScience, DeepSpeed's pipeline engine, on Jean Zay's Omni-Path network: a
cluster file in data/published/), Megatron-Core r0.8.0's GPT runs on H100 (Megatron-LM's README), MosaicML's MPT
runs under FSDP on A100 (llm-foundry's benchmark table), Llama 3 405B
on H100 at 8,192 and 131,072 tokens (the Llama 3 paper's Table 4; the long-context row with cp=16) and
torchtitan's FSDP2 Llama runs on A100; each row names its cluster preset and its metric as the publication
reports it.

The runs' constants (device peaks, efficiency curves, link bandwidths) come from `fxflops/predict/data/`,
each from a microbenchmark or datasheet; none was fitted to these runs. Each row names its publication,
table and what the publication measured; where a publication leaves a setting out (a micro-batch size,
the pipeline schedule), the row says what is assumed, and the assumption is the same for every row of
that publication. What the run's software launched where the model's ops do not say it (fused or unfused
attention, the attention dropout, the gradient reduction's dtype) is a fact of the run: each row states it
in `software`, with the section of the publication (or the code) it comes from, or says it is assumed.

`gpt(layers, hidden, heads)` builds the model the Megatron-LM runs trained (Megatron-LM's GPT: learned
positions, pre-LayerNorm blocks, GeLU MLP of 4h, vocabulary 51,200, sequence 2,048) with module names the
Megatron-style tensor-parallel plan recognizes (query/key/value column-parallel, out_proj row-parallel, dense_h_to_4h /
dense_4h_to_h); on the meta device it allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fxflops.predict.step_memory import OPTIMIZER_STATE_BYTES

VOCAB = 51200
SEQ = 2048
NARAYANAN = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using "
             "Megatron-LM (SC21, arXiv:2104.04473), Table 1")
KORTHIKANTI = ("Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models "
               "(MLSys 2023, arXiv:2205.05198), Tables 3 and 5")
LLAMA3 = ("Llama Team (AI @ Meta) 2024, The Llama 3 Herd of Models (arXiv:2407.21783), Table 4 (scaling "
          "configurations and MFU of Llama 3 405B pre-training) and Table 3 (model shape)")
TORCHTITAN = ("torchtitan, docs/performance.md (Llama 3 and Llama 2 performance numbers, FSDP2 on 64 A100 80GB), "
              "github.com/pytorch/torchtitan/blob/041336434916bdc0f88c1f89fda176fd3c2092e4/docs/performance.md")
MCORE = ("NVIDIA Megatron-LM README, Training Speed and Scalability (Megatron-Core r0.8.0 on H100; images/model_table.png "
         "of commit 937571c, 2024-07-15)")
MOSAIC = ("MosaicML llm-foundry, scripts/train/benchmarking/README.md, 'A100 80GB with 1600 Gbps node-node "
          "interconnect (RoCE)' (MPT training throughput; table as of commit b2a43a1, 2023-10-19)")
BIGSCIENCE = ("BigScience 2022, BLOOM-176B training (bigscience-workshop/bigscience, train/tr11-176B-ml/README.md and "
              "tr11-176B-ml.slurm at commit 39ed811)")
SMITH = ("Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B, A Large-Scale "
         "Generative Language Model (arXiv:2201.11990), Section 2.4 (system performance)")


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # heads as the last-but-one dim from the local width: under tensor parallelism each rank holds heads / tp
        head_dim = self.out_proj.in_features // self.num_heads

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, -1, head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)), split(self.value(x)),
                                             is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, 4 * hidden)
        self.dense_4h_to_h = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.attention = Attention(hidden, heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.input_layernorm(x)))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class GPT(nn.Module):
    """Megatron-LM's GPT (untied output head; attention dropout left out, hidden dropout 0.1)."""

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int = VOCAB, seq: int = SEQ,
                 dropout: float = 0.1, tie: bool = False) -> None:
        super().__init__()
        self.num_attention_heads = heads
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden)
        self.output = nn.Linear(hidden, vocab, bias=False)
        if tie:  # the head shares the word embedding's weight (MPT's, BLOOM's): one parameter, gathered and stepped once
            self.output.weight = self.word_embeddings.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)[None]  # (1, seq): shardable along the sequence
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.final_layernorm(x))


def gpt(layers: int, hidden: int, heads: int, dtype: torch.dtype = torch.bfloat16, vocab: int = VOCAB,
        seq: int = SEQ, tie: bool = False) -> GPT:
    """A Megatron-style GPT on the meta device (no memory allocated), training mode."""
    with torch.device("meta"):
        return GPT(layers, hidden, heads, vocab, seq, tie=tie).to(dtype)


def megatron_lm_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool = False) -> dict[str, Any]:
    """The tensor-parallel plan Megatron-LM runs: fxflops' derived Megatron-style plan, with the word embedding
    vocabulary-parallel and the output layer column-parallel also without sequence parallelism (the derived
    plan splits them only with it; Megatron-LM always does)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from fxflops.parallel.megatron import megatron_plan

    styles = megatron_plan(model, sequence_parallel, loss_parallel)
    if not sequence_parallel:
        styles["word_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        styles["output"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if loss_parallel \
            else ColwiseParallel(output_layouts=Replicate())
    return styles


def llama(layers: int, hidden: int, heads: int, ffn: int, kv_heads: int, vocab: int, seq: int,
          dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Hugging Face's Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head) on the meta device,
    training mode; fxflops' derived Megatron-style plan recognizes its module names. Needs transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=seq, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    return model.train()


def lm_loss(logits: Any) -> torch.Tensor:
    """Cross-entropy of the logits (or a Hugging Face output's) against token 0 (the targets' values do not
    change the work)."""
    logits = getattr(logits, "logits", logits)
    targets = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclass(frozen=True)
class PublishedRun:
    """A measured training run: the model, the plan, and what was measured."""

    name: str
    source: str
    layers: int
    hidden: int
    heads: int
    gpus: int
    tp: int
    pp: int
    global_batch: int
    micro_batch: int
    virtual_stages: int
    recompute: str
    sequence_parallel: bool
    # "step_time" (s), "tflops_per_gpu" (Narayanan et al.'s Eq. 3), "megatron_tflops_per_gpu" (Megatron-LM's
    # num_floating_point_operations: Eq. 3 without recomputation), "model_tflops_per_gpu" (the model's FLOPs as
    # fxflops counts them) or "tokens_per_sec_per_gpu"
    metric: str
    measured: float
    assumed: str = ""  # settings the publication leaves out, as assumed here
    overlap_grad_reduce: bool = True  # the data-parallel gradient reduction overlapped with the last backward
    cluster: str = "DGX A100 80GB"
    arch: str = "gpt"  # "gpt": gpt(...) below; "llama": Hugging Face's Llama (SwiGLU of `ffn`, GQA of `kv_heads`)
    ffn: int = 0
    kv_heads: int = 0
    vocab: int = VOCAB
    seq: int = SEQ
    distributed_optimizer: bool = False
    fsdp: bool = False
    # the software's kernels where the model's ops do not say them (op_time.Kernels): "flash", "cudnn" or "math"
    # (unfused) attention, the attention dropout, and bytes per gradient element in the data-parallel reduction
    attention: str = "flash"
    attention_dropout: float = 0.0
    grad_bytes: int | None = None
    fuse_elementwise: bool = False  # one kernel per chain of pointwise ops (Megatron-LM's fused bias-GeLU, ...)
    pipeline_engine: str = "megatron"  # "deepspeed": DeepSpeed's 2021 PipelineEngine (step._deepspeed_boundary)
    tie: bool = False  # the GPT's head shares the word embedding's weight
    tp_comm_overlap: bool = False  # tensor-parallel collectives beside the GEMMs (Megatron-LM's --tp-comm-overlap)
    # the distributed optimizer's parameter all-gather beside the next forward (Megatron-LM's --overlap-param-gather)
    overlap_param_gather: bool = False
    cp: int = 1  # context parallel degree: the sequence split over cp ranks (StepPlan.cp)
    dtype: str = "bf16"  # the training precision, "bf16" or "fp16" (the model's dtype: predict_step's `dtype`)
    # the cross-entropy over vocabulary-sharded logits (tp > 1): Megatron-LM's vocab_parallel_cross_entropy, the
    # logits never gathered, three all-reduces of one value a position (predict_step's loss_parallel)
    loss_parallel: bool = False
    software: str = ""  # what the publication says about those, with its section (the row's stated assumptions)

    @property
    def kernels(self) -> str:
        """The software's kernels as the row assumes them, in a few words (the docs table's column)."""
        words = [{"math": "unfused attention", "cudnn": "cuDNN fused attention"}.get(self.attention, "flash attention")]
        if self.attention_dropout:
            words.append(f"dropout {self.attention_dropout:g}")
        if self.fuse_elementwise:
            words.append("fused pointwise chains")
        if self.persistent_norm:
            words.append("persistent layer norm")
        if self.grad_bytes == 4:
            words.append("fp32 gradient reduction")
        if self.loss_parallel and self.tp > 1:
            words.append("vocabulary-parallel loss")
        if self.torch_optimizer:
            words.append("torch {} {}".format(*self.torch_optimizer))
        return ", ".join(words)

    @property
    def grad_buckets(self) -> str:
        """How the row's software buckets the data-parallel all-reduce (StepPlan.grad_buckets), by its software."""
        return _GRAD_BUCKETS.get(self.software, "torch")

    @property
    def persistent_norm(self) -> bool:
        """The row's layer norms run apex's persistent fast layer norm (predict_step's persistent_norm)."""
        return self.software in _PERSISTENT_NORM

    @property
    def grad_accumulation(self) -> str:
        """How the row's software accumulates the micro-batches' gradients (StepPlan.grad_accumulation)."""
        return _GRAD_ACCUMULATION.get(self.software, "autograd")

    @property
    def torch_optimizer(self) -> tuple[str, str] | None:
        """(name, implementation) of the torch.optim optimizer the row's software steps with (predict_step's
        optimizer and optimizer_impl); None: a fused optimizer (one kernel over the fp32 master weights and moments)."""
        return _TORCH_OPTIMIZER.get(self.software)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    def published_flops(self) -> float:
        """FLOPs per iteration by Narayanan et al.'s Eq. 3 (full recomputation included):
        96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
        b, s, l, h, v = self.global_batch, self.seq, self.layers, self.hidden, self.vocab
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))

    def megatron_flops(self) -> float:
        """FLOPs per iteration as Megatron-LM's num_floating_point_operations counts them (megatron/training/
        training.py of core_r0.8.0, no GQA, MoE or SwiGLU: 12 B s l h^2 (2 + s/h + 4 + V/(2 l h))): Eq. 3 without
        the recomputed forward, 72 B s l h^2 (1 + s/(6h) + V/(12 l h))."""
        b, s, l, h, v = self.global_batch, self.seq, self.layers, self.hidden, self.vocab
        return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


_N_ASSUMED = ("micro-batch, interleaving, recomputation and DDP as the authors' script for Table 1 sets them: "
              "Megatron-LM examples/sc21/run_table_1.sh (2021-08-10, commit de7dc40, 'Table 1 showing weak-scaling "
              "throughput'): --micro-batch-size, --num-layers-per-virtual-pipeline-stage, --checkpoint-activations "
              "(full recomputation; the paper's FLOP count includes it), --DDP-impl (torch: DDP's bucketed all-reduce "
              "overlapped with the backward; local: Megatron-LM's all-reduce after it), --fp16 --loss-scale 8192")
_S_ASSUMED = ("Section 2.4 gives tp=8 in a node, pp=35 across nodes, batch 1920, sequence 2048; assumed: "
              "micro-batch 1, DeepSpeed's pipeline engine (v0.5.4: TrainSchedule's 1F1B), full recomputation (the paper's TFLOP/s are "
              "Narayanan et al.'s Eq. 3, which includes it: Eq. 3 / (2240 x 60.1 s) = 125.7), no sequence "
              "parallelism, gradients reduced after the backward (DeepSpeed's pipeline engine), vocabulary "
              "50,257 padded to 51,200 (Megatron's padding for tp=8)")
_B_ASSUMED = ("tr11-176B-ml.slurm gives tp=4, pp=12 on 48 nodes of 8 A100 80GB (dp=8), micro-batch 2, global batch 2048, "
              "sequence 2048, 70 layers, hidden 14336, 112 heads, vocabulary padded to 250,880, --checkpoint-activations "
              "(full recomputation), bf16, ZeRO stage 0 with DeepSpeed's bf16 optimizer; the README's log line at "
              "iteration 85,376 reads 'elapsed time per iteration (s): 104.70 | global batch size: 2048 | ... | TFLOPs: "
              "149.77' (its TFLOP/s are Eq. 3 over that time, recomputation included: the test checks it). Assumed: "
              "the model as Megatron's GPT (learned positions where BLOOM has ALiBi inside the QK^T baddbmm, no "
              "embedding LayerNorm, untied head: the tied-gradient all-reduce between first and last stage not timed), "
              "fxflops' even layer split (6 layers on stages 0-9, 5 on the last two; BLOOM's --pp-partition-method "
              "'type:transformer|embedding' puts 5 layers and the embedding on the first and last stages), the "
              "gradients all-reduced after the backward (DeepSpeed's pipeline engine)")
_M_ASSUMED = ("the README's table gives heads, hidden size, layers, tp, pp, dp, GPUs, global batch, per-GPU TFLOP/s and "
              "MFU; its text: vocabulary 131,072, sequence 4,096, --overlap-grad-reduce --overlap-param-gather (the "
              "distributed optimizer), --tp-comm-overlap, H100 GPUs. Assumed: the model as Megatron's GPT (12 h^2 a "
              "layer: the README's parameter counts, e.g. 1.7B = 12 x 24 x 2048^2 + 2 x 131,072 x 2048; learned "
              "positions, GeLU MLP of 4h), micro-batch 1, no recomputation, sequence parallelism with tp > 1, the "
              "DGX H100 preset's network; only the rows with pp = 1 (the README does not give the interleaving "
              "depth that sets the bubble of the others)")
_P_ASSUMED = ("the table gives per row the model (scripts/train/yamls/pretrain/mpt-*.yaml: d_model, n_heads, n_layers, "
              "expansion 4, vocabulary 50,368, learned positions: the table's NumParams grow with the sequence), sequence, "
              "GPUs, micro-batch, gradient accumulation, global batch, FSDP FULL_SHARD, its mixed precision (DEFAULT: "
              "gradients reduced in fp32; PURE: in bf16), activation checkpointing, and tokens a second a GPU; "
              "submit_benchmarks.py sets attn_impl triton (flash attention) and low_precision_layernorm. Rows: every "
              "row of the table at MPT's training sequence 2,048 (the table also sweeps 512 to 65,536 tokens; those "
              "rows were not predicted). Assumed: Megatron's GPT with the head tied to the word embedding (MPT's) and "
              "biases (MPT's no_bias is False by default), FSDP timed as fxflops times FSDP2 (Composer ran FSDP1, "
              "without FSDP2's copy-out of each gathered layer), one layer of prefetch, no torch.compile")
_L_ASSUMED = ("Table 4 gives tp, cp=1, pp, dp, sequence 8,192 and sequences per data-parallel rank; assumed: "
              "micro-batch 1, interleaved 1F1B with 2 chunks per stage (the paper interleaves without saying how "
              "many; its first and last stages hold one layer fewer, here the last two chunks do), sequence "
              "parallelism, no recomputation, parameters replicated over dp with gradients reduce-scattered "
              "and overlapped (the paper's FSDP that keeps parameters after the forward), Meta's RoCE 400 Gb/s "
              "a GPU as the DGX H100 preset's InfiniBand, the paper's FLOPs as fxflops counts the model's")
_L_LONG_ASSUMED = ("Table 4 gives tp=8, cp=16, pp=16, dp=8, sequence 131,072 and 16 sequences per data-parallel rank "
                   "(16M tokens a step); assumed as for the 8,192-token rows (micro-batch 1, interleaved 1F1B with 2 "
                   "chunks per stage, sequence parallelism, no recomputation, parameters replicated over dp with "
                   "gradients reduce-scattered over dp x cp and overlapped, Meta's RoCE as the DGX H100 preset's "
                   "InfiniBand, the paper's FLOPs as fxflops counts the model's: full-square attention, which at "
                   "131,072 positions is more than half of them), and context parallelism as fxflops models it: "
                   "each cp rank's queries against all keys and values, gathered over the cp ranks per layer (the "
                   "gather overlapping attention on the rank's own keys), the same attention work on every cp rank")
_T_ASSUMED = ("the page gives the model, 64 A100 80GB under FSDP2 (1D), the local batch and the activation "
              "checkpointing; assumed: Llama 3's sequence 8,192 and Llama 2's 4,096 (torchtitan's defaults, the "
              "page says Llama 2's is half Llama 3's), FSDP resharding after the forward (FSDP2's default), the "
              "cluster's network as the DGX A100 80GB preset's (the page does not say), no torch.compile, "
              "WPS as tokens a second a GPU")
_MEGATRON_FUSION = ("; pointwise chains fused: Narayanan et al. 2021 Sec. 4.2 fuse bias + GeLU and bias + dropout + add "
                    "(PyTorch JIT), Megatron-LM's fused_bias_gelu / bias_dropout_add_fused_train "
                    "(megatron/model/fused_bias_gelu.py, transformer.py); the loss Megatron-LM's vocab_parallel_cross_entropy "
                    "over the vocabulary-sharded logits (megatron/model/gpt_model.py at de7dc40: the logits never "
                    "gathered over tp)")
_MEGATRON_2021 = ("unfused attention with dropout 0.1: Narayanan et al. Sec. 4.2 (computation optimizations) fuse "
                  "bias + GeLU and bias + dropout + add with PyTorch JIT and write custom kernels fusing scale, mask "
                  "and softmax, so the scores go through memory between the two batched GEMMs (FlashAttention came "
                  "in 2022); attention dropout 0.1 is Megatron-LM's default (--attention-dropout)" + _MEGATRON_FUSION)
_MEGATRON_2022 = ("unfused attention with dropout 0.1: Korthikanti et al. Sec. 4.1 Eq. 1 stores the softmax "
                  "output (2as^2b bytes), its dropout mask (as^2b) and the dropout output (2as^2b) of every layer, "
                  "and Sec. 5's selective recomputation recomputes the QK^T matrix multiply, softmax, softmax "
                  "dropout and attention over V: the attention ran as separate kernels with the scores in memory"
                  + _MEGATRON_FUSION + "; layer norms apex's persistent fast layer norm (Megatron-LM's "
                  "MixedFusedLayerNorm runs apex.contrib's FastLayerNormFN for the hidden sizes it lists, 6,144, "
                  "12,288, 20,480 and 25,600 among them, unless --no-persist-layer-norm, from a2fdcdf of 2021-10; "
                  "megatron/model/fused_layer_norm.py and arguments.py at 83b1e42; assumed: a container with torch "
                  ">= 1.11 and apex's contrib layer norm, the paper names none)")
_DEEPSPEED_2021 = ("unfused attention with dropout 0.1 and pointwise chains fused, as Megatron-LM then (assumed: Sec. 2 "
                   "builds on Megatron-LM's tensor slicing, and Megatron-DeepSpeed's ParallelTransformerLayer keeps "
                   "Megatron-LM's fused bias-GeLU and bias-dropout-add; the paper does not describe its kernels; "
                   "FlashAttention came in 2022); pipeline: DeepSpeed's PipelineEngine (the paper's 3D parallelism: DeepSpeed's "
                   "pipeline parallelism), as its code of v0.5.4 (2021-10-06, the release before the paper's "
                   "announcement) runs it: deepspeed/runtime/pipe/engine.py, p2p.py, schedule.py (TrainSchedule)")
_MEGATRON_2021_TORCH_DDP = (_MEGATRON_2021 + "; gradients: torch's DistributedDataParallel (--DDP-impl torch in "
                            "examples/sc21/run_table_1.sh), its buckets all-reduced as the backward fills them")
_BLOOM_SOFTWARE = ("unfused attention with dropout 0.1 and pointwise chains fused, as Megatron-LM's of 2021-2022 "
                   "(BigScience's Megatron-DeepSpeed fork: --abort-on-unmet-fused-kernel-constraints makes the fused "
                   "scale-mask-softmax kernel mandatory; FlashAttention was not in it; --attention-dropout is left at "
                   "its default 0.1, assumed: the script does not set it), pipeline: DeepSpeed's PipelineEngine "
                   "(--deepspeed with pp=12; modelled as its v0.5.4 code runs it, assumed unchanged in BigScience's "
                   "2022 DeepSpeed), the inter-node network Omni-Path (data/published/jean_zay_a100.toml); gradients "
                   "all-reduced in fp32 (the README: 'The new `BF16_Optimizer` accumulates grads in fp32', its "
                   "unsharded fp32 buffer the all-reduce's input). Not modelled: that optimizer's own ZeRO stage 1 "
                   "(the README: fp32 master weights and Adam state sharded over dp, the updated bf16 parameters "
                   "all-gathered after the step; fxflops' DeepSpeed buckets exclude the distributed optimizer), so the "
                   "step leaves out that all-gather and the predicted memory counts the optimizer state unsharded")
_MCORE_SOFTWARE = ("cuDNN's fused attention with Megatron-LM's default dropout 0.1 (--attention-dropout, arguments.py "
                   "of core_r0.8.0; the README does not set it; a fused kernel's dropout is timed as free: no published "
                   "measurement of cuDNN's with and without it), pointwise chains fused (Megatron-Core's defaults "
                   "bias_gelu_fusion and bias_dropout_fusion, --no-bias-gelu-fusion / --no-bias-dropout-fusion unset: "
                   "mlp.py's bias_gelu_impl, the layer's fused bias-dropout-add); Megatron-Core r0.8.0 runs Transformer Engine's "
                   "DotProductAttention by default, which on sm90 picks FusedAttention (cuDNN's F16_arbitrary_seqlen "
                   "kernels) over flash-attn whenever both can run (transformer_engine/pytorch/attention.py of TE v1.6, "
                   "v1.7 and v1.8, 2024-05 to 2024-07: 'Select FusedAttention on sm90 and FlashAttention on others for "
                   "performance'); the loss Megatron's vocab_parallel_cross_entropy over the vocabulary-sharded logits "
                   "(megatron/core/tensor_parallel/cross_entropy.py of core_r0.8.0: the logits never gathered, all-reduces "
                   "of each position's max, target logit and sum); tensor-parallel communication overlapped with the GEMMs (--tp-comm-overlap, "
                   "the README); the distributed optimizer's parameter all-gather overlapped with the next step's "
                   "forward, one bucket ahead (--overlap-param-gather, the README; distrib_optimizer.py of core_r0.8.0 "
                   "and of the README's commit 937571c dispatches each bucket's gather from the previous bucket's "
                   "forward pre-hook), bucketed per layer as fxflops buckets its reduce-scatter; gradients accumulated "
                   "and reduce-scattered in fp32 (megatron/training/arguments.py at 937571c: with --bf16 'bfloat16 "
                   "requires gradient accumulation and all-reduce to be done in fp32', accumulate_allreduce_grads_in_fp32 "
                   "forced on, training.py passing it as grad_reduce_in_fp32; bf16 assumed: the README's MFU column is "
                   "the TFLOP/s over H100's 989 TFLOP/s bf16 peak); layer norms Transformer Engine's (the default "
                   "transformer_impl's TENorm and LayerNormLinear), whose kernels (ln_fwd_tuned_kernel, ...) are apex's "
                   "persistent fast layer norm's")
_MOSAIC_SOFTWARE = ("fused attention, no dropout (submit_benchmarks.py: --attn_impl triton, MPT's Triton "
                    "FlashAttention; MPT's attn_pdrop 0); the gradient reduce-scatter in the precision of the row's FSDP "
                    "mixed precision (Composer: DEFAULT reduces in fp32, PURE in bf16)")
_LLAMA3_SOFTWARE = "fused (flash) attention, no dropout (assumed: the paper does not name its attention kernel)"
_TORCHTITAN_SOFTWARE = ("fused attention, no dropout (torchtitan's Llama calls F.scaled_dot_product_attention, "
                        "which runs FlashAttention-2 on A100); gradients reduce-scattered in fp32 (torchtitan's "
                        "--training.mixed_precision_reduce, default and only choice 'float32', "
                        "torchtitan/config_manager.py of 2024); FSDP2's all-gather copy-out on the compute stream")
# whose data-parallel all-reduce buckets each row's software fills (StepPlan.grad_buckets): Megatron-LM's own DDP
# (2021-2022: each dtype's whole gradient buffer all-reduced after the backward, megatron/model/distributed.py),
# DeepSpeed's engine (buckets of 5e8 elements); a row not named here runs torch's DDP defaults (_MEGATRON_2021_TORCH_DDP:
# Megatron-LM with --DDP-impl torch)
_GRAD_BUCKETS = {_MEGATRON_2021: "megatron", _MEGATRON_2022: "megatron", _DEEPSPEED_2021: "deepspeed",
                 _BLOOM_SOFTWARE: "deepspeed"}
# how each software accumulates the micro-batches' gradients (step._accumulation): Megatron-LM from commit 83b1e42
# (2022-02, "gradient accumulation fusion", on with fp32 accumulation, which bf16 forces) and Megatron-Core r0.8.0
# (gradient_accumulation_fusion, TE's fuse_wgrad_accumulation) accumulate the Linear weights' gradients in their
# weight-gradient GEMM and the rest through main_grad hooks; Megatron-LM at de7dc40 in fp16 (Narayanan's rows:
# --fp16, no --accumulate-allreduce-grads-in-fp32 / --use-contiguous-buffers-in-ddp, so local DDP keeps no buffer)
# and torch DDP, DeepSpeed's engine in fp16 and a row not named here accumulate in .grad (torch's AccumulateGrad);
# DeepSpeed's BF16_Optimizer and FSDP as their code does (the step knows them by engine)
_GRAD_ACCUMULATION = {_MEGATRON_2022: "fused", _MCORE_SOFTWARE: "fused"}
# the software that steps with torch.optim's own kernels (step's optimizer_time): torchtitan at 0413364 builds
# torch.optim.AdamW(..., weight_decay=0.1, foreach=True) over FSDP2's fp32 sharded parameters (train.py,
# build_optimizer), so its moments are fp32 and the fp32 shards the master weights (12 B a parameter element, as the
# memory counts); the rest run fused optimizers (Megatron-LM's and DeepSpeed's, Apex FusedAdam)
_TORCH_OPTIMIZER = {_TORCHTITAN_SOFTWARE: ("adamw", "foreach")}
# the software whose layer norms are apex's persistent fast layer norm (op_time.Kernels.persistent_norm); the rest
# run apex's earlier fused layer norm (Megatron-LM before a2fdcdf, Megatron-DeepSpeed) or torch's own
_PERSISTENT_NORM = (_MEGATRON_2022, _MCORE_SOFTWARE)
_K_SELECTIVE = "sequence parallelism + selective recomputation ('present work')"
_K_FULL = "tensor parallelism without sequence parallelism, full recomputation (the baseline)"

RUNS: tuple[PublishedRun, ...] = (
    PublishedRun("22B, SP + selective", KORTHIKANTI, 48, 6144, 64, 8, 8, 1, 4, 4, 1, "selective", True,
                 "step_time", 1.10, _K_SELECTIVE,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, software=_MEGATRON_2022),
    PublishedRun("22B, full recompute", KORTHIKANTI, 48, 6144, 64, 8, 8, 1, 4, 4, 1, "full", False,
                 "step_time", 1.42, _K_FULL,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, software=_MEGATRON_2022),
    PublishedRun("175B, SP + selective", KORTHIKANTI, 96, 12288, 96, 64, 8, 8, 64, 1, 3, "selective", True,
                 "step_time", 13.75, _K_SELECTIVE,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, software=_MEGATRON_2022),
    PublishedRun("175B, full recompute", KORTHIKANTI, 96, 12288, 96, 64, 8, 8, 64, 1, 3, "full", False,
                 "step_time", 18.13, _K_FULL,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, software=_MEGATRON_2022),
    PublishedRun("530B, SP + selective", KORTHIKANTI, 105, 20480, 128, 280, 8, 35, 280, 1, 3, "selective", True,
                 "step_time", 37.83, _K_SELECTIVE,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, software=_MEGATRON_2022),
    PublishedRun("530B, full recompute", KORTHIKANTI, 105, 20480, 128, 280, 8, 35, 280, 1, 3, "full", False,
                 "step_time", 49.05, _K_FULL,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, software=_MEGATRON_2022),
    PublishedRun("1T, SP + selective", KORTHIKANTI, 128, 25600, 160, 512, 8, 64, 512, 1, 1, "selective", True,
                 "step_time", 71.49, _K_SELECTIVE,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, software=_MEGATRON_2022),
    PublishedRun("1T, full recompute", KORTHIKANTI, 128, 25600, 160, 512, 8, 64, 512, 1, 1, "full", False,
                 "step_time", 94.42, _K_FULL,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, software=_MEGATRON_2022),
    PublishedRun("1.7B on 32 GPUs", NARAYANAN, 24, 2304, 24, 32, 1, 1, 512, 16, 1, "full", False,
                 "tflops_per_gpu", 137, _N_ASSUMED, overlap_grad_reduce=True,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True,
                 software=_MEGATRON_2021_TORCH_DDP),
    PublishedRun("3.6B on 64 GPUs", NARAYANAN, 30, 3072, 32, 64, 2, 1, 512, 16, 1, "full", False,
                 "tflops_per_gpu", 138, _N_ASSUMED, overlap_grad_reduce=True,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True,
                 software=_MEGATRON_2021_TORCH_DDP),
    PublishedRun("7.5B on 128 GPUs", NARAYANAN, 36, 4096, 32, 128, 4, 1, 512, 16, 1, "full", False,
                 "tflops_per_gpu", 142, _N_ASSUMED, overlap_grad_reduce=True,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True,
                 software=_MEGATRON_2021_TORCH_DDP),
    PublishedRun("18.4B on 256 GPUs", NARAYANAN, 40, 6144, 48, 256, 8, 1, 1024, 8, 1, "full", False,
                 "tflops_per_gpu", 135, _N_ASSUMED, overlap_grad_reduce=True,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True,
                 software=_MEGATRON_2021_TORCH_DDP),
    PublishedRun("39.1B on 512 GPUs", NARAYANAN, 48, 8192, 64, 512, 8, 2, 1536, 4, 1, "full", False,
                 "tflops_per_gpu", 138, _N_ASSUMED, overlap_grad_reduce=False,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, software=_MEGATRON_2021),
    PublishedRun("76.1B on 1024 GPUs", NARAYANAN, 60, 10240, 80, 1024, 8, 4, 1792, 2, 3, "full", False,
                 "tflops_per_gpu", 140, _N_ASSUMED, overlap_grad_reduce=False,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, software=_MEGATRON_2021),
    PublishedRun("145.6B on 1536 GPUs", NARAYANAN, 80, 12288, 96, 1536, 8, 8, 2304, 2, 2, "full", False,
                 "tflops_per_gpu", 148, _N_ASSUMED, overlap_grad_reduce=False,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, software=_MEGATRON_2021),
    PublishedRun("310.1B on 1920 GPUs", NARAYANAN, 96, 16384, 128, 1920, 8, 16, 2160, 1, 2, "full", False,
                 "tflops_per_gpu", 155, _N_ASSUMED, overlap_grad_reduce=False,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, software=_MEGATRON_2021),
    PublishedRun("529.6B on 2520 GPUs", NARAYANAN, 105, 20480, 128, 2520, 8, 35, 2520, 1, 3, "full", False,
                 "tflops_per_gpu", 163, _N_ASSUMED, overlap_grad_reduce=False,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, software=_MEGATRON_2021),
    PublishedRun("1T on 3072 GPUs", NARAYANAN, 128, 25600, 160, 3072, 8, 64, 3072, 1, 1, "full", False,
                 "tflops_per_gpu", 163, _N_ASSUMED, overlap_grad_reduce=False,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, software=_MEGATRON_2021),
    PublishedRun("MT-NLG 530B on 2240 GPUs", SMITH, 105, 20480, 128, 2240, 8, 35, 1920, 1, 1, "full", False,
                 "step_time", 60.1, _S_ASSUMED, overlap_grad_reduce=False,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, pipeline_engine="deepspeed",
                 dtype="fp16", software=_DEEPSPEED_2021),
    PublishedRun("MT-NLG 530B on 2800 GPUs", SMITH, 105, 20480, 128, 2800, 8, 35, 1920, 1, 1, "full", False,
                 "step_time", 50.2, _S_ASSUMED, overlap_grad_reduce=False,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, pipeline_engine="deepspeed",
                 dtype="fp16", software=_DEEPSPEED_2021),
    PublishedRun("MT-NLG 530B on 3360 GPUs", SMITH, 105, 20480, 128, 3360, 8, 35, 1920, 1, 1, "full", False,
                 "step_time", 44.4, _S_ASSUMED, overlap_grad_reduce=False,
                 attention="math", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True, pipeline_engine="deepspeed",
                 dtype="fp16", software=_DEEPSPEED_2021),
    PublishedRun("BLOOM 176B on 384 A100", BIGSCIENCE, 70, 14336, 112, 384, 4, 12, 2048, 2, 1, "full", False,
                 "step_time", 104.70, _B_ASSUMED, overlap_grad_reduce=False, cluster="Jean Zay A100 80GB",
                 vocab=250880, attention="math", attention_dropout=0.1, fuse_elementwise=True, grad_bytes=4,
                 loss_parallel=True, pipeline_engine="deepspeed", software=_BLOOM_SOFTWARE),
    # Megatron-LM README's model table (Megatron-Core r0.8.0), the rows with pp = 1: (name, heads, hidden, layers, tp, GPUs,
    # global batch, TFLOP/s per GPU); dp = 48 in each
    *(PublishedRun(f"Megatron-Core {name} on {gpus} H100", MCORE, layers, hidden, heads, gpus, tp, 1, batch, 1, 1, "none",
                   tp > 1, "megatron_tflops_per_gpu", tflops, _M_ASSUMED, cluster="DGX H100", vocab=131072, seq=4096,
                   distributed_optimizer=True, overlap_param_gather=True, tp_comm_overlap=tp > 1, grad_bytes=4,
                   attention="cudnn", attention_dropout=0.1, fuse_elementwise=True, loss_parallel=True,
                   software=_MCORE_SOFTWARE)
      for name, heads, hidden, layers, tp, gpus, batch, tflops in (
          ("1.7B", 16, 2048, 24, 1, 48, 192, 408.8), ("7.1B", 32, 4096, 30, 2, 96, 192, 465.9),
          ("16B", 48, 6144, 32, 4, 192, 192, 489.1), ("32B", 56, 7168, 48, 8, 384, 192, 459.6))),
    # llm-foundry's A100 80GB table at sequence 2,048: (model, GPUs, layers, hidden, heads, micro-batch, global batch,
    # tokens/s per GPU, FSDP mixed precision, activation checkpointing)
    *(PublishedRun(f"MPT-{name} on {gpus} A100, batch {batch}/{micro}", MOSAIC, layers, hidden, heads, gpus, 1, 1, batch,
                   micro, 1, "full" if checkpointing else "none", False, "tokens_per_sec_per_gpu", tokens, _P_ASSUMED,
                   vocab=50368, fsdp=True, tie=True, grad_bytes=4 if precision == "DEFAULT" else None,
                   software=_MOSAIC_SOFTWARE)
      for name, gpus, layers, hidden, heads, micro, batch, tokens, precision, checkpointing in (
          ("70B", 64, 80, 8192, 64, 8, 2048, 410, "PURE", True), ("70B", 32, 80, 8192, 64, 2, 1024, 373, "PURE", True),
          ("30B", 8, 48, 7168, 56, 3, 504, 916, "DEFAULT", True), ("13B", 8, 40, 5120, 40, 2, 48, 2262, "DEFAULT", False),
          ("7B", 8, 32, 4096, 32, 6, 96, 4641, "DEFAULT", False), ("3B", 8, 32, 2560, 20, 10, 160, 10811, "DEFAULT", False),
          ("1B", 8, 24, 2048, 16, 14, 448, 20513, "DEFAULT", False),
          ("760M", 8, 24, 1536, 12, 24, 384, 32434, "DEFAULT", False),
          ("350M", 8, 24, 1024, 16, 32, 512, 58782, "DEFAULT", False),
          ("125M", 8, 12, 768, 12, 40, 640, 142830, "DEFAULT", False),
          ("125M", 8, 12, 768, 12, 32, 512, 141737, "DEFAULT", False))),
    PublishedRun("Llama 3 405B on 8192 H100", LLAMA3, 126, 16384, 128, 8192, 8, 16, 64 * 32, 1, 2, "none", True,
                 "model_tflops_per_gpu", 430, _L_ASSUMED, cluster="DGX H100", arch="llama", ffn=53248, kv_heads=8,
                 vocab=128256, seq=8192, distributed_optimizer=True,
                 software=_LLAMA3_SOFTWARE),
    PublishedRun("Llama 3 405B on 16384 H100", LLAMA3, 126, 16384, 128, 16384, 8, 16, 128 * 16, 1, 2, "none", True,
                 "model_tflops_per_gpu", 400, _L_ASSUMED, cluster="DGX H100", arch="llama", ffn=53248, kv_heads=8,
                 vocab=128256, seq=8192, distributed_optimizer=True,
                 software=_LLAMA3_SOFTWARE),
    PublishedRun("Llama 3 405B, 128K context, on 16384 H100", LLAMA3, 126, 16384, 128, 16384, 8, 16, 8 * 16, 1, 2,
                 "none", True, "model_tflops_per_gpu", 380, _L_LONG_ASSUMED, cluster="DGX H100", arch="llama",
                 ffn=53248, kv_heads=8, vocab=128256, seq=131072, distributed_optimizer=True, cp=16,
                 software=_LLAMA3_SOFTWARE),
    PublishedRun("Llama 3 70B, FSDP, full AC", TORCHTITAN, 80, 8192, 64, 64, 1, 1, 64, 1, 1, "full", False,
                 "tokens_per_sec_per_gpu", 331, _T_ASSUMED, arch="llama", ffn=28672, kv_heads=8, vocab=128256,
                 seq=8192, fsdp=True,
                 grad_bytes=4, software=_TORCHTITAN_SOFTWARE),
    PublishedRun("Llama 2 70B, FSDP, full AC", TORCHTITAN, 80, 8192, 64, 64, 1, 1, 128, 2, 1, "full", False,
                 "tokens_per_sec_per_gpu", 353, _T_ASSUMED, arch="llama", ffn=28672, kv_heads=8, vocab=32000,
                 seq=4096, fsdp=True,
                 grad_bytes=4, software=_TORCHTITAN_SOFTWARE),
    PublishedRun("Llama 2 13B, FSDP, no AC", TORCHTITAN, 40, 5120, 40, 64, 1, 1, 128, 2, 1, "none", False,
                 "tokens_per_sec_per_gpu", 2162, _T_ASSUMED, arch="llama", ffn=13824, kv_heads=40, vocab=32000,
                 seq=4096, fsdp=True,
                 grad_bytes=4, software=_TORCHTITAN_SOFTWARE),
)


# clusters a publication names that no preset describes: files in fxflops/predict/data/published/, each value sourced
_PUBLISHED_CLUSTERS = {"Jean Zay A100 80GB": "jean_zay_a100.toml"}


def _cluster_file(name: str) -> str:
    """A preset's name as it is, or the path of the published cluster file of that name."""
    if name not in _PUBLISHED_CLUSTERS:
        return name
    from importlib import resources

    return str(resources.files("fxflops.predict").joinpath("data", "published", _PUBLISHED_CLUSTERS[name]))


def _optimizer_options(run: PublishedRun) -> dict[str, Any]:
    """predict_step's optimizer settings for the row: torch.optim's kernels where its software steps with them, over
    fp32 parameters and moments (OPTIMIZER_STATE_BYTES: the fp32 copies counted as master weights), else none (the
    fused default)."""
    if run.torch_optimizer is None:
        return {}
    name, implementation = run.torch_optimizer
    return {"optimizer": name, "optimizer_impl": implementation, "optimizer_state_bytes": OPTIMIZER_STATE_BYTES}


def predict_run(run: PublishedRun, cluster: str | None = None) -> tuple[float, Any]:
    """(predicted value in the run's metric, the StepPrediction), the model captured at two layers."""
    from fxflops.predict.step import predict_step

    parallel = {"tp": run.tp, "pp": run.pp, "dp": run.dp, "virtual_stages": run.virtual_stages,
                "fsdp": run.fsdp, "sequence_parallel": run.sequence_parallel, **({"cp": run.cp} if run.cp > 1 else {})}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[run.dtype]
    if run.arch == "llama":  # the derived plan is Megatron's for Hugging Face's names
        model = llama(2, run.hidden, run.heads, run.ffn, run.kv_heads, run.vocab, run.seq, dtype=dtype)
    else:
        model = gpt(2, run.hidden, run.heads, dtype=dtype, vocab=run.vocab, seq=run.seq, tie=run.tie)
        parallel["tp_plan"] = megatron_lm_plan(model, run.sequence_parallel, run.loss_parallel)
    if run.loss_parallel and run.tp > 1:
        parallel["loss_parallel"] = True
    ids = torch.zeros(run.micro_batch, run.seq, dtype=torch.long)
    prediction = predict_step(model, (ids,), parallel, cluster or _cluster_file(run.cluster), global_batch=run.global_batch,
                              dtype=dtype,
                              recompute=run.recompute, sequence_parallel=run.sequence_parallel, loss=lm_loss,
                              layers=run.layers, overlap_grad_reduce=run.overlap_grad_reduce,
                              distributed_optimizer=run.distributed_optimizer, grad_bytes=run.grad_bytes,
                              attention=run.attention, attention_dropout=run.attention_dropout,
                              fuse_elementwise=run.fuse_elementwise, persistent_norm=run.persistent_norm,
                              pipeline_engine=run.pipeline_engine,
                              grad_buckets=run.grad_buckets, tp_comm_overlap=run.tp_comm_overlap,
                              overlap_param_gather=run.overlap_param_gather, grad_accumulation=run.grad_accumulation,
                              **_optimizer_options(run))
    if run.metric == "step_time":
        return prediction.step_time, prediction
    if run.metric == "model_tflops_per_gpu":
        return prediction.tflops_per_gpu, prediction
    if run.metric == "megatron_tflops_per_gpu":
        return run.megatron_flops() / run.gpus / prediction.step_time / 1e12, prediction
    if run.metric == "tokens_per_sec_per_gpu":
        return prediction.tokens_per_sec / run.gpus, prediction
    return run.published_flops() / run.gpus / prediction.step_time / 1e12, prediction
