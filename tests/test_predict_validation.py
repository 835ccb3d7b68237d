"""Predicted vs published training runs (docs/guide/predict.md's table): the published numbers as the
publications give them, the table's errors, and some rows predicted again here (the others take seconds
each: the benchmark benchmarks/predict_validation.py regenerates all of them)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from fxflops.predict.validation import (BIGSCIENCE, KORTHIKANTI, LLAMA3, MCORE, MOSAIC, NARAYANAN, RUNS, SMITH,
                                       TORCHTITAN, predict_run)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "guide" / "predict.md"
ROW = re.compile(r"^\| (?P<name>[^|]+?) \| (?P<source>[^|]+?) \| [^|]+ \| [^|]+ \| (?P<kernels>[^|]+?) \| (?P<unit>[^|]+?) \| "
                 r"(?P<measured>[\d.]+) \| (?P<predicted>[\d.]+) \| (?P<error>[+-][\d.]+)% \| (?:[+-][\d.]+%|new) \|$")


def table() -> dict[str, dict[str, str]]:
    rows = {}
    for line in DOCS.read_text().splitlines():
        found = ROW.match(line)
        if found:
            rows[found["name"]] = found.groupdict()
    return rows


FIRST_SET = (KORTHIKANTI, NARAYANAN)  # the runs issue 41's target was first stated for


def test_each_row_states_its_kernels() -> None:
    # the runs before FlashAttention (2021-2022 Megatron-LM and DeepSpeed) computed attention unfused with
    # Megatron-LM's attention dropout 0.1; torchtitan reduce-scatters gradients in fp32
    for run in RUNS:
        unfused = run.source in (KORTHIKANTI, NARAYANAN, SMITH, BIGSCIENCE)
        # Megatron-Core r0.8.0: Transformer Engine's cuDNN kernels, Megatron-LM's default attention dropout 0.1
        fused = ("cudnn", 0.1) if run.source == MCORE else ("flash", 0.0)
        assert (run.attention, run.attention_dropout) == (("math", 0.1) if unfused else fused)
        # torchtitan reduce-scatters in fp32, and so does Composer's FSDP under its DEFAULT mixed precision (the MPT
        # rows but the two 70B ones, which ran PURE bf16); BLOOM's DeepSpeed BF16_Optimizer all-reduces its fp32
        # gradient buffer (tr11-176B-ml/README.md at 39ed811: "The new `BF16_Optimizer` accumulates grads in fp32")
        # Megatron-Core r0.8.0 under --bf16 forces accumulate_allreduce_grads_in_fp32 (megatron/training/arguments.py
        # at the README's commit 937571c): its gradient buffer and reduce-scatter are fp32
        fp32_reduce = run.source in (TORCHTITAN, BIGSCIENCE, MCORE) \
            or (run.source == MOSAIC and not run.name.startswith("MPT-70B"))
        assert run.grad_bytes == (4 if fp32_reduce else None)
        # Megatron-LM's loss is vocab_parallel_cross_entropy over the vocabulary-sharded logits (gpt_model.py at de7dc40,
        # cross_entropy.py of core_r0.8.0), and so is Megatron-DeepSpeed's pipeline model's (GPTModelPipe's CrossEntropy:
        # vocab_parallel_cross_entropy(output.contiguous().float(), labels): MT-NLG's and BLOOM's); Megatron-Core
        # r0.8.0's Transformer Engine picks cuDNN's fused attention on sm90 (TE v1.6-v1.8 attention.py)
        assert run.loss_parallel == (run.source in (KORTHIKANTI, NARAYANAN, MCORE, SMITH, BIGSCIENCE))
        if run.source == MCORE:
            assert run.attention == "cudnn" and "cuDNN fused attention" in run.kernels
        # the Megatron-LM README names --overlap-param-gather for its table; no other publication states it
        assert run.overlap_param_gather == (run.source == MCORE) and (not run.overlap_param_gather or run.distributed_optimizer)
        # Megatron-LM's fused bias-GeLU / bias-dropout-add kernels in the Megatron-LM, MT-NLG and BLOOM runs; MT-NLG's
        # and BLOOM's pipelines ran on DeepSpeed's engine; Megatron-Core r0.8.0 keeps them (bias_gelu_fusion,
        # bias_dropout_fusion on by default) and overlapped its TP communication
        fused_pointwise = unfused or run.source == MCORE
        assert run.fuse_elementwise == fused_pointwise and ("fused pointwise chains" in run.kernels) == fused_pointwise
        assert run.pipeline_engine == ("deepspeed" if run.source in (SMITH, BIGSCIENCE) else "megatron")
        assert run.tp_comm_overlap == (run.source == MCORE and run.tp > 1)


def test_published_numbers() -> None:
    # Korthikanti et al. 2022 Table 5 (iteration time, s), Narayanan et al. 2021 Table 1 (TFLOP/s per GPU),
    # Smith et al. 2022 Section 2.4 (iteration time, s), Llama 3 Table 4 (TFLOP/s per GPU), torchtitan (WPS)
    measured = {run.name: run.measured for run in RUNS}
    assert measured == {
        "22B, SP + selective": 1.10, "22B, full recompute": 1.42, "175B, SP + selective": 13.75,
        "175B, full recompute": 18.13, "530B, SP + selective": 37.83, "530B, full recompute": 49.05,
        "1T, SP + selective": 71.49, "1T, full recompute": 94.42, "1.7B on 32 GPUs": 137, "3.6B on 64 GPUs": 138,
        "7.5B on 128 GPUs": 142, "18.4B on 256 GPUs": 135, "39.1B on 512 GPUs": 138,
        "76.1B on 1024 GPUs": 140, "145.6B on 1536 GPUs": 148, "310.1B on 1920 GPUs": 155,
        "529.6B on 2520 GPUs": 163, "1T on 3072 GPUs": 163,
        "MT-NLG 530B on 2240 GPUs": 60.1, "MT-NLG 530B on 2800 GPUs": 50.2, "MT-NLG 530B on 3360 GPUs": 44.4,
        "BLOOM 176B on 384 A100": 104.70, "Megatron-Core 1.7B on 48 H100": 408.8, "Megatron-Core 7.1B on 96 H100": 465.9,
        "Megatron-Core 16B on 192 H100": 489.1, "Megatron-Core 32B on 384 H100": 459.6,
        "MPT-70B on 64 A100, batch 2048/8": 410, "MPT-70B on 32 A100, batch 1024/2": 373,
        "MPT-30B on 8 A100, batch 504/3": 916, "MPT-13B on 8 A100, batch 48/2": 2262, "MPT-7B on 8 A100, batch 96/6": 4641,
        "MPT-3B on 8 A100, batch 160/10": 10811, "MPT-1B on 8 A100, batch 448/14": 20513,
        "MPT-760M on 8 A100, batch 384/24": 32434, "MPT-350M on 8 A100, batch 512/32": 58782,
        "MPT-125M on 8 A100, batch 640/40": 142830, "MPT-125M on 8 A100, batch 512/32": 141737,
        "Llama 3 405B on 8192 H100": 430, "Llama 3 405B on 16384 H100": 400,
        "Llama 3 405B, 128K context, on 16384 H100": 380, "Llama 3 70B, FSDP, full AC": 331,
        "Llama 2 70B, FSDP, full AC": 353, "Llama 2 13B, FSDP, no AC": 2162}
    assert {run.source for run in RUNS} == {KORTHIKANTI, NARAYANAN, SMITH, BIGSCIENCE, MCORE, MOSAIC, LLAMA3, TORCHTITAN}
    for run in RUNS:  # the plans add up to the GPUs the papers name
        assert run.tp * run.cp * run.pp * run.dp == run.gpus
    # Narayanan et al.'s Eq. 3 reproduces their Table 1: 1T at 163 TFLOP/s on 3072 GPUs is 502 PFLOP/s aggregate,
    # so one iteration of batch 3072 took Eq. 3 / 502e15 s
    one_t = next(run for run in RUNS if run.name == "1T on 3072 GPUs")
    assert one_t.published_flops() / (one_t.gpus * 163e12) == pytest.approx(one_t.published_flops() / 502e15, rel=3e-3)
    # Table 1's aggregate PFLOP/s column is GPUs x the per-GPU TFLOP/s (to its rounding) on every row
    aggregate = {"1.7B": 4.4, "3.6B": 8.8, "7.5B": 18.2, "18.4B": 34.6, "39.1B": 70.8, "76.1B": 143.8,
                 "145.6B": 227.1, "310.1B": 297.4, "529.6B": 410.2, "1T": 502.0}
    table_1 = [run for run in RUNS if run.source == NARAYANAN]
    assert sorted(run.name.split(" on")[0] for run in table_1) == sorted(aggregate)
    for run in table_1:
        assert run.gpus * run.measured / 1000 == pytest.approx(aggregate[run.name.split(" on")[0]], abs=0.05 + run.gpus / 2000)
    # the authors' script for Table 1 (Megatron-LM examples/sc21/run_table_1.sh): heads, micro-batch and
    # --num-layers-per-virtual-pipeline-stage (layers a stage / that = virtual stages), DDP torch (overlapped) or local
    script = {"1.7B": (24, 16, 1, True), "3.6B": (32, 16, 1, True), "7.5B": (32, 16, 1, True), "18.4B": (48, 8, 1, True),
              "39.1B": (64, 4, 1, False), "76.1B": (80, 2, 15 // 5, False), "145.6B": (96, 2, 10 // 5, False),
              "310.1B": (128, 1, 6 // 3, False), "529.6B": (128, 1, 3 // 1, False), "1T": (160, 1, 1, False)}
    for run in table_1:
        heads, micro, virtual, torch_ddp = script[run.name.split(" on")[0]]
        assert (run.heads, run.micro_batch, run.virtual_stages, run.overlap_grad_reduce) == (heads, micro, virtual, torch_ddp)
        assert run.grad_buckets == ("torch" if torch_ddp else "megatron")
    # Korthikanti et al.'s Table 5 times against Megatron-LM's README (May 2022): MFU 41.5 / 51.4 / 56.0 / 56.3% for the
    # SP + selective runs, Megatron-LM's model FLOPs over the time on 312 TFLOP/s A100s (1.10 s is rounded: 41.65%)
    readme_mfu = {"22B": 0.415, "175B": 0.514, "530B": 0.560, "1T": 0.563}
    for run in RUNS:
        if run.source == KORTHIKANTI and run.recompute == "selective":
            mfu = run.megatron_flops() / (run.gpus * run.measured * 312e12)
            assert mfu == pytest.approx(readme_mfu[run.name.split(",")[0]], abs=0.002)
    # BLOOM: the log line's 'TFLOPs: 149.77' is Eq. 3 (recomputation included, vocabulary 250,880) over 104.70 s on 384
    bloom = next(run for run in RUNS if run.source == BIGSCIENCE)
    assert (bloom.tp, bloom.pp, bloom.dp, bloom.micro_batch, bloom.global_batch) == (4, 12, 8, 2, 2048)
    assert bloom.published_flops() / (384 * 104.70) / 1e12 == pytest.approx(149.77, abs=0.01)
    # Megatron-Core r0.8.0's table: TFLOP/s / 989 is its MFU column, GPUs x TFLOP/s its aggregate PFLOP/s column
    mcore = {"1.7B": (0.41, 19.6), "7.1B": (0.47, 44.7), "16B": (0.49, 93.9), "32B": (0.46, 176.5)}
    for run in RUNS:
        if run.source == MCORE:
            mfu, aggregate = mcore[run.name.split()[1]]
            assert run.measured / 989 == pytest.approx(mfu, abs=0.005)
            assert run.gpus * run.measured / 1000 == pytest.approx(aggregate, abs=0.05)
            assert (run.pp, run.dp, run.global_batch, run.vocab, run.seq) == (1, 48, 192, 131072, 4096)
    # MPT: the table's Throughput (T/s) over its GPUs is the row's tokens a second a GPU (to its rounding), and micro-batch
    # x gradient accumulation x GPUs its global batch; shapes of scripts/train/yamls/pretrain/mpt-*.yaml
    mpt = {"MPT-70B on 64 A100, batch 2048/8": (26274, 4, (80, 8192, 64)), "MPT-70B on 32 A100, batch 1024/2": (11962, 16, (80, 8192, 64)),
           "MPT-30B on 8 A100, batch 504/3": (7330, 21, (48, 7168, 56)), "MPT-13B on 8 A100, batch 48/2": (18097, 3, (40, 5120, 40)),
           "MPT-7B on 8 A100, batch 96/6": (37130, 2, (32, 4096, 32)), "MPT-3B on 8 A100, batch 160/10": (86491, 2, (32, 2560, 20)),
           "MPT-1B on 8 A100, batch 448/14": (164109, 4, (24, 2048, 16)), "MPT-760M on 8 A100, batch 384/24": (259472, 2, (24, 1536, 12)),
           "MPT-350M on 8 A100, batch 512/32": (470263, 2, (24, 1024, 16)), "MPT-125M on 8 A100, batch 640/40": (1142641, 2, (12, 768, 12)),
           "MPT-125M on 8 A100, batch 512/32": (1133901, 2, (12, 768, 12))}
    assert {run.name for run in RUNS if run.source == MOSAIC} == set(mpt)
    for run in RUNS:
        if run.source == MOSAIC:
            tokens, accumulation, shape = mpt[run.name]
            assert run.measured == pytest.approx(tokens / run.gpus, abs=1) and (run.layers, run.hidden, run.heads) == shape
            assert run.micro_batch * accumulation * run.gpus == run.global_batch and (run.vocab, run.seq, run.tie) == (50368, 2048, True)
    # Smith et al.'s TFLOP/s per GPU (126, 121, 113) are Eq. 3 over their iteration times (60.1, 50.2, 44.4 s):
    # the row's model, plan and batch are the paper's, recomputation included
    for run, tflops in zip((run for run in RUNS if run.source == SMITH), (126, 121, 113)):
        assert (run.gpus, run.tp, run.pp, run.global_batch) == (run.gpus, 8, 35, 1920)
        # fp16: DeepSpeed's pipeline engine ran bf16 only from "bf16+pipeline parallelism" (#1801, April 2022); v0.5.x's
        # engine has no bf16 path
        assert run.dtype == "fp16" and run.pipeline_engine == "deepspeed"
        assert run.published_flops() / (run.gpus * run.measured) / 1e12 == pytest.approx(tflops, rel=0.01)
    # Llama 3 Table 4: 16M tokens a step (dp x sequences per dp rank x 8,192 or 131,072), MFU 43%, 41% and 38% of
    # 989 TFLOP/s (400 / 989 is 40.4%: the table's TFLOP/s are rounded, to within 1% of the peak); the rows'
    # (tp, cp, pp, dp): (8, 1, 16, 64), (8, 1, 16, 128), (8, 16, 16, 8)
    llama3 = [run for run in RUNS if run.source == LLAMA3]
    assert [(run.tp, run.cp, run.pp, run.dp, run.seq) for run in llama3] == [
        (8, 1, 16, 64, 8192), (8, 1, 16, 128, 8192), (8, 16, 16, 8, 131072)]
    for run, mfu in zip(llama3, (0.43, 0.41, 0.38), strict=True):
        assert run.global_batch * run.seq == 16 * 2**20
        assert run.measured / 989 == pytest.approx(mfu, abs=0.01)


def test_docs_table_holds_every_run_and_its_error() -> None:
    rows = table()
    assert set(rows) == {run.name for run in RUNS}
    errors = []
    for run in RUNS:
        row = rows[run.name]
        assert float(row["measured"]) == run.measured
        assert row["kernels"] == run.kernels and run.software  # each row states its software's kernels, with a source
        # the table rounds the prediction to 2 decimals and the error to 0.1%: they agree within that rounding
        error = (float(row["predicted"]) - run.measured) / run.measured
        assert error == pytest.approx(float(row["error"]) / 100, abs=0.005 / run.measured + 0.0005)
        errors.append(abs(error))
    mean, worst = sum(errors) / len(errors), max(errors)
    stated = re.search(r"Mean absolute error ([\d.]+)% over (\d+) runs; largest ([\d.]+)%", DOCS.read_text())
    assert int(stated[2]) == len(RUNS)
    assert float(stated[1]) == pytest.approx(100 * mean, abs=0.051) and float(stated[3]) == pytest.approx(100 * worst, abs=0.051)
    # issue 41's target (mean under 10%, none over 20%) holds on Korthikanti et al.'s rows (2.0%, largest 4.7%) and on
    # the runs it was first stated for, with Narayanan et al.'s rows at their authors' settings (2.3%, largest 6.5%);
    # over all 43 rows the mean holds (8.1%) and the largest does not (38.6%: the bounds catch a change either way)
    korthikanti = [error for run, error in zip(RUNS, errors) if run.source == KORTHIKANTI]
    assert 0.017 < sum(korthikanti) / len(korthikanti) < 0.023 and 0.044 < max(korthikanti) < 0.050
    first = [error for run, error in zip(RUNS, errors) if run.source in FIRST_SET]
    assert 0.020 < sum(first) / len(first) < 0.025 and 0.062 < max(first) < 0.068
    # the rows over 20%: one of MT-NLG's three (DeepSpeed's pipeline engine, -22.0%; 2,800 and 2,240 GPUs -19.7% and
    # -18.7%) and Megatron-Core's two smallest on H100 (+38.6%, +32.9%)
    assert {run.name for run, error in zip(RUNS, errors) if error > 0.20} == {
        "MT-NLG 530B on 3360 GPUs",
        "Megatron-Core 1.7B on 48 H100", "Megatron-Core 7.1B on 96 H100"}
    assert 0.078 < mean < 0.084 and 0.382 < worst < 0.392


@pytest.mark.parametrize("name", ["22B, full recompute", "18.4B on 256 GPUs", "529.6B on 2520 GPUs",
                                  "MT-NLG 530B on 2240 GPUs", "BLOOM 176B on 384 A100", "Megatron-Core 7.1B on 96 H100",
                                  "MPT-7B on 8 A100, batch 96/6",
                                  "Llama 3 405B on 16384 H100", "Llama 3 405B, 128K context, on 16384 H100",
                                  "Llama 2 13B, FSDP, no AC"])
def test_rows_predicted_again(name: str) -> None:
    run = next(run for run in RUNS if run.name == name)
    if run.arch == "llama":
        pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        predicted, prediction = predict_run(run)
    assert f"{predicted:.2f}" == table()[name]["predicted"]
    assert sum(prediction.breakdown.values()) == pytest.approx(prediction.step_time)


def test_each_row_accumulates_gradients_as_its_software_does() -> None:
    # Megatron-LM from 83b1e42 (Korthikanti et al. 2022, bf16: fp32 accumulation forced, the fusion on) and
    # Megatron-Core r0.8.0 fuse the Linear weights' accumulation into the wgrad GEMM; Narayanan et al.'s fp16 runs at
    # de7dc40 (torch DDP, or local DDP without a buffer) and the rest accumulate in .grad (DeepSpeed's engine and FSDP
    # as their code does, whatever the field says)
    for run in RUNS:
        assert run.grad_accumulation == ("fused" if run.source in (KORTHIKANTI, MCORE) else "autograd")


def test_each_row_runs_the_layer_norm_its_software_does() -> None:
    # apex's persistent fast layer norm: Megatron-LM's MixedFusedLayerNorm from a2fdcdf (2021-10) for the hidden sizes
    # it lists (Korthikanti's 6,144 / 12,288 / 20,480 / 25,600 among them) and Transformer Engine's LayerNorm
    # (Megatron-Core); Narayanan's Megatron-LM of 2021-08 and Megatron-DeepSpeed run apex's earlier fused layer norm,
    # MPT torch's own (the device's plain normalization curves)
    assert {run.source for run in RUNS if run.persistent_norm} == {KORTHIKANTI, MCORE}
    assert all(run.persistent_norm == ("persistent layer norm" in run.kernels) for run in RUNS)
    assert all(run.hidden in (1024, 1536, 2048, 2304, 3072, 3840, 4096, 5120, 6144, 8192, 10240, 12288, 12800, 15360,
                              16384, 18432, 20480, 24576, 25600, 30720, 32768, 40960, 49152, 65536)
               for run in RUNS if run.source == KORTHIKANTI)


def test_a_tied_gpt_holds_the_head_once() -> None:
    # MPT's head is its word embedding: tied, the model has vocabulary x hidden parameters fewer, one Parameter shared
    from fxflops.predict.validation import gpt

    tied, untied = gpt(2, 768, 12, vocab=50368, tie=True), gpt(2, 768, 12, vocab=50368)
    assert tied.output.weight is tied.word_embeddings.weight
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    assert count(untied) - count(tied) == 50368 * 768


def test_megatron_rows_keep_the_logits_vocabulary_sharded() -> None:
    """loss_parallel on a Megatron-LM row: its head stays column parallel with the logits a DTensor sharded along the
    vocabulary (Megatron's vocab_parallel_cross_entropy never gathers them), with or without sequence parallelism;
    without loss_parallel, the logits are gathered (Replicate) as before."""
    from torch.distributed.tensor import Replicate, Shard

    from fxflops.predict.validation import gpt, megatron_lm_plan

    model = gpt(1, 64, 4, vocab=128, seq=16)
    for sequence_parallel in (False, True):
        head = megatron_lm_plan(model, sequence_parallel, loss_parallel=True)["output"]
        assert tuple(head.output_layouts) == (Shard(-1),) and not head.use_local_output
    head = megatron_lm_plan(model, False)["output"]
    assert tuple(head.output_layouts) == (Replicate(),)
