"""The step simulation (fxflops.predict.step): pipeline, overlap, recomputation, worked out by hand on
synthetic per-layer costs, and predict_step end to end on a small Megatron-style GPT."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

import fxflops
from fxflops.predict.comm_time import collective_seconds
from fxflops.predict.hardware import cluster
from fxflops.predict.layers import LayerCosts, Part
from fxflops.predict.schedule import ChunkCost
from fxflops.predict.step import ERROR_STATEMENT, StepPlan, _prefetched, simulate_plan
from fxflops.predict.validation import GPT, lm_loss

A100 = cluster("DGX A100 80GB")
# the same cluster with links of no latency: an empty pipeline transfer then takes no time
NO_LATENCY = dataclasses.replace(A100, intra_latency=0.0, inter_latency=0.0)


def costs(layers: int = 8, forward: float = 1.0, backward: float = 2.0, pre: Part | None = None,
          post: Part | None = None, params: int = 0, comm: float = 0.0, attention: float = 0.0) -> LayerCosts:
    block = Part(forward=forward, backward=backward, comm_forward=comm, comm_backward=comm,
                 attention_forward=attention, forward_flops=100, backward_flops=200, attention_flops=10, params=params)
    return LayerCosts(1, False, 1, 1000, layers, block, pre or Part(), post or Part(), 0, 2, "bfloat16", "A100",
                      layers)


def no_optimizer(plan: StepPlan, **changes) -> StepPlan:
    return StepPlan(**{**plan.as_dict(), **changes})


def test_uniform_pipeline_bubble_is_p_minus_1_over_m() -> None:
    # 8 layers of 1 s / 2 s, pp = 4 (2 layers a stage), m = 8: each rank computes 8 x 2 x 3 s = 48 s, and
    # the bubble is (p-1) stage passes = 3 x 6 s = 18 s = (p-1)/m of 48 s. No parameters: no optimizer time.
    plan = StepPlan(pp=4, micro_batch=1, global_batch=8)
    prediction = simulate_plan(costs(), plan, NO_LATENCY)
    assert prediction.step_time == 48.0 + 18.0
    assert prediction.breakdown == {"compute": 48.0, "exposed_comm": 0.0, "bubble": 18.0, "optimizer": 0.0}
    assert [r.role for r in prediction.ranks] == ["first stage", "stage 1", "stage 2", "last stage"]
    interleaved = simulate_plan(costs(), no_optimizer(plan, virtual_stages=2), NO_LATENCY)
    assert interleaved.breakdown["bubble"] == 9.0  # (p-1)/(m v) of 48 s


def test_embedding_on_the_first_stage_is_its_extra_time() -> None:
    # one stage: the embedding's forward (0.5 s) and backward (0.25 s) per micro-batch add to the compute
    prediction = simulate_plan(costs(pre=Part(forward=0.5, backward=0.25)), StepPlan(micro_batch=1, global_batch=4),
                               A100)
    assert prediction.breakdown["compute"] == 4 * (8 * 3.0 + 0.75)
    assert prediction.breakdown["bubble"] == 0.0


def test_tensor_parallel_comm_is_exposed_and_recomputed_with_full_recompute() -> None:
    plan = StepPlan(micro_batch=1, global_batch=2)
    none = simulate_plan(costs(comm=0.125), plan, A100)
    assert none.breakdown["exposed_comm"] == 2 * 8 * 0.25  # forward and backward collectives, every layer
    full = simulate_plan(costs(comm=0.125), no_optimizer(plan, recompute="full"), A100)
    assert full.breakdown["compute"] == 2 * 8 * (3.0 + 1.0)  # the forward again in the backward
    assert full.breakdown["exposed_comm"] == 2 * 8 * (0.25 + 0.125)  # and its collectives
    selective = simulate_plan(costs(attention=0.25), no_optimizer(plan, recompute="selective"), A100)
    assert selective.breakdown["compute"] == 2 * 8 * (3.0 + 0.25)
    # MFU counts the model's FLOPs, HFU adds the recomputed forward's
    assert full.ranks[0].flops == 2 * 8 * 300 and full.ranks[0].recompute_flops == 2 * 8 * 100
    assert full.hfu / full.mfu == pytest.approx(400 / 300)


def test_data_parallel_reduction_overlaps_the_last_backward() -> None:
    # one stage, dp = 2, 4 layers with 2 s backwards; each layer's gradient all-reduce queues when its part of
    # the last micro-batch's backward ends: every reduce but the last is hidden when one takes under 2 s
    params = 50_000_000
    plan = StepPlan(dp=2, micro_batch=1, global_batch=4, optimizer_bytes_per_param=0)
    layer = collective_seconds("all_reduce", params * 2, 2, A100, 2)
    assert layer < 2.0
    prediction = simulate_plan(costs(layers=4, params=params), plan, A100)
    # the second micro-batch's backward adds its gradients into .grad (torch's AccumulateGrad: 3 x 2 bytes an
    # element, one kernel), before the last gradient is ready
    compute = 2 * 4 * 3.0 + 4 * params * 6 / A100.device.sustained + A100.device.launch_overhead
    # gradient read, parameter written, in one memory-bound kernel
    optimizer = 4 * params * (2 + 2) / A100.device.sustained + A100.device.launch_overhead
    assert prediction.breakdown["compute"] == pytest.approx(compute, rel=1e-12)
    assert prediction.breakdown["exposed_comm"] == pytest.approx(layer)
    assert prediction.step_time == pytest.approx(compute + layer + optimizer)
    after = simulate_plan(costs(layers=4, params=params), no_optimizer(plan, overlap_grad_reduce=False), A100)
    assert after.breakdown["exposed_comm"] == pytest.approx(4 * layer)


def test_fsdp_gathers_are_prefetched_one_layer_ahead() -> None:
    # compute 1 s per layer, gathers 0.5 s: only the first is exposed; gathers of 2 s: each layer waits
    assert _prefetched([1.0] * 4, [0.5] * 4, [0.0] * 4) == 0.5 + 4.0
    assert _prefetched([1.0] * 4, [2.0] * 4, [0.0] * 4) == 4 * 2.0 + 1.0
    # reduce-scatters of 0.25 s after each layer share the stream: the last one ends after the compute
    assert _prefetched([1.0] * 3, [0.5] * 3, [0.25] * 3) == 0.5 + 3.0 + 0.25


def test_fsdp_copies_each_gathered_layer_out_on_the_compute_stream() -> None:
    # 8 layers of 1 s / 2 s holding 2^26 bf16 parameters, FSDP over dp = 2 in a node: before each forward and each
    # backward FSDP2 copies the gathered layer into its parameters (2 x 2^26 x 2 bytes through memory, one
    # kernel): 16 copies on the compute stream; after each backward it copies the layer's bf16 gradients into the
    # reduce-scatter's input (2^26 x (2 read + 2 written) bytes, one kernel): 8 more; a capture that ran FSDP has
    # them among its ops already
    params = 1 << 26
    plan = StepPlan(dp=2, fsdp=True, global_batch=2)
    copy_out = 2 * params * 2 / A100.device.sustained + A100.device.launch_overhead
    copy_in = params * (2 + 2) / A100.device.sustained + A100.device.launch_overhead
    prediction = simulate_plan(costs(params=params), plan, A100)
    assert prediction.breakdown["compute"] == pytest.approx(8 * 3.0 + 16 * copy_out + 8 * copy_in, rel=1e-12)
    captured = simulate_plan(dataclasses.replace(costs(params=params), fsdp_in_capture=True), plan, A100)
    assert captured.breakdown["compute"] == pytest.approx(8 * 3.0, rel=1e-12)
    # without FSDP there is nothing to copy
    assert simulate_plan(costs(params=params), StepPlan(dp=2, fsdp=False, global_batch=2), A100
                         ).breakdown["compute"] == pytest.approx(8 * 3.0, rel=1e-12)


def test_fsdp_reduce_scatter_copy_in_casts_to_the_reduce_dtype() -> None:
    # torchtitan's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the bf16 gradients (2 bytes) are read
    # and written as fp32 (4 bytes) into the reduce-scatter's input by chunk_cat, on the compute stream, once per
    # layer per backward; the reduce-scatter then moves 4 bytes a parameter
    params = 1 << 26
    plan = StepPlan(dp=2, fsdp=True, global_batch=2, grad_bytes=4)
    copy_out = 2 * params * 2 / A100.device.sustained + A100.device.launch_overhead
    copy_in = params * (2 + 4) / A100.device.sustained + A100.device.launch_overhead
    prediction = simulate_plan(costs(params=params), plan, A100)
    assert prediction.breakdown["compute"] == pytest.approx(8 * 3.0 + 16 * copy_out + 8 * copy_in, rel=1e-12)
    # the reduce-scatter itself stays hidden behind the next layer's backward, except the last layer's, which
    # ends after the compute: exposed are the first gather of the forward and of the backward, and that last one
    gather = collective_seconds("all_gather", params * 2, 2, A100, 2)
    scatter = collective_seconds("reduce_scatter", params * 4, 2, A100, 2)
    assert prediction.breakdown["exposed_comm"] == pytest.approx(2 * gather + scatter, rel=1e-9)


def test_fsdp_root_unit_is_gathered_first_and_reduce_scattered_last() -> None:
    # one stage, FSDP over dp = 2 in a node, 4 layers of 1 s / 2 s without parameters (nothing to gather), an
    # embedding of 2^24 bf16 parameters (0.5 s forward, 0.25 s backward) and a head of 2^25 (0.25 s / 0.5 s): the
    # root unit (fully_shard of the model) holds both, 3 x 2^24 parameters. Its all-gather is the first thing on
    # the all-gather stream and the embedding waits for it (exposed); it is not resharded after the forward, so
    # the backward does not gather it; its reduce-scatter follows the embedding's backward, the last op, exposed
    root = 3 << 24
    plan = StepPlan(dp=2, fsdp=True, global_batch=2, optimizer_bytes_per_param=0)
    model = costs(layers=4, pre=Part(forward=0.5, backward=0.25, params=1 << 24),
                  post=Part(forward=0.25, backward=0.5, params=1 << 25))
    prediction = simulate_plan(model, plan, A100)
    gather = collective_seconds("all_gather", root * 2, 2, A100, 2)
    scatter = collective_seconds("reduce_scatter", root * 2, 2, A100, 2)
    copy_out = 2 * root * 2 / A100.device.sustained + A100.device.launch_overhead  # once: gathered once
    copy_in = root * (2 + 2) / A100.device.sustained + A100.device.launch_overhead
    compute = 4 * 3.0 + 0.75 + 0.75 + copy_out + copy_in
    assert prediction.breakdown["compute"] == pytest.approx(compute, rel=1e-12)
    assert prediction.breakdown["exposed_comm"] == pytest.approx(gather + scatter, rel=1e-9)
    # the optimizer streams the gradient and parameter of the 3 x 2^24 / 2 parameters a rank holds
    optimizer = root / 2 * (2 + 2) / A100.device.sustained + A100.device.launch_overhead
    assert prediction.step_time == pytest.approx(compute + gather + scatter + optimizer, rel=1e-9)
    # without FSDP nothing is gathered: the gradients are all-reduced after the backward instead
    ddp = simulate_plan(model, StepPlan(dp=2, fsdp=False, global_batch=2, optimizer_bytes_per_param=0), A100)
    assert ddp.breakdown["compute"] == 4 * 3.0 + 1.5


def test_fsdp_root_unit_of_each_pipeline_stage_holds_its_own_parts() -> None:
    # pp = 2: the first stage's root unit is the embedding (2^24 parameters), the last stage's the head (2^25);
    # each stage copies its own root out once and its gradients in once per micro-batch, on its compute stream
    pre, post = 1 << 24, 1 << 25
    plan = StepPlan(pp=2, dp=2, fsdp=True, global_batch=2, optimizer_bytes_per_param=0)
    model = costs(layers=4, pre=Part(forward=0.5, backward=0.25, params=pre),
                  post=Part(forward=0.25, backward=0.5, params=post))
    prediction = simulate_plan(model, plan, A100)

    def copies(params: int) -> float:
        return (2 * params * 2 + params * (2 + 2)) / A100.device.sustained + 2 * A100.device.launch_overhead

    first, last = prediction.ranks
    assert first.compute == pytest.approx(2 * 3.0 + 0.75 + copies(pre), rel=1e-12)
    assert last.compute == pytest.approx(2 * 3.0 + 0.75 + copies(post), rel=1e-12)


def test_fsdp_root_gather_overlaps_nothing_but_the_first_layer_gather_overlaps_the_embedding() -> None:
    # _prefetched with the root as a first step of the forward: the root's gather (0.5 s) then the embedding
    # (0.25 s of compute) while layer 0's gather (1 s) runs: layer 0 starts at 0.5 + 1, not at 0.5 + 0.25
    assert _prefetched([0.25, 2.0, 2.0], [0.5, 1.0, 1.0], [0.0] * 3) == 0.5 + 1.0 + 2.0 + 2.0


def test_bad_plans_are_one_line() -> None:
    with pytest.raises(ValueError, match="recompute='some'"):
        simulate_plan(costs(), StepPlan(recompute="some"), A100)
    with pytest.raises(ValueError, match="not a multiple of dp x micro-batch"):
        simulate_plan(costs(), StepPlan(dp=3, global_batch=4), A100)
    with pytest.raises(ValueError, match="at most one chunk per layer"):
        simulate_plan(costs(layers=4), StepPlan(pp=4, virtual_stages=2, global_batch=8), A100)


def small_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(2, 256, 8, vocab=1024, seq=128).to(torch.bfloat16)


def test_predict_step_end_to_end(tmp_path) -> None:
    model = small_gpt()
    ids = torch.zeros(2, 128, dtype=torch.long)
    before = {name: p.shape for name, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prediction = fxflops.predict_step(model, (ids,), {"tp": 2, "pp": 2, "dp": 2}, "DGX A100 80GB",
                                          global_batch=16, recompute="full", loss=lm_loss, layers=4,
                                          trace=tmp_path / "trace.json")
    assert {name: p.shape for name, p in model.named_parameters()} == before
    assert sum(prediction.breakdown.values()) == pytest.approx(prediction.step_time)
    assert prediction.plan.microbatches == 4 and prediction.plan.fsdp
    assert prediction.tokens_per_sec == pytest.approx(16 * 128 / prediction.step_time)
    assert prediction.hfu > prediction.mfu > 0
    assert [r.layers for r in prediction.ranks] == [2, 2]
    assert ERROR_STATEMENT in str(prediction) and prediction.as_dict()["error"] == ERROR_STATEMENT
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    compute = [e for e in trace["traceEvents"] if e["tid"] == "compute"]
    assert sum(1 for e in compute if e["name"].startswith("forward")) == 2 * 4  # 2 stages x 4 micro-batches
    critical = [e for e in trace["traceEvents"] if e["tid"] == "critical path"]
    assert critical and all(e["args"]["critical"] for e in critical)
    assert max(e["ts"] + e["dur"] for e in critical) == max(e["ts"] + e["dur"] for e in compute)
    page = prediction.to_html(tmp_path / "step.html")
    assert page.count("<rect") == len([e for e in trace["traceEvents"] if e["tid"] != "critical path"])
    assert page.count('stroke="black"') == len(critical) and ERROR_STATEMENT in page


def test_unfused_attention_is_timed_in_the_step_and_said() -> None:
    # attention="math": each attention op of the blocks takes op_time's unfused time instead of the fused one;
    # selective recomputation runs the forward's again. The step's compute changes by exactly those differences.
    from fxflops.predict.op_time import Kernels, node_seconds

    model = small_gpt()
    ids = torch.zeros(2, 128, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = fxflops.estimate(model, (ids,), backward=True, loss=lm_loss)
        steps = {kind: fxflops.predict_step(model, (ids,), {}, "DGX A100 80GB", recompute="selective", loss=lm_loss,
                                            attention=kind, attention_dropout=0.1) for kind in ("flash", "math")}
    device = A100.device
    unfused, fused = Kernels("math", 0.1), Kernels("flash", 0.1)
    nodes = [n for n in est.nodes if "attention" in n.op and n.module.startswith("layers.")]
    assert len(nodes) == 4  # two blocks, a forward and a backward each
    delta = sum(node_seconds(n, device, "bf16", unfused) - node_seconds(n, device, "bf16", fused) for n in nodes)
    delta += sum(node_seconds(n, device, "bf16", unfused) - node_seconds(n, device, "bf16", fused) for n in nodes
                 if n.phase == "forward")
    assert delta > 0
    assert steps["math"].breakdown["compute"] - steps["flash"].breakdown["compute"] == pytest.approx(delta, rel=1e-9)
    assert any("unfused ('math')" in note and "dropout 0.1" in note for note in steps["math"].notes)
    assert not any("unfused" in note for note in steps["flash"].notes)
    with pytest.raises(ValueError, match="attention='fused': pick one of flash, cudnn, math"):
        fxflops.predict_step(model, (ids,), {}, "DGX A100 80GB", loss=lm_loss, attention="fused")


def test_predict_step_refuses_what_it_does_not_predict() -> None:
    ids = torch.zeros(1, 128, dtype=torch.long)
    with pytest.raises(ValueError, match="bucket_cap_mb sizes DDP's gradient all-reduce buckets: give it with fsdp=False"):
        fxflops.predict_step(small_gpt(), (ids,), {"dp": 2, "bucket_cap_mb": 1})
    with pytest.raises(ValueError, match="loss_parallel splits the logits' vocabulary over the tp ranks; give tp > 1"):
        fxflops.predict_step(small_gpt(), (ids,), {"loss_parallel": True})
    with pytest.raises(ValueError, match="unknown parallel key 'tpp'|unknown parallel key tpp"):
        fxflops.predict_step(small_gpt(), (ids,), {"tpp": 2})
    with pytest.raises(ValueError, match="micro_batch=4 but the inputs hold a batch of 1"):
        fxflops.predict_step(small_gpt(), (ids,), micro_batch=4)


def test_sequence_parallel_a_model_cannot_run_is_left_out_and_said() -> None:
    # an output head the derived plan does not recognize (named 'head', not lm_head/output) is a plain linear
    # fed the sequence-sharded stream, which torch refuses: the step is predicted without sequence
    # parallelism, and the prediction's notes say so
    from tests.moe_models import MoEModel

    with torch.device("meta"):
        model = MoEModel(32, 16, 32, 4, 2, 2, "loop")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prediction = fxflops.predict_step(model, (torch.zeros(1, 64, dtype=torch.long),), {"tp": 2}, "DGX H100")
    assert not prediction.plan.sequence_parallel
    assert any(note.startswith("sequence parallelism failed on this model (fxflops could not capture MoEModel")
               for note in prediction.notes)


def test_mixtral_runs_sequence_parallel() -> None:
    # mixture-of-experts layers under sequence parallelism: tokens gathered into the layer, its output split
    # back (fxflops.parallel.megatron.moe_boundary); predicted with it, no note
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, num_local_experts=4, num_experts_per_tok=2,
                           attn_implementation="sdpa")
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prediction = fxflops.predict_step(model, (torch.zeros(1, 64, dtype=torch.long),), {"tp": 2}, "DGX H100")
    assert prediction.plan.sequence_parallel
    assert not any("sequence parallelism" in note for note in prediction.notes)


def test_hugging_face_llama_runs_sequence_parallel() -> None:
    # the residual stream stays a sequence-sharded DTensor, so Hugging Face Llama's rotary positions see the
    # whole sequence: predicted with sequence parallelism, no note. Width 128 (4 heads, 2 kv heads of 32),
    # MLP 256, vocabulary 512, 64 tokens at tp=2. A block: q, o 128^2 each, k, v 128 x 64 each, three MLP
    # matrices 128 x 256: 147,456 weights split 2 ways, plus two RMSNorms of 128 whole = 73,984.
    from transformers import LlamaConfig, LlamaForCausalLM

    from fxflops.predict.step import capture_costs

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(1, 64, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prediction = fxflops.predict_step(model, (ids,), {"tp": 2}, "DGX H100")
        costs = capture_costs(model, (ids,), cluster("DGX H100"), tp=2, sequence_parallel=True)
    # no note but the optimizer's timing (every prediction says how its optimizer step was timed)
    assert prediction.plan.sequence_parallel and [n for n in prediction.notes if "optimizer step" not in n] == []
    assert costs.block.params == 73_984
    assert costs.pre.params == 512 * 128 // 2  # the embedding vocabulary-parallel
    assert costs.post.params == 512 * 128 // 2 + 128  # the head split, the final norm whole
    assert costs.boundary_bytes == 1 * (64 // 2) * 128 * 2  # the sequence-sharded stream, bf16
    # per block two all-gathers and two reduce-scatters forward
    assert costs.block.comm_forward > 0


def test_per_layer_costs_hold_what_one_rank_holds() -> None:
    # GPT of width 256 (8 heads, MLP 1024, vocabulary 1024, 128 positions) at tp=2 with sequence parallelism,
    # one sequence of 128 tokens. A block: 4 x 256^2 + 2 x 256 x 1024 = 786,432 weights split 2 ways, the
    # column-parallel biases (q, k, v: 768; dense_h_to_4h: 1024) split, the row-parallel biases (2 x 256) and
    # the two LayerNorms (4 x 256) whole: 393,216 + 896 + 1,536 = 395,648.
    from fxflops.predict.step import capture_costs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        costs = capture_costs(small_gpt(), (torch.zeros(1, 128, dtype=torch.long),), A100, tp=2,
                              sequence_parallel=True, loss=lm_loss, layers=12)
    assert costs.block.params == 395_648
    # the word embedding split under sequence parallelism, the position embedding whole (as Megatron-LM keeps it)
    assert costs.pre.params == 1024 * 256 // 2 + 128 * 256
    assert costs.post.params == 1024 * 256 // 2 + 2 * 256  # the head split, the final LayerNorm whole
    assert costs.params == 12 * 395_648 + costs.pre.params + costs.post.params
    assert costs.boundary_bytes == 1 * (128 // 2) * 256 * 2  # the sequence-sharded stream, bf16
    assert costs.tokens == 128 and costs.captured_layers == 2 and costs.layers == 12
    assert costs.block.forward > 0 and costs.block.backward > costs.block.forward
    # sequence parallelism: per block two all-gathers and two reduce-scatters forward, as many backward
    assert costs.block.comm_forward > 0 and costs.block.comm_backward > 0


def test_a_calibrated_device_file_is_used_and_named(tmp_path) -> None:
    # calibrate from three tiny ops measured at 0.5 ms each: a device file whose only change is a launch overhead
    # of 0.5 ms (the preset's is 2 us); every timed op and the optimizer's one kernel take that much longer
    from fxflops.predict.calibrate import calibrate
    from fxflops.predict.op_time import estimate_seconds
    from fxflops.results.costs import COUNTED, NodeCost

    tiny = NodeCost(name="gelu", op="aten.gelu.default", status=COUNTED, rule="activation", module="act",
                    module_type="GELU", input_shapes=((64,),), output_shapes=((64,),), macs=0, flops=64, bytes=256)
    path = tmp_path / "our_a100.toml"
    calibrate([(tiny, 5e-4)] * 3, "A100 80GB SXM", "bf16", path=path, label="our node, synthetic")
    model, ids = small_gpt(), torch.zeros(1, 128, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        preset = fxflops.predict_step(model, (ids,), None, "DGX A100 80GB", loss=lm_loss)
        ours = fxflops.predict_step(model, (ids,), None, "DGX A100 80GB", loss=lm_loss, device=path)
        est = fxflops.estimate(model, (ids,), backward=True, loss=lm_loss)
        ops = estimate_seconds(est, "A100 80GB SXM", torch.bfloat16)["ops"]
    # less the capture's AccumulateGrad copy of each parameter's gradient, which a real step does not run (untimed);
    # each layer norm's backward launches two kernels (the input's gradient, then the weight's and bias's: 2 blocks x 2
    # + the final norm = 5)
    copies = sum(1 for _ in model.parameters())
    norms = sum(1 for n in est.nodes if n.op == "aten.native_layer_norm_backward.default")
    assert norms == 5
    assert ours.step_time - preset.step_time == pytest.approx((ops - copies + norms + 1) * (5e-4 - 2e-6), rel=1e-9)
    assert f"A100 80GB SXM from your file {path}" in str(ours) and ours.as_dict()["device_origin"] == f"your file {path}"
    assert "from your file" not in str(preset)


@pytest.mark.parametrize("cap", [0, -1.0, float("inf"), float("nan"), "8"])
def test_step_plan_refuses_a_bucket_cap_no_ddp_could_use(cap) -> None:
    with pytest.raises(ValueError, match=r"^bucket_cap_mb must be a finite number of MiB > 0 \(DDP's gradient bucket "
                                         r"size\); got "):
        StepPlan(dp=2, global_batch=2, bucket_cap_mb=cap).check(layers=2)


def test_deepspeed_engine_by_hand() -> None:
    """pipeline_engine="deepspeed": each boundary's activations and gradients go as DeepSpeed's PartitionedTensor
    (a meta tensor and the rank's 1/tp part, blocking sends), rebuilt by an all-gather over tp on the other
    side; the passes run DeepSpeed's TrainSchedule instruction by instruction; the gradients are reduced after
    the last backward."""
    from fxflops.predict.schedule import simulate_deepspeed
    from fxflops.predict.step import _deepspeed_boundary, dim_ranks_per_node

    device = A100.device
    size = 64 << 20
    p2p, rebuild, partition, received = _deepspeed_boundary(size, 2, A100, {"pp": 1, "tp": 2})
    # PartitionedTensor.to_meta(): ndims (1), 3 sizes, num_parts (1), rank (1) and partition_uniform's tp + 1
    # offsets, int64 each: 8 x (7 + tp) = 72 bytes at tp = 2
    assert p2p == pytest.approx(collective_seconds("send", 72, 2, A100, 1)
                                + collective_seconds("send", size // 2, 2, A100, 1), rel=1e-12)
    # full(): a zeroed buffer written, the local part copied in, the all-gather, the result cloned (read, written)
    assert rebuild == pytest.approx(collective_seconds("all_gather", size, 2, A100, 2)
                                    + (3 * size + 2 * (size // 2)) / device.sustained + 3 * device.launch_overhead,
                                    rel=1e-12)
    assert partition == pytest.approx(2 * (size // 2) / device.sustained + device.launch_overhead, rel=1e-12)
    # _exec_forward_pass clones the received buffers before full(): the 72-byte meta and the part, read and
    # written, two kernels; without tp the whole received activation
    assert received == pytest.approx((2 * 72 + 2 * (size // 2)) / device.sustained + 2 * device.launch_overhead,
                                     rel=1e-12)
    assert _deepspeed_boundary(size, 1, A100, {"pp": 1, "tp": 1}) == pytest.approx(
        (collective_seconds("send", size, 2, A100, 1), 0.0, 0.0, 2 * size / device.sustained + device.launch_overhead),
        rel=1e-12)

    # 4 layers (1 s / 2 s), pp = 2, tp = 2, 2 micro-batches: stage 0 partitions its output in its forward and
    # rebuilds its output and the received gradient in its backward; stage 1 rebuilds its input in its forward
    # and partitions its input's gradient in its backward
    layer_costs = dataclasses.replace(costs(layers=4), tp=2, boundary_bytes=size)
    plan = StepPlan(tp=2, pp=2, micro_batch=1, global_batch=2, pipeline_engine="deepspeed")
    placed = dim_ranks_per_node(plan, A100)
    p2p, rebuild, partition, received = _deepspeed_boundary(size, 2, A100, placed)
    prediction = simulate_plan(layer_costs, plan, A100)
    expected = simulate_deepspeed([ChunkCost(2.0 + partition, 4.0 + 2 * rebuild, p2p),
                                   ChunkCost(2.0 + received + rebuild, 4.0 + partition, p2p)], 2)
    assert prediction.step_time == pytest.approx(expected.step_time, rel=1e-12)
    assert [(e.kind, e.start) for e in prediction.timeline.events] == [(e.kind, e.start) for e in expected.events]

    # the data-parallel all-reduce runs after the last backward (DeepSpeed's ReduceGrads instruction), even when
    # the plan asks for overlap: each layer's reduction is exposed
    params = 50_000_000
    reduced = dataclasses.replace(costs(layers=4, params=params))
    plan = StepPlan(dp=2, micro_batch=1, global_batch=4, optimizer_bytes_per_param=0, pipeline_engine="deepspeed")
    # (in bf16, DeepSpeed's BF16_Optimizer reduces its fp32 gradients: 4 bytes an element)
    layer = collective_seconds("all_reduce", params * 4, 2, A100, 2)
    assert simulate_plan(reduced, plan, A100).breakdown["exposed_comm"] == pytest.approx(4 * layer)
    with pytest.raises(ValueError, match="DeepSpeed's TrainSchedule, a non-interleaved 1F1B"):
        simulate_plan(costs(), StepPlan(pp=2, virtual_stages=2, global_batch=4, pipeline_engine="deepspeed"), A100)
    with pytest.raises(ValueError, match="pipeline_engine='colossal': pick one of megatron, deepspeed"):
        simulate_plan(costs(), StepPlan(pipeline_engine="colossal"), A100)
    # DeepSpeed's PipelineEngine asserts zero_optimization_stage() < 2 ("ZeRO-2 and ZeRO-3 are incompatible with
    # pipeline parallelism"): FSDP with pp > 1 is refused, also when predict_step's default makes dp > 1 FSDP
    with pytest.raises(ValueError, match=r"^pipeline_engine='deepspeed' with pp > 1 runs ZeRO stage 0 or 1"):
        StepPlan(pp=2, dp=2, fsdp=True, global_batch=4, pipeline_engine="deepspeed").check(4)
    StepPlan(pp=2, dp=2, fsdp=False, distributed_optimizer=True, global_batch=4, pipeline_engine="deepspeed").check(4)
    StepPlan(pp=1, dp=2, fsdp=True, global_batch=4, pipeline_engine="deepspeed").check(4)  # ZeRO-3 without a pipeline
    with torch.device("meta"):
        gpt = GPT(2, 64, 4, vocab=128, seq=32).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^pipeline_engine='deepspeed' with pp > 1 runs ZeRO stage 0 or 1"):
        fxflops.predict_step(gpt, (torch.zeros(1, 32, dtype=torch.long),), {"pp": 2, "dp": 2},
                             pipeline_engine="deepspeed")


def test_predict_step_runs_deepspeed_engine_and_fused_chains_and_says_so(tmp_path) -> None:
    model = small_gpt()
    ids = torch.zeros(1, 128, dtype=torch.long)
    options = dict(global_batch=8, recompute="full", loss=lm_loss, layers=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = fxflops.predict_step(model, (ids,), {"tp": 2, "pp": 2, "dp": 2, "fsdp": False}, "DGX A100 80GB",
                                     **options)
        ds = fxflops.predict_step(model, (ids,), {"tp": 2, "pp": 2, "dp": 2, "fsdp": False}, "DGX A100 80GB",
                                  pipeline_engine="deepspeed", fuse_elementwise=True, trace=tmp_path / "ds.html",
                                  persistent_norm=True, **options)
    assert sum(ds.breakdown.values()) == pytest.approx(ds.step_time)
    assert ds.plan.pipeline_engine == "deepspeed" and not ds.plan.overlap_grad_reduce
    assert any("DeepSpeed's pipeline engine" in note for note in ds.notes)
    assert any("fuse_elementwise=True" in note for note in ds.notes)
    assert any("persistent_norm=True" in note for note in ds.notes)
    assert not any("DeepSpeed" in note or "fuse_elementwise" in note or "persistent" in note for note in plain.notes)
    assert "send forward" in (tmp_path / "ds.html").read_text()
    with pytest.raises(ValueError, match="pipeline_engine='deepspeed' runs DeepSpeed's TrainSchedule"):
        fxflops.predict_step(model, (ids,), {"pp": 2, "virtual_stages": 2}, "DGX A100 80GB",
                             pipeline_engine="deepspeed", **options)


def test_deepspeed_bf16_optimizer_by_hand() -> None:
    """DeepSpeed's engine in bf16 runs its BF16_Optimizer (bf16_optimizer.py, DeepSpeed #1801 as BigScience ran it):
    every backward casts each bf16 gradient to fp32 and adds it into an fp32 accumulator (update_hp_grads); the
    fp32 gradients are all-reduced; the step reads their global norm, updates the rank's 1/dp of the fp32 weights
    and Adam state, zeroes the fp32 gradients, and all-gathers the updated bf16 parameters over dp."""
    device = A100.device
    params = 50_000_000  # a layer's, on this rank
    layer_costs = costs(layers=4, params=params)
    plan = StepPlan(dp=2, micro_batch=1, global_batch=4, pipeline_engine="deepspeed")  # m = 2 micro-batches
    prediction = simulate_plan(layer_costs, plan, A100, "bf16")
    # each backward: the stage's 4 layers' gradients, 2 bytes read, 4 written (the cast), 4 + 4 read and 4 written
    # (the add): 18 bytes an element, two kernels
    accumulate = 4 * params * 18 / device.sustained + 2 * device.launch_overhead
    assert prediction.breakdown["compute"] == pytest.approx(2 * (4 * 3.0 + accumulate), rel=1e-12)
    # the fp32 gradients all-reduced after the backward, layer by layer as test_deepspeed_engine_by_hand has them
    assert prediction.breakdown["exposed_comm"] == pytest.approx(
        4 * collective_seconds("all_reduce", params * 4, 2, A100, 2), rel=1e-12)
    # Adam on the rank's half: fp32 weights, m and v read and written (24 bytes), the fp32 gradient read (4), the
    # bf16 weight written (2); the norm reads and clear_hp_grads zeroes every fp32 gradient (8 bytes, two kernels);
    # the updated bf16 parameters (2 bytes each) all-gathered over the 2 data-parallel ranks in one node
    optimizer = (2 * params * 30 / device.sustained + device.launch_overhead) \
        + (4 * params * 8 / device.sustained + 2 * device.launch_overhead) \
        + collective_seconds("all_gather", 4 * params * 2, 2, A100, 2)
    assert prediction.breakdown["optimizer"] == pytest.approx(optimizer, rel=1e-12)
    assert prediction.step_time == pytest.approx(sum(prediction.breakdown.values()), rel=1e-12)
    # Megatron-LM's engine does none of it: torch's AccumulateGrad in the second backward only (3 x 2 bytes an
    # element, one kernel), Adam over every parameter, no gather
    megatron = simulate_plan(layer_costs, dataclasses.replace(plan, pipeline_engine="megatron",
                                                              overlap_grad_reduce=False), A100, "bf16")
    assert megatron.breakdown["compute"] == pytest.approx(2 * 4 * 3.0 + 4 * params * 6 / device.sustained
                                                          + device.launch_overhead, rel=1e-12)
    assert megatron.breakdown["optimizer"] == pytest.approx(4 * params * (24 + 2 + 2) / device.sustained
                                                            + device.launch_overhead, rel=1e-12)


def test_deepspeed_bf16_optimizer_memory_by_hand() -> None:
    """The memory the BF16_Optimizer's step assumes (bf16_optimizer.py at DeepSpeed 56c5223): its fp32 master
    weights and Adam state hold the rank's 1/dp partition (fp32_groups_flat_partition), its fp32 gradients are
    whole (fp32_groups_gradients_flat, zeros_like the bf16 flat buffer) and the bf16 .grad of the last backward
    stays beside them (update_hp_grads(clear_lp_grads=False), cleared only by the next backward's clear_lp_grads)."""
    # 8 layers of 1,000 parameters saving 100 bytes a micro-batch; pp = 2, dp = 2, m = 4: the first stage holds
    # 4 layers and, in 1F1B, 2 micro-batches in flight
    block = Part(forward=1.0, backward=2.0, params=1000, saved_bytes=100)
    layer_costs = LayerCosts(1, False, 1, 10, 8, block, Part(), Part(), 40, 2, "bfloat16", "A100", 8)
    plan = StepPlan(pp=2, dp=2, micro_batch=1, global_batch=8, pipeline_engine="deepspeed")
    kinds = simulate_plan(layer_costs, plan, A100, "bf16").peak_memory.by_kind
    assert kinds == {"parameters": 4 * 1000 * 2, "gradients": 4 * 1000 * (4 + 2), "optimizer": 4 * 1000 * 12 // 2,
                     "activations": 2 * 4 * 100, "temporaries": 0}
    # fp16 (FP16_Optimizer): the fp16 .grad only, fp32 master weights and Adam state on every data-parallel rank
    kinds = simulate_plan(layer_costs, plan, A100, "fp16").peak_memory.by_kind
    assert (kinds["gradients"], kinds["optimizer"]) == (4 * 1000 * 2, 4 * 1000 * 12)


def test_deepspeed_bf16_optimizer_without_a_pipeline_and_says_so() -> None:
    # DeepSpeed's engine runs its BF16_Optimizer whatever pp (DeepSpeedEngine.backward calls optimizer.backward,
    # update_hp_grads included); fsdp=True over one data-parallel rank shards nothing, as the rest of the step has it:
    # 4 layers of 1 s / 2 s, m = 2, each backward adding 18 bytes an element of the 4 layers' gradients, two kernels
    device = A100.device
    params = 50_000_000
    accumulate = 4 * params * 18 / device.sustained + 2 * device.launch_overhead
    for fsdp in (False, True):
        plan = StepPlan(dp=1, fsdp=fsdp, micro_batch=1, global_batch=2, pipeline_engine="deepspeed")
        prediction = simulate_plan(costs(layers=4, params=params), plan, A100, "bf16")
        assert prediction.breakdown["compute"] == pytest.approx(2 * (4 * 3.0 + accumulate), rel=1e-12)
    ids = torch.zeros(1, 128, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prediction = fxflops.predict_step(small_gpt(), (ids,), {"dp": 2, "fsdp": False}, "DGX A100 80GB",
                                          global_batch=4, loss=lm_loss, layers=4, pipeline_engine="deepspeed")
    assert any(note.startswith("DeepSpeed's engine: the gradients accumulated by the engine in each backward "
                               "(BF16_Optimizer") for note in prediction.notes)


def test_deepspeed_fp16_accumulates_from_the_second_micro_batch_by_hand() -> None:
    """DeepSpeed's engine in fp16 (v0.5.x: FP16_Optimizer, no bf16 pipeline before v0.6): the gradients accumulate in
    the parameters' .grad, torch's AccumulateGrad adding each micro-batch's in place (read two, write one: 3 x 2
    bytes an element) from the second micro-batch on; the optimizer as it was, over every parameter."""
    device = A100.device
    params = 50_000_000
    plan = StepPlan(pp=2, micro_batch=1, global_batch=3, pipeline_engine="deepspeed")  # 2 layers a stage, m = 3
    prediction = simulate_plan(costs(layers=4, params=params), plan, NO_LATENCY, "fp16")
    accumulate = 2 * params * 6 / device.sustained + device.launch_overhead
    # p = 2, m = 3, F 2 s, B 4 s, transfers of nothing (no latency) but stage 1's forward clones what it received
    # (r: one kernel's launch); micro-batches 1 and 2's backwards take 4 s + a: stage 1 F0 2-4+r, B0 4+r-8+r,
    # F1 8+r-10+2r, B1 10+2r-14+2r+a, F2 -16+3r+a, B2 -20+3r+2a; stage 0's last backward waits for it: -24+3r+3a
    received = device.launch_overhead
    assert max(e.end for e in prediction.timeline.events) == pytest.approx(24.0 + 3 * received + 3 * accumulate,
                                                                           rel=1e-12)
    assert prediction.breakdown["compute"] == pytest.approx(3 * 2 * 3.0 + 2 * accumulate, rel=1e-12)
    # Adam over the stage's 2 layers (24 bytes of fp32 state read and written, the fp16 gradient read, the weight
    # written), after the last backward
    optimizer = 2 * params * (24 + 2 + 2) / device.sustained + device.launch_overhead
    assert prediction.breakdown["optimizer"] == pytest.approx(optimizer, rel=1e-12)
    assert prediction.step_time == pytest.approx(24.0 + 3 * received + 3 * accumulate + optimizer, rel=1e-12)
