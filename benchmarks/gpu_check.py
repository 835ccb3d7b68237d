"""Issue 42's device check: everything fxflops does on a real GPU, measured in one short run.

    python3 benchmarks/gpu_check.py --out DIR [--commit SHA]          # on the GPU (about 5 minutes)
    python benchmarks/gpu_check.py --out DIR --quick --device cpu     # a dry run of the same code on a CPU

It only measures, and writes what it measured as it goes (DIR/gpu_check.json, rewritten after every
section, so a run cut short keeps what it finished; DIR/gpu_check.log; DIR/pytest.txt). Every comparison
with a prediction is made afterwards, on any machine, by `benchmarks/gpu_tables.py`, which reads that file.
Sections, in order (each in its own try: one failing does not stop the others):

1. env: GPU, driver, clocks, torch and CUDA versions, the commit, the date.
2. ceilings: a bf16 8192^3 matrix product and a device-to-device copy (the two numbers METHOD.md asks for).
3. ops: ~30 GEMM shapes, SDPA attention (flash and cuDNN backends, forward and backward, several sequence
   lengths and head sizes, causal or not; the math backend at a few), memory-bound ops (layer norm, RMS
   norm, GELU, softmax, embedding, add, and two backwards), the linears of the Megatron-Core H100 rows of
   issue 41's validation at one rank's shapes (forward, input and weight gradient, the weight gradient also added
   into an fp32 buffer as Megatron's gradient-accumulation fusion does), fused attention (flash, cuDNN)
   with and without dropout at those rows' attention shapes, one optimizer.step() per
   implementation (for-loop, foreach, fused AdamW / Adam / SGD in bf16 and fp32), batch norm in training and a few
   convolutions (bf16, NCHW and channels-last, forward and backward, with the kernels each ran), each the median of
   CUDA-event timed calls with the L2 cache flushed between calls (triton's do_bench where there is triton).
4. tests: tests/test_cuda.py (every test marked cuda), its output in DIR/pytest.txt.
5. profile: fxflops.profile() on GPT-2 (bf16, batch 8, seq 1024) and ResNet-50 (bf16, batch 64): each
   module's CUDA-event latency against the kernel time torch.profiler attributes to the same module
   (record_function ranges opened and closed by hooks), and the hooked / plain forward ratio.
6. meter: FlopsMeter on real bf16 training steps of a small Llama: its logged MFU against FlopCounterMode's
   FLOPs of a real step / the step time measured here / the peak, and the meter's cost per step.
7. steps (not in the default --only): AdamW training steps of models no fit saw (a GQA Llama, GPT-2 medium,
   ResNet-50, ViT-B/16, two Megatron-shaped GPTs at sequence 4,096): step time, peak memory, top kernels.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BF16 = torch.bfloat16


class Run:
    """The results dict, written after each section; a log line per event."""

    def __init__(self, out: Path, quick: bool, device: str) -> None:
        self.out = out
        self.quick = quick
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.results: dict[str, Any] = {"quick": quick}
        self.started = time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(out / "gpu_check.log", "a", encoding="utf-8")

    def log(self, text: str) -> None:
        line = f"[{time.perf_counter() - self.started:7.1f}s] {text}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=1, default=str), encoding="utf-8")

    def section(self, name: str, body: Callable[[Run], Any]) -> None:
        self.log(f"== {name}")
        began = time.perf_counter()
        try:
            self.results[name] = body(self)
        except Exception as error:  # a section's failure is a result too: the others still run
            self.results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
            self.log(f"{name} FAILED: {type(error).__name__}: {error}")
        self.results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - began, 2)
        self.save()
        self.log(f"{name} done in {time.perf_counter() - began:.1f} s")


# ------------------------------------------------------------------------------------------- timing


def bench(run: Run, fn: Callable[[], Any], reps_ms: float = 40.0) -> list[float]:
    """Seconds per call of `fn`: on a GPU CUDA events around each call, the L2 flushed before each
    (a 256 MB write, as triton's do_bench does), after a warm-up; on a CPU perf_counter. Returns each timed
    call's seconds (the caller takes the median)."""
    if not run.cuda:
        fn()
        times = []
        for _ in range(3):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        return times
    flush = _flush_buffer(run)
    fn()
    torch.cuda.synchronize()
    began = torch.cuda.Event(enable_timing=True)
    ended = torch.cuda.Event(enable_timing=True)
    began.record()
    for _ in range(3):
        fn()
    ended.record()
    torch.cuda.synchronize()
    estimate_ms = max(began.elapsed_time(ended) / 3, 1e-3)
    count = int(min(max(reps_ms / estimate_ms, 5), 200))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
    for i in range(count):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]


def graph_seconds(run: Run, fn: Callable[[], Any], calls: int = 10) -> float | str | None:
    """Seconds per call when `calls` back-to-back calls are replayed from one CUDA graph: the kernels' own
    time with the host's launch cost out of the way (and no L2 flush between them). None on a CPU; the
    error's text where a call cannot be captured."""
    if not run.cuda or run.__dict__.get("no_graphs"):
        return None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
            graph.replay()
            ended.record()
            torch.cuda.synchronize()
            times.append(began.elapsed_time(ended) / 1e3 / calls)
        del graph
        return median(times)
    except Exception as error:  # not capturable: said, and no more captures tried (a failed one can poison the stream)
        run.no_graphs = True
        torch.cuda.synchronize()
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def _flush_buffer(run: Run) -> torch.Tensor:
    if "flush" not in run.__dict__:
        run.flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=run.device)
    return run.flush


def median(values: list[float]) -> float:
    return statistics.median(values)


def randn(run: Run, *shape: int, dtype: torch.dtype = BF16, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, device=run.device, dtype=dtype, requires_grad=grad)


# ------------------------------------------------------------------------------------------- sections


def env(run: Run) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": sys.version.split()[0],
        "commit": run.results.get("commit"),
        "script": "benchmarks/gpu_check.py",
        "device": str(run.device),
    }
    if run.cuda:
        props = torch.cuda.get_device_properties(run.device)
        info.update(name=props.name, sm_count=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}",
                    l2_mb=round(getattr(props, "L2_cache_size", 0) / 2**20, 1))
        info["nvidia_smi"] = _smi("name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,"
                                  "temperature.gpu,persistence_mode")
    for name in ("transformers", "torchvision", "triton"):
        try:
            info[name] = __import__(name).__version__
        except Exception as error:  # absent: say so
            info[name] = f"absent ({type(error).__name__})"
    run.log(json.dumps(info))
    return info


def _smi(fields: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv"], capture_output=True,
                              text=True, timeout=20).stdout.strip()
    except Exception as error:
        return f"nvidia-smi failed: {error}"


def ceilings(run: Run) -> dict[str, Any]:
    n = 1024 if run.quick else 8192
    a, b = randn(run, n, n), randn(run, n, n)
    ramp_until = time.perf_counter() + (0.0 if run.quick else 1.0)  # an idle GPU's clocks ramp up first
    while time.perf_counter() < ramp_until:
        a @ b
        if run.cuda:
            torch.cuda.synchronize()
    mm = median(bench(run, lambda: a @ b, 200))
    numel = (1 << 20) if run.quick else (1 << 30)  # 2 GiB of bf16
    src = randn(run, numel)
    dst = torch.empty_like(src)
    copy = median(bench(run, lambda: dst.copy_(src), 200))
    result = {"matmul": {"n": n, "seconds": mm, "tflops": 2 * n**3 / mm / 1e12},
              "copy": {"bytes_moved": 2 * src.numel() * 2, "seconds": copy, "tb_per_s": 4 * numel / copy / 1e12}}
    run.log(f"ceilings: matmul {result['matmul']['tflops']:.0f} TFLOP/s, copy {result['copy']['tb_per_s']:.2f} TB/s")
    return result


GEMMS = [  # (M, N, K): square, a transformer's linears (tokens x out x in), skinny and unaligned ones
    (256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
    (8192, 8192, 8192), (16384, 16384, 16384),
    (1000, 1000, 1000), (4095, 4095, 4095), (8191, 8191, 8191), (4097, 4097, 4097),
    (8192, 2304, 768), (8192, 768, 768), (8192, 3072, 768), (8192, 768, 3072), (8192, 50257, 768),
    (8192, 50304, 768), (16384, 12288, 4096), (16384, 4096, 4096), (16384, 28672, 4096), (16384, 4096, 14336),
    (4096, 1280, 8192), (4096, 8192, 1024), (4096, 3584, 8192), (4096, 8192, 3584),
    (16, 4096, 4096), (128, 4096, 4096), (64, 12288, 12288), (32768, 128, 128), (2048, 2048, 65536),
    (100, 8191, 1023), (3000, 5000, 7000),
]


def gemm_ops(run: Run) -> list[dict[str, Any]]:
    rows = []
    shapes = [(min(m, 512), min(n, 512), min(k, 512)) for m, n, k in GEMMS[:8]] if run.quick else GEMMS
    for m, n, k in shapes:
        a, b = randn(run, m, k), randn(run, k, n)
        seconds = median(bench(run, lambda: torch.mm(a, b)))  # noqa: B023
        rows.append({"kind": "gemm", "op": "mm", "shape": [m, n, k], "dtype": "bfloat16", "seconds": seconds,
                     "tflops": 2 * m * n * k / seconds / 1e12,
                     "graph_seconds": graph_seconds(run, lambda: torch.mm(a, b))})  # noqa: B023
        del a, b
    return rows


def gemm_grid(run: Run) -> list[dict[str, Any]]:
    """A linear's GEMM (x[M, K] @ W[N, K]^T, as nn.Linear runs it) over a grid of M, N, K: the measured
    3-D efficiency table a step-time model can read directly."""
    sizes = ([128, 256], [128, 384], [128, 256]) if run.quick else (
        [1024, 4096, 16384], [1024, 2048, 4096, 8192, 16384, 32768], [1024, 2048, 4096, 8192, 16384])
    rows = []
    for m in sizes[0]:
        for n in sizes[1]:
            for k in sizes[2]:
                x, w = randn(run, m, k), randn(run, n, k)
                seconds = median(bench(run, lambda: torch.nn.functional.linear(x, w), 25))  # noqa: B023
                rows.append({"kind": "gemm", "op": "linear", "shape": [m, n, k], "dtype": "bfloat16",
                             "seconds": seconds, "tflops": 2 * m * n * k / seconds / 1e12})
                del x, w
    return rows


# The Megatron-Core H100 rows of issue 41's validation (fxflops.predict.validation.RUNS: heads, hidden, tp; sequence
# 4,096, micro-batch 1, vocabulary 131,072): one rank's GEMMs of a layer and of the output layer, sequence-parallel
# (the token dim all-gathered: M = 4,096), forward, input gradient and weight gradient as autograd runs them
MEGATRON_ROWS = [("1.7B", 2048, 1), ("7.1B", 4096, 2), ("16B", 6144, 4), ("32B", 7168, 8)]


def megatron_gemm_shapes(tokens: int, hidden: int, tp: int, vocab: int) -> list[tuple[str, int, int]]:
    """(linear, out features, in features) of one tensor-parallel rank of a GPT layer and its output layer."""
    return [("qkv", 3 * hidden // tp, hidden), ("proj", hidden, hidden // tp), ("fc1", 4 * hidden // tp, hidden),
            ("fc2", hidden, 4 * hidden // tp), ("output", vocab // tp, hidden)]


def gemm_rows(run: Run) -> list[dict[str, Any]]:
    """Each linear of the Megatron-Core rows at its rank's shape: forward x[M, K] @ W[N, K]^T (F.linear), input
    gradient g[M, N] @ W[N, K], weight gradient g^T[N, M] @ x[M, K] (the layouts autograd's mm backward uses)."""
    tokens, vocab = (256, 1024) if run.quick else (4096, 131072)
    rows = []
    for name, hidden, tp in MEGATRON_ROWS[:1] if run.quick else MEGATRON_ROWS:
        hidden = 256 if run.quick else hidden
        for linear, n, k in megatron_gemm_shapes(tokens, hidden, tp, vocab):
            x, w, g = randn(run, tokens, k), randn(run, n, k), randn(run, tokens, n)
            calls = {"forward": (lambda: torch.nn.functional.linear(x, w), [tokens, n, k]),  # noqa: B023
                     "input_grad": (lambda: torch.mm(g, w), [tokens, k, n]),  # noqa: B023
                     "weight_grad": (lambda: torch.mm(g.t(), x), [n, k, tokens])}  # noqa: B023
            for pass_, (call, (m_, n_, k_)) in calls.items():
                seconds = median(bench(run, call, 25))
                rows.append({"kind": "gemm", "op": "mm", "row": name, "linear": linear, "pass": pass_,
                             "shape": [m_, n_, k_], "dtype": "bfloat16", "seconds": seconds,
                             "tflops": 2 * m_ * n_ * k_ / seconds / 1e12})
            if run.cuda:
                rows.append(_fp32_accumulating_weight_grad(run, name, linear, g, x))
            del x, w, g
    return rows


def _fp32_accumulating_weight_grad(run: Run, name: str, linear: str, g: torch.Tensor, x: torch.Tensor
                                   ) -> dict[str, Any]:
    """The weight gradient as Megatron's gradient-accumulation fusion runs it: bf16 operands, the product added
    into an fp32 main_grad (cuBLAS with beta = 1, `wgrad_gemm_accum_fp32`); here addmm with an fp32 output, which
    reads the fp32 buffer and writes one. The rows' wgrad GEMMs are timed as bf16 products (issue 41); this row
    says what the fp32 epilogue costs. Kind "gemm_fp32_accumulate": op_table does not fit from it."""
    n, m, k = g.shape[1], x.shape[1], g.shape[0]
    row: dict[str, Any] = {"kind": "gemm_fp32_accumulate", "op": "addmm", "row": name, "linear": linear,
                           "pass": "weight_grad", "shape": [n, m, k], "dtype": "bfloat16", "out_dtype": "float32"}
    try:
        main_grad = torch.zeros(n, m, device=run.device, dtype=torch.float32)
        seconds = median(bench(run, lambda: torch.addmm(main_grad, g.t(), x, out_dtype=torch.float32), 25))
        row.update(seconds=seconds, tflops=2 * n * m * k / seconds / 1e12)
    except (RuntimeError, TypeError) as error:  # a torch without addmm's out_dtype: a finding, not a failure
        row["error"] = str(error).splitlines()[0][:300]
    return row


def gemm_alignment(run: Run) -> list[dict[str, Any]]:
    """4096^3 with one of K, N or M made 1 to 64 short of 4096: how much each dimension's alignment costs
    (a 16-byte-aligned bf16 row needs a multiple of 8 elements)."""
    base = 256 if run.quick else 4096
    rows = []
    for axis in ("k", "n", "m"):
        for short in (0, 1, 2, 4, 8, 16, 64):
            m, n, k = (base - short if axis == name else base for name in ("m", "n", "k"))
            x, w = randn(run, m, k), randn(run, n, k)
            seconds = median(bench(run, lambda: torch.nn.functional.linear(x, w), 25))  # noqa: B023
            rows.append({"kind": "gemm", "op": "linear", "shape": [m, n, k], "dtype": "bfloat16", "axis": axis,
                         "seconds": seconds, "tflops": 2 * m * n * k / seconds / 1e12})
            del x, w
    return rows


def attention_shapes(run: Run) -> list[tuple[int, int, int, int]]:
    """(batch, heads, seq, head dim) at 16k tokens and a model width of 2048, as FlashAttention-3's figures."""
    seqs = [128, 256] if run.quick else [512, 1024, 2048, 4096, 8192, 16384]
    tokens = 512 if run.quick else 16384
    width = 256 if run.quick else 2048
    return [(max(tokens // s, 1), width // d, s, d) for d in (64, 128) for s in seqs]


def attention_ops(run: Run) -> list[dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"math": SDPBackend.MATH}
    if run.cuda:
        backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    rows = []
    for label, backend in backends.items():
        for b, h, s, d in attention_shapes(run):
            if label == "math" and (s > (256 if run.quick else 2048) or d != 128):
                continue  # the unfused kernels hold b*h*s*s scores: a few points are enough
            if label == "cudnn" and d != 128:
                continue
            for causal in (False, True):
                q, k, v = (randn(run, b, h, s, d, grad=True) for _ in range(3))
                try:
                    with sdpa_kernel([backend]):
                        call = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: B023,E731
                        forward = median(bench(run, call))
                        forward_graph = graph_seconds(run, call)
                        out = call()
                        grad = torch.randn_like(out)
                        backward = median(bench(run, lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)))  # noqa: B023
                except RuntimeError as error:  # a backend refusing a shape is a finding, not a failure
                    rows.append({"kind": "attention", "backend": label, "shape": [b, h, s, d], "causal": causal,
                                 "error": str(error).splitlines()[0][:300]})
                    continue
                finally:
                    del q, k, v
                dense = 4 * b * h * s * s * d
                kept = dense / 2 if causal else dense
                rows.append({"kind": "attention", "backend": label, "shape": [b, h, s, d], "causal": causal,
                             "dtype": "bfloat16", "forward_seconds": forward, "backward_seconds": backward,
                             "forward_graph_seconds": forward_graph,
                             "forward_tflops_kept": kept / forward / 1e12,
                             "backward_tflops_kept": 2.5 * kept / backward / 1e12})
    return rows


def attention_dropout_shapes(run: Run) -> list[tuple[int, int, int, int]]:
    """(batch, heads, seq, head dim) of one rank's attention in issue 41's Megatron-Core H100 rows (micro-batch 1,
    sequence 4,096, head dim 128; 16, 32 / 2, 48 / 4 and 56 / 8 heads a rank)."""
    if run.quick:
        return [(1, 2, 128, 64)]
    return [(1, heads, 4096, 128) for heads in (16, 12, 7)]


def attention_dropout_ops(run: Run) -> list[dict[str, Any]]:
    """Fused attention with and without dropout on the probabilities (p = 0.1, the Megatron-Core rows'), forward
    and backward apart: no Hopper measurement of what dropout costs inside a fused kernel at these shapes is
    published (issue 41), so the rows time it without; these rows are that measurement."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION} if run.cuda \
        else {"math": SDPBackend.MATH}
    rows = []
    for label, backend in backends.items():
        for b, h, s, d in attention_dropout_shapes(run):
            for p in (0.0, 0.1):
                q, k, v = (randn(run, b, h, s, d, grad=True) for _ in range(3))
                row: dict[str, Any] = {"kind": "attention_dropout", "backend": label, "shape": [b, h, s, d],
                                       "causal": True, "dropout_p": p, "dtype": "bfloat16"}
                try:
                    with sdpa_kernel([backend]):
                        call = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                            q, k, v, dropout_p=p, is_causal=True)  # noqa: B023
                        row["forward_seconds"] = median(bench(run, call))
                        out = call()
                        grad = torch.randn_like(out)
                        row["backward_seconds"] = median(bench(
                            run, lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)))  # noqa: B023
                except RuntimeError as error:  # a backend refusing dropout at a shape is a finding, not a failure
                    row["error"] = str(error).splitlines()[0][:300]
                finally:
                    del q, k, v
                rows.append(row)
    return rows


def memory_ops(run: Run) -> list[dict[str, Any]]:
    """(name, shapes, call) of memory-bound ops at sizes from a few KB (launch-bound) to a few hundred MB."""
    f = torch.nn.functional
    rows = []
    token_counts = [64, 8192] if run.quick else [16, 1024, 8192, 32768]
    widths = [64, 256] if run.quick else [768, 4096, 8192]
    for tokens in token_counts:
        for width in widths:
            x = randn(run, tokens, width)
            w, bias = randn(run, width), randn(run, width)
            cases = {
                "layer_norm": lambda: f.layer_norm(x, (width,), w, bias),  # noqa: B023
                "rms_norm": lambda: f.rms_norm(x, (width,), w),  # noqa: B023
                "gelu": lambda: f.gelu(x),  # noqa: B023
                "gelu_tanh": lambda: f.gelu(x, approximate="tanh"),  # noqa: B023
                "silu": lambda: f.silu(x),  # noqa: B023
                "softmax": lambda: torch.softmax(x, -1),  # noqa: B023
                "add": lambda: x + x,  # noqa: B023
                "mul": lambda: x * w,  # noqa: B023
            }
            for name, call in cases.items():
                rows.append({"kind": "memory", "op": name, "shape": [tokens, width], "dtype": "bfloat16",
                             "seconds": median(bench(run, call)), "graph_seconds": graph_seconds(run, call)})
            xg = randn(run, tokens, width, grad=True)
            for name, make in (("gelu_backward", lambda t: f.gelu(t)),
                               ("layer_norm_backward", lambda t: f.layer_norm(t, (width,), w, bias))):  # noqa: B023
                out = make(xg)
                grad = torch.randn_like(out)
                seconds = median(bench(run, lambda: torch.autograd.grad(out, (xg,), grad, retain_graph=True)))  # noqa: B023
                rows.append({"kind": "memory", "op": name, "shape": [tokens, width], "dtype": "bfloat16",
                             "seconds": seconds})
            del x, xg
    vocabularies = [(1000, 64)] if run.quick else [(50257, 768), (128256, 4096), (32000, 8192)]
    for vocab, width in vocabularies:
        table = randn(run, vocab, width)
        for tokens in token_counts:
            ids = torch.randint(0, vocab, (tokens,), device=run.device)
            call = lambda: f.embedding(ids, table)  # noqa: B023,E731
            rows.append({"kind": "memory", "op": "embedding", "shape": [tokens, vocab, width], "dtype": "bfloat16",
                         "seconds": median(bench(run, call)), "graph_seconds": graph_seconds(run, call)})
    scores = [(2, 2, 64, 64)] if run.quick else [(8, 12, 1024, 1024), (1, 32, 4096, 4096)]
    for shape in scores:
        x = randn(run, *shape)
        call = lambda: torch.softmax(x, -1)  # noqa: B023,E731
        rows.append({"kind": "memory", "op": "softmax", "shape": list(shape), "dtype": "bfloat16",
                     "seconds": median(bench(run, call)), "graph_seconds": graph_seconds(run, call)})
    return rows


# (N, C, H, W) of batch norms: ResNet-50's planes at batch 64 (few channels x large planes to many channels x 7 x 7),
# and one larger batch
BATCH_NORM_SHAPES = [(64, 64, 112, 112), (64, 64, 56, 56), (64, 256, 56, 56), (64, 512, 28, 28), (64, 1024, 14, 14),
                     (64, 2048, 7, 7), (256, 64, 56, 56)]
# (N, C_in, H, W, C_out, kernel, stride, input needs a gradient) of convolutions: a 3x3, a 1x1 expansion, a strided
# 3x3, a 7x7 first layer (its input needs no gradient: the weight's gradient alone)
CONV_SHAPES = [(64, 64, 56, 56, 64, 3, 1, True), (64, 64, 56, 56, 256, 1, 1, True), (64, 128, 56, 56, 128, 3, 2, True),
               (64, 3, 224, 224, 64, 7, 2, False)]


def _layouts(*tensors: torch.Tensor) -> dict[str, tuple[torch.Tensor, ...]]:
    """The tensors as NCHW (contiguous) and as channels-last copies (leaf tensors, gradients kept where asked)."""
    last = tuple(t.detach().to(memory_format=torch.channels_last).requires_grad_(t.requires_grad) for t in tensors)
    return {"nchw": tensors, "channels_last": last}


def batch_norm_ops(run: Run) -> list[dict[str, Any]]:
    """torch's batch norm in training (bf16), forward and forward + backward, NCHW and channels-last: the median time
    and which kernels ran (torch.profiler: name, launches, device time; issue 41's batch-norm kernel model)."""
    rows = []
    for shape in [(2, 8, 16, 16), (4, 32, 8, 8)] if run.quick else BATCH_NORM_SHAPES:
        norm = torch.nn.BatchNorm2d(shape[1]).to(run.device, BF16).train()
        for layout, (x,) in _layouts(randn(run, *shape, grad=True)).items():
            grad = torch.randn_like(x)
            forward = lambda: norm(x)  # noqa: B023,E731
            both = lambda: torch.autograd.grad(norm(x), (x, norm.weight, norm.bias), grad)  # noqa: B023,E731
            rows.append({"kind": "batch_norm", "op": "batch_norm_train", "shape": list(shape), "layout": layout,
                         "dtype": "bfloat16", "forward_seconds": median(bench(run, forward)),
                         "forward_backward_seconds": median(bench(run, both)), "kernels": step_kernels(run, both)})
    return rows


def conv_ops(run: Run) -> list[dict[str, Any]]:
    """bf16 convolutions, forward and forward + backward, NCHW and channels-last: the median time and the kernels
    cuDNN ran (its NCHW <-> NHWC conversions counted per call: issue 41's layout-conversion rule)."""
    rows = []
    shapes = [(2, 8, 16, 16, 8, 3, 1, True), (2, 3, 32, 32, 8, 7, 2, False)] if run.quick else CONV_SHAPES
    for n, c, h, w, k, size, stride, input_grad in shapes:
        conv = torch.nn.Conv2d(c, k, size, stride, size // 2, bias=False).to(run.device, BF16)
        for layout, (x, weight) in _layouts(randn(run, n, c, h, w, grad=input_grad),
                                            conv.weight.detach().requires_grad_()).items():
            f = lambda: torch.nn.functional.conv2d(x, weight, None, stride, size // 2)  # noqa: B023,E731
            grad = torch.randn_like(f())
            wanted = (x, weight) if input_grad else (weight,)
            both = lambda: torch.autograd.grad(f(), wanted, grad)  # noqa: B023,E731
            rows.append({"kind": "conv", "op": "conv2d", "shape": [n, c, h, w, k, size, stride], "layout": layout,
                         "input_grad": input_grad, "dtype": "bfloat16", "forward_seconds": median(bench(run, f)),
                         "forward_backward_seconds": median(bench(run, both)), "kernels": step_kernels(run, both)})
    return rows


def ops(run: Run) -> dict[str, Any]:
    result: dict[str, Any] = {}
    parts = {"gemm": gemm_ops, "attention": attention_ops, "attention_dropout": attention_dropout_ops,
             "memory": memory_ops, "gemm_grid": gemm_grid,
             "gemm_alignment": gemm_alignment, "gemm_rows": gemm_rows, "optimizers": optimizer_steps,
             "batch_norm": batch_norm_ops, "conv": conv_ops}
    for name in run.parts or list(parts):
        body = parts[name]
        began = time.perf_counter()
        try:
            result[name] = body(run)
        except Exception as error:
            result[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        run.log(f"ops.{name}: {len(result[name]) if isinstance(result[name], list) else 'FAILED'} rows "
                f"in {time.perf_counter() - began:.1f} s")
        run.results["ops"] = result
        run.save()
        if run.cuda:
            torch.cuda.empty_cache()
    return result


def tests(run: Run) -> dict[str, Any]:
    if not run.cuda:
        return {"skipped": "no GPU: tests/test_cuda.py skips itself"}
    env_vars = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-m", "cuda", "-s",
               "tests/test_cuda.py"]
    began = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env_vars, capture_output=True, text=True, timeout=240)
    (run.out / "pytest.txt").write_text(done.stdout + "\n--- stderr\n" + done.stderr, encoding="utf-8")
    tail = done.stdout.strip().splitlines()[-1:] or [""]
    run.log(f"pytest: rc {done.returncode}, {tail[0]}")
    return {"returncode": done.returncode, "summary": tail[0], "seconds": time.perf_counter() - began}


# ------------------------------------------------------------------------------------ profile section


def kernel_times_per_module(run: Run, model: torch.nn.Module, call: Callable[[], Any], steps: int
                            ) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per forward step of GPU kernels torch.profiler attributes to each module: a record_function
    range per module call, opened by a pre-hook and closed by a hook; a range's device time counts the
    kernels launched inside it (its children's too)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    open_ranges: dict[int, list[Any]] = {}
    handles = []
    for name, module in model.named_modules():
        label = f"fxm::{name or '<root>'}"

        def enter(mod, args, label=label):
            rf = record_function(label)
            rf.__enter__()
            open_ranges.setdefault(id(mod), []).append(rf)

        def leave(mod, args, output):
            open_ranges[id(mod)].pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.cuda else [])
    try:
        with torch.no_grad():
            call()
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    call()
                if run.cuda:
                    torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    from torch.autograd import DeviceType

    kernels: dict[str, float] = {}
    spans: dict[str, float] = {}
    for event in prof.events():
        if not event.name.startswith("fxm::"):
            continue
        name = event.name[5:]
        if event.device_type == DeviceType.CPU:  # the range on the host: the kernels launched inside it
            seconds = (event.device_time_total if run.cuda else event.cpu_time_total) / 1e6
            kernels[name] = kernels.get(name, 0.0) + seconds / steps
        else:  # the same range as the GPU ran it (a gpu_user_annotation): first kernel's start to last's end
            spans[name] = spans.get(name, 0.0) + event.device_time_total / 1e6 / steps
    return kernels, spans


def bare_forward(run: Run, call: Callable[[], Any], steps: int) -> float:
    with torch.no_grad():
        return median(bench(run, call, 100)) if run.cuda else median([_timed(call) for _ in range(steps)])


def _timed(call: Callable[[], Any]) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def profile_one(run: Run, label: str, model: torch.nn.Module, inputs: tuple[Any, ...]) -> dict[str, Any]:
    import fxflops

    steps = 3 if run.quick else 10
    began = time.perf_counter()
    result = fxflops.profile(model, inputs, steps=steps, warm_up=3)
    profile_seconds = time.perf_counter() - began
    m = result.measurements
    kernels, spans = kernel_times_per_module(run, model, lambda: model(*inputs), 5 if not run.quick else 2)
    modules = {}
    for name, stats in result.modules.items():
        modules[name or "<root>"] = {"type": stats.type if hasattr(stats, "type") else None,
                                     "latency": stats.latency, "calls": stats.calls,
                                     "flops": getattr(stats, "flops", None),
                                     "kernel_seconds": kernels.get(name or "<root>"),
                                     "gpu_span_seconds": spans.get(name or "<root>")}
    prediction = result.prediction
    row = {
        "model": label, "timer": m.timer, "device_name": m.device_name, "steps": m.steps,
        "fwd_latency": m.fwd_latency, "fwd_latency_median": m.fwd_latency_median,
        "hooked_fwd_latency": m.hooked_fwd_latency, "hook_overhead": m.hook_overhead,
        "bare_forward_flushed": bare_forward(run, lambda: model(*inputs), steps),
        "flops": result.fwd_flops, "achieved_flops": result.achieved_flops,
        "utilization": result.utilization, "peak_flops": m.peak_flops, "peak_source": m.peak_flops_source,
        "predicted_latency": prediction.latency if prediction is not None else None,
        "prediction_device": prediction.device if prediction is not None else None,
        "profile_call_seconds": profile_seconds, "modules": modules,
        "extra": {key: m.extra[key] for key in ("module_latency", "host_launch_plain", "host_launch_hooked")
                  if key in m.extra},
        "unmatched_measured": list(m.unmatched_measured), "unmatched_graph": list(m.unmatched_graph),
    }
    run.log(f"profile {label}: fwd {m.fwd_latency * 1e3:.3f} ms, hooked {m.hooked_fwd_latency and m.hooked_fwd_latency * 1e3:.3f} ms, "
            f"root kernels {kernels.get('<root>', 0) * 1e3:.3f} ms, utilization {result.utilization}")
    return row


def profiles(run: Run) -> dict[str, Any]:
    from fxflops.cli.examples import get_example

    rows: dict[str, Any] = {}
    example = get_example("gpt2-small")
    sizes = {"n_layer": 2, "d_model": 64, "n_head": 2} if run.quick else {}
    try:
        gpt2 = example.build(**sizes).to(run.device, BF16).eval()
        (ids,) = example.inputs(batch=2 if run.quick else 8, seq_len=64 if run.quick else 1024, device=run.device)
        rows["gpt2"] = profile_one(run, "GPT-2 small, bf16, batch 8, seq 1024", gpt2, (ids,))
        del gpt2
    except Exception as error:
        rows["gpt2"] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        run.log(f"profile gpt2 FAILED: {error}")
    run.results["profile"] = rows
    run.save()
    try:
        import torchvision

        resnet = torchvision.models.resnet50().to(run.device, BF16).eval()
        x = randn(run, 2 if run.quick else 64, 3, 64 if run.quick else 224, 64 if run.quick else 224)
        rows["resnet50"] = profile_one(run, "ResNet-50, bf16, batch 64, 224x224", resnet, (x,))
    except Exception as error:
        rows["resnet50"] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        run.log(f"profile resnet50 FAILED: {error}")
    return rows


# -------------------------------------------------------------------------------------- meter section


def small_llama(run: Run) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if run.quick:
        config = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    else:
        config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                             num_key_value_heads=16, vocab_size=32000, max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(run.device, BF16).train()


def meter(run: Run) -> dict[str, Any]:
    import fxflops
    from torch.utils.flop_counter import FlopCounterMode

    model = small_llama(run)
    batch_size, seq = (2, 64) if run.quick else (8, 1024)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, seq), device=run.device)
    batch = {"input_ids": ids, "labels": ids}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step() -> None:
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    steps = 3 if run.quick else 10
    for _ in range(3):
        train_step()
    bare = [_step_seconds(run, train_step) for _ in range(steps)]

    counter = FlopCounterMode(display=False)
    with counter:
        model(**batch).loss.backward()
    opt.zero_grad(set_to_none=True)
    oracle_flops = counter.get_total_flops()

    began = time.perf_counter()
    flops_meter = fxflops.FlopsMeter(model, batch, optimizer=opt, conventions="torch")
    construct = time.perf_counter() - began
    logged = []
    metered = []
    for _ in range(steps):
        if run.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        flops_meter.start()
        flops_meter.micro_batch(batch)
        train_step()
        stats = flops_meter.step()
        if run.cuda:
            torch.cuda.synchronize()
        metered.append(time.perf_counter() - t0)
        logged.append({"flops": stats.flops, "time": stats.time, "mfu": stats.mfu, "peak": stats.peak_flops,
                       "tokens_per_sec": stats.tokens_per_sec})
    bare_median = median(bare)
    peak = logged[-1]["peak"]
    kernels = step_kernels(run, train_step)
    result = {
        "model": f"Llama {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, bf16, AdamW, "
                 f"batch {batch_size}, seq {seq}",
        "oracle_flops": oracle_flops, "bare_step_seconds": bare, "metered_step_seconds": metered,
        "meter_construct_seconds": construct, "logged": logged,
        "mfu_from_oracle": oracle_flops / bare_median / peak if peak else None,
        "meter_overhead_seconds": median(metered) - bare_median,
        "kernels": kernels,
    }
    run.log(f"meter: oracle {oracle_flops:.4g} FLOPs, meter {logged[-1]['flops']}, bare step {bare_median * 1e3:.2f} ms, "
            f"metered {median(metered) * 1e3:.2f} ms, mfu logged {logged[-1]['mfu']}, from oracle {result['mfu_from_oracle']}")
    return result


def step_kernels(run: Run, step: Callable[[], None]) -> dict[str, Any]:
    """The GPU kernels of one step as torch.profiler sees them: the busy time, and the 40 longest kernels
    by total time (which attention kernel SDPA picked, how long the optimizer's kernels take)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not run.cuda:
        return {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != DeviceType.CPU and not event.is_user_annotation:
            entry = totals.setdefault(event.name[:160], [0.0, 0])
            entry[0] += event.device_time_total / 1e6
            entry[1] += 1
    busy = sum(seconds for seconds, _ in totals.values())
    top = sorted(totals.items(), key=lambda item: -item[1][0])[:40]
    return {"busy_seconds": busy, "top": [[name, seconds, count] for name, (seconds, count) in top]}


def training_models(run: Run) -> list[tuple[str, Callable[[], tuple[torch.nn.Module, Callable[[], Any]]]]]:
    """(label, build) of models no fit saw: build() makes (model, loss) on the device, one model at a time, so
    a step's peak memory holds no other model's weights (run 6 built all four first: its peaks did)."""
    import torchvision
    from transformers import LlamaConfig, LlamaForCausalLM

    from fxflops.cli.examples import get_example

    quick = run.quick
    shape = (2, 64) if quick else (4, 2048)

    def llama() -> tuple[torch.nn.Module, Callable[[], Any]]:
        config = LlamaConfig(hidden_size=128 if quick else 2048, intermediate_size=344 if quick else 5632,
                             num_hidden_layers=2 if quick else 16, num_attention_heads=4 if quick else 16,
                             num_key_value_heads=2 if quick else 4, vocab_size=512 if quick else 32000,
                             max_position_embeddings=4096)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(run.device, BF16).train()
        ids = torch.randint(0, config.vocab_size, shape, device=run.device)
        return model, lambda: model(input_ids=ids, labels=ids).loss

    def gpt2() -> tuple[torch.nn.Module, Callable[[], Any]]:
        example = get_example("gpt2-small")
        model = example.build(**({"n_layer": 2, "d_model": 64, "n_head": 2} if quick else
                                 {"n_layer": 24, "d_model": 1024, "n_head": 16})).to(run.device, BF16).train()
        (tokens,) = example.inputs(batch=2 if quick else 8, seq_len=64 if quick else 1024, device=run.device)
        return model, lambda: torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())

    def vision(make: Callable[[], torch.nn.Module]) -> Callable[[], tuple[torch.nn.Module, Callable[[], Any]]]:
        def build() -> tuple[torch.nn.Module, Callable[[], Any]]:
            model = make().to(run.device, BF16).train()
            images = randn(run, 4 if quick else 64, 3, 64 if quick else 224, 64 if quick else 224)
            labels = torch.randint(0, 1000, (images.shape[0],), device=run.device)
            return model, lambda: torch.nn.functional.cross_entropy(model(images).float(), labels)
        return build

    def megatron_gpt(hidden: int, heads: int) -> Callable[[], tuple[torch.nn.Module, Callable[[], Any]]]:
        def build() -> tuple[torch.nn.Module, Callable[[], Any]]:
            from fxflops.predict.validation import GPT, lm_loss

            torch.manual_seed(0)
            seq, vocab = (64, 1024) if quick else (4096, 131072)
            model = GPT(2 if quick else 4, 64 if quick else hidden, 2 if quick else heads, vocab=vocab,
                        seq=seq).to(run.device, BF16).train()
            ids = torch.randint(0, vocab, (1, seq), device=run.device)
            return model, lambda: lm_loss(model(ids))
        return build

    return [(f"Llama GQA 16 layers x 2048, kv 4, bf16, batch {shape[0]} x {shape[1]}", llama),
            ("GPT-2 medium-shaped (24 x 1024), bf16, batch 8 x 1024", gpt2),
            ("ResNet-50, bf16, batch 64", vision(torchvision.models.resnet50)),
            ("ViT-B/16, bf16, batch 64", vision(lambda: torchvision.models.vit_b_16(image_size=64 if quick else 224))),
            ("Megatron GPT 4 x 2048, 16 heads, vocab 131072, bf16, batch 1 x 4096", megatron_gpt(2048, 16)),
            ("Megatron GPT 4 x 4096, 32 heads, vocab 131072, bf16, batch 1 x 4096", megatron_gpt(4096, 32))]


def steps(run: Run) -> dict[str, Any]:
    """Training steps (AdamW, bf16 weights) of models no fit saw: median step time, peak memory, kernels."""
    result = {}
    for label, build in training_models(run):
        model = opt = loss = None
        try:
            resident = torch.cuda.memory_allocated(run.device) if run.cuda else None  # what else is on the GPU
            model, loss = build()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step() -> None:
                loss().backward()  # noqa: B023
                opt.step()  # noqa: B023
                opt.zero_grad(set_to_none=True)  # noqa: B023

            for _ in range(3):
                step()
            if run.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = [_step_seconds(run, step) for _ in range(3 if run.quick else 10)]
            peak = torch.cuda.max_memory_allocated() if run.cuda else None
            # the bytes the tensors asked for, without the allocator's block rounding (issue 41's memory check)
            requested = torch.cuda.memory_stats().get("requested_bytes.all.peak") if run.cuda else None
            result[label] = {"step_seconds": times, "median": median(times), "peak_allocated": peak,
                             "peak_requested": requested,
                             "resident_before_bytes": resident, "kernels": step_kernels(run, step),
                             "params": sum(p.numel() for p in model.parameters())}
            shown = f"{peak / 2**30:.2f} GiB" if peak else "not measured"
            run.log(f"steps {label}: {median(times) * 1e3:.2f} ms, peak {shown}")
        except Exception as error:
            result[label] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
            run.log(f"steps {label} FAILED: {error}")
        finally:
            del model, opt, loss
            step = None  # noqa: F841 - its closure held the model
            if run.cuda:
                torch.cuda.empty_cache()
        run.results["steps"] = result
        run.save()
    return result


def optimizer_steps(run: Run) -> list[dict[str, Any]]:
    """One optimizer.step() alone, per implementation (torch's for-loop, foreach, fused), optimizer and dtype, over
    48 weight-shaped tensors with gradients set: the GPU time of the step's kernels (CUDA events around step(),
    median of timed calls) and the step's wall time. What the step-time model's optimizer term predicts."""
    shapes = [(64, 64)] * 8 if run.quick else [(2048, 8192)] * 24 + [(8192, 2048)] * 24  # ~805M elements
    cases = [("AdamW", {"weight_decay": 1e-2}), ("Adam", {}), ("SGD", {"momentum": 0.9})]
    rows = []
    for dtype in (BF16, torch.float32):
        params = [torch.nn.Parameter(randn(run, *shape, dtype=dtype)) for shape in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        for name, options in cases:
            for impl in ("for_loop", "foreach", "fused"):
                flags = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
                try:
                    opt = getattr(torch.optim, name)(params, lr=1e-4, **options, **flags)
                    opt.step()  # the state allocated outside the timed calls
                    if run.cuda:
                        torch.cuda.synchronize()
                    seconds = median(bench(run, opt.step, 60))
                    wall = median([_step_seconds(run, opt.step) for _ in range(5)])
                    rows.append({"kind": "optimizer", "optimizer": name, "options": options, "impl": impl,
                                 "dtype": str(dtype).replace("torch.", ""), "params": sum(p.numel() for p in params),
                                 "tensors": len(params), "seconds": seconds, "wall_seconds": wall})
                except (RuntimeError, ValueError, TypeError) as error:  # an implementation refusing is a finding
                    rows.append({"kind": "optimizer", "optimizer": name, "impl": impl,
                                 "dtype": str(dtype).replace("torch.", ""), "error": str(error).splitlines()[0][:300]})
                finally:
                    opt = None  # its state freed before the next implementation allocates its own
        del params
        if run.cuda:
            torch.cuda.empty_cache()
    return rows


def _step_seconds(run: Run, step: Callable[[], None]) -> float:
    if run.cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    step()
    if run.cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a dry run of the code)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", default="env,ceilings,profile,meter,ops,tests")
    parser.add_argument("--ops", default="", help="which op tables (default all): gemm,attention,memory,"
                                                    "attention_dropout,gemm_grid,gemm_alignment,gemm_rows,optimizers,batch_norm,conv")
    args = parser.parse_args()
    run = Run(args.out, args.quick, args.device)
    run.results["commit"] = args.commit
    run.parts = [part for part in args.ops.split(",") if part]
    bodies = {"env": env, "ceilings": ceilings, "ops": ops, "tests": tests, "profile": profiles, "meter": meter,
              "steps": steps}
    for name in args.only.split(","):
        run.section(name, bodies[name])
    run.log("all sections done")


if __name__ == "__main__":
    main()
