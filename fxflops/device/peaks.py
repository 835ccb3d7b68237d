"""Peak dense FLOP/s per dtype and memory bandwidth of common GPUs and TPUs: a profile's utilization, a roofline.

Numbers are the vendors' datasheet figures for dense math (the "with sparsity" figures halved
where a sheet only gives those), in FLOP/s. fp32 means plain CUDA-core fp32; matmuls in fp32
run at the tf32 rate when PyTorch allows tf32, and `peak_for` picks that entry then. A device
that is not in the table gets no utilization unless the user passes `peak_flops=`; a CPU never
gets a table value (peaks there depend on cores, clocks and vector width). AMD Instinct parts give
their matrix-core rates (what GEMMs run at; CDNA's fp32 and fp64 GEMMs use matrix cores too) and,
apart, the vector rates elementwise fp32/fp64 ops run at (`vector`); TPUs
give their MXU's bf16 rate only, the one rate Google publishes per chip (fp32 matmuls run as
several bf16 passes), so an fp32 model needs --dtype bfloat16 or a given peak there.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

import torch

T = 1e12

_A100 = {"fp64": 19.5 * T, "fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T}
_HOPPER_SXM = {  # H100 SXM and H200 SXM share the same compute
    "fp64": 67 * T, "fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T,
    "fp8": 1978.9 * T,
}
_HOPPER_NVL = {
    "fp64": 60 * T, "fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T,
    "fp8": 1670.5 * T,
}
# AMD CDNA 3 (MI300X and MI325X share the compute die; they differ in memory). AMD Instinct MI300X and
# MI325X datasheets: FP64 matrix 163.4, FP32 matrix 163.4, TF32 653.7, FP16/BF16 1307.4, FP8 2614.9 TFLOPS
# dense (the sheets' "with sparsity" figures are twice these).
_CDNA3 = {"fp64": 163.4 * T, "fp32": 163.4 * T, "tf32": 653.7 * T, "bf16": 1307.4 * T, "fp16": 1307.4 * T,
          "fp8": 2614.9 * T}
_CDNA3_VECTOR = {"fp64": 81.7 * T, "fp32": 163.4 * T}  # the same sheets: FP64 vector 81.7, FP32 vector 163.4

G = 1e9


@dataclass(frozen=True)
class GpuPeaks:
    label: str  # the device's name in reports and for `predict(device=...)`
    pattern: str  # regex matched against torch.cuda.get_device_name()
    flops: dict[str, float]  # dtype key -> dense FLOP/s
    bandwidth: float  # memory bandwidth, bytes/s (datasheet; 1 GB/s = 1e9 bytes/s)
    source: str  # where the numbers come from
    # vector (non-matrix) FLOP/s per dtype key where it differs from `flops` (CDNA runs fp32/fp64
    # GEMMs on matrix cores at twice the vector rate elementwise ops get); absent: `flops` is both
    vector: dict[str, float] = field(default_factory=dict)


# Most specific patterns first: "H100 NVL" must not be taken for the SXM part.
GPU_PEAKS: tuple[GpuPeaks, ...] = (
    GpuPeaks("V100S PCIe", r"V100S", {"fp64": 8.2 * T, "fp32": 16.4 * T, "fp16": 130 * T}, 1134 * G,
             "NVIDIA V100 datasheet"),
    GpuPeaks("V100 PCIe", r"V100.*PCI", {"fp64": 7 * T, "fp32": 14 * T, "fp16": 112 * T}, 900 * G,
             "NVIDIA V100 datasheet"),
    GpuPeaks("V100 SXM2", r"V100", {"fp64": 7.8 * T, "fp32": 15.7 * T, "fp16": 125 * T}, 900 * G,
             "NVIDIA V100 datasheet"),
    # A100s differ in memory only: HBM2e at 2,039 GB/s (80GB SXM), 1,935 GB/s (80GB PCIe), 1,555 GB/s (40GB)
    GpuPeaks("A100 80GB PCIe", r"A100.*(80GB.*PCI|PCI.*80GB)", _A100, 1935 * G, "NVIDIA A100 datasheet"),
    GpuPeaks("A100 80GB SXM", r"A100.*80GB", _A100, 2039 * G, "NVIDIA A100 datasheet"),
    GpuPeaks("A100 40GB", r"A100", _A100, 1555 * G, "NVIDIA A100 datasheet"),
    GpuPeaks("A10", r"\bA10\b", {"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T, "fp16": 125 * T},
             600 * G, "NVIDIA A10 datasheet"),
    GpuPeaks("H100 NVL", r"H100.*NVL", _HOPPER_NVL, 3900 * G, "NVIDIA H100 datasheet"),
    GpuPeaks("H100 PCIe", r"H100.*PCI", {
        "fp64": 51 * T, "fp32": 51 * T, "tf32": 378 * T, "bf16": 756 * T, "fp16": 756 * T,
        "fp8": 1513 * T}, 2000 * G, "NVIDIA H100 datasheet"),
    GpuPeaks("H100 SXM", r"H100", _HOPPER_SXM, 3350 * G, "NVIDIA H100 datasheet"),
    GpuPeaks("H200 NVL", r"H200.*NVL", _HOPPER_NVL, 4800 * G, "NVIDIA H200 datasheet"),
    GpuPeaks("H200 SXM", r"H200", _HOPPER_SXM, 4800 * G, "NVIDIA H200 datasheet"),
    GpuPeaks("L40S", r"L40S", {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362.05 * T, "fp16": 362.05 * T,
                               "fp8": 733 * T}, 864 * G, "NVIDIA L40S datasheet"),
    GpuPeaks("L4", r"\bL4\b", {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T,
                               "fp8": 242.5 * T}, 300 * G, "NVIDIA L4 datasheet"),
    GpuPeaks("T4", r"\bT4\b", {"fp32": 8.1 * T, "fp16": 65 * T}, 320 * G, "NVIDIA T4 datasheet"),
    # GeForce tensor rates with fp32 accumulate, which is what PyTorch uses.
    GpuPeaks("RTX 4090", r"RTX 4090", {"fp32": 82.6 * T, "tf32": 82.6 * T, "bf16": 165.2 * T,
                                       "fp16": 165.2 * T, "fp8": 330.3 * T}, 1008 * G,
             "NVIDIA Ada Lovelace architecture whitepaper"),
    GpuPeaks("RTX 3090", r"RTX 3090", {"fp32": 35.6 * T, "tf32": 35.6 * T, "bf16": 71 * T, "fp16": 71 * T},
             936 * G, "NVIDIA Ampere GA102 whitepaper"),
    # NVIDIA GB200 NVL72 datasheet, per rack of 72 Blackwell GPUs (with sparsity): FP16/BF16 360 PF, FP8 720 PF,
    # TF32 180 PF, FP64 3,240 TF; halved for dense and divided by 72 per GPU. HBM3e 576 TB/s per rack: 8 TB/s a GPU.
    # The sheet gives no plain fp32 rate: the fp64 one stands in (it only bounds elementwise ops, memory-bound anyway).
    GpuPeaks("GB200", r"GB200", {"fp64": 45 * T, "fp32": 45 * T, "tf32": 1250 * T, "bf16": 2500 * T, "fp16": 2500 * T,
                                 "fp8": 5000 * T}, 8000 * G, "NVIDIA GB200 NVL72 datasheet (per GPU, dense)"),
    # AMD Instinct MI250X datasheet: FP64/FP32 matrix 95.7, vector 47.9, FP16/BF16 383 TFLOPS (CDNA 2 has
    # no tf32 or fp8); 128 GB HBM2e on an 8192-bit bus at 3.2 Gbps: 3276.8 GB/s.
    GpuPeaks("MI250X", r"MI250X", {"fp64": 95.7 * T, "fp32": 95.7 * T, "bf16": 383 * T, "fp16": 383 * T},
             3276.8 * G, "AMD Instinct MI250X datasheet", vector={"fp64": 47.9 * T, "fp32": 47.9 * T}),
    GpuPeaks("MI300X", r"MI300X", _CDNA3, 5300 * G, "AMD Instinct MI300X datasheet (192 GB HBM3, 5.3 TB/s)",
             vector=_CDNA3_VECTOR),
    GpuPeaks("MI325X", r"MI325X", _CDNA3, 6000 * G, "AMD Instinct MI325X datasheet (256 GB HBM3E, 6 TB/s)",
             vector=_CDNA3_VECTOR),
    # AMD Instinct MI355X datasheet: FP64 78.6, FP32 157.3, FP16/BF16 2.5 PF (2516.6 TF), FP8 5 PF (5033.2 TF)
    # dense; CDNA 4 drops tf32. 288 GB HBM3E, 8 TB/s.
    GpuPeaks("MI355X", r"MI355X", {"fp64": 78.6 * T, "fp32": 157.3 * T, "bf16": 2516.6 * T, "fp16": 2516.6 * T,
                                   "fp8": 5033.2 * T}, 8000 * G, "AMD Instinct MI355X datasheet"),
    # Google Cloud TPU documentation, per chip: peak bf16 compute and HBM bandwidth.
    GpuPeaks("TPU v4", r"TPU\s*v4", {"bf16": 275 * T}, 1200 * G, "Google Cloud TPU v4 documentation"),
    GpuPeaks("TPU v5e", r"TPU\s*v5\s*(e|lite)", {"bf16": 197 * T}, 819 * G, "Google Cloud TPU v5e documentation"),
    GpuPeaks("TPU v5p", r"TPU\s*v5p", {"bf16": 459 * T}, 2765 * G, "Google Cloud TPU v5p documentation"),
    GpuPeaks("TPU v6e Trillium", r"TPU\s*v6|Trillium", {"bf16": 918 * T}, 1640 * G,
             "Google Cloud TPU v6e (Trillium) documentation"),
)

_DTYPE_KEYS = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}


def dtype_key(dtype: torch.dtype, *, tf32: bool = False) -> str | None:
    """Table key for a dtype; fp32 becomes tf32 when tf32 matmuls are allowed."""
    key = _DTYPE_KEYS.get(dtype)
    return "tf32" if key == "fp32" and tf32 else key


def tf32_enabled() -> bool:
    """Whether PyTorch lets fp32 matmuls run on tf32 tensor cores."""
    return torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cuda.matmul.allow_tf32)


def lookup(device_name: str) -> GpuPeaks | None:
    """The table row named `device_name` ("H100 SXM", any case), else the first whose pattern matches
    it (a CUDA device name such as "NVIDIA H100 80GB HBM3"), or None."""
    for row in GPU_PEAKS:
        if row.label.lower() == device_name.strip().lower():
            return row
    for row in GPU_PEAKS:
        if re.search(row.pattern, device_name, re.IGNORECASE):
            return row
    return None


def named(name: str) -> GpuPeaks:
    """The row a user names: its label in any case and spacing ("h100-sxm"), words of it only one label
    has ("4090"), or a CUDA device name ("NVIDIA H100 80GB HBM3"). Words several labels share ("A100",
    "H100") are refused, listing them: the parts differ in bandwidth and peaks. Words match whole, so
    "L40" is not taken for the L40S."""
    for row in GPU_PEAKS:
        if _squashed(row.label) == _squashed(name):
            return row
    words = set(_words(name))
    partial = [row for row in GPU_PEAKS if words and words <= set(_words(row.label))]
    if len(partial) > 1:
        raise ValueError(f"device {name!r} could be any of {', '.join(row.label for row in partial)}, "
                         "whose peaks or bandwidth differ: name one")
    row = partial[0] if partial else lookup(name)
    if row is None:
        close = difflib.get_close_matches(name, [row.label for row in GPU_PEAKS], n=1, cutoff=0.3)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"device {name!r} is not in the peaks table; {hint}known: "
                         f"{', '.join(row.label for row in GPU_PEAKS)}")
    return row


def _squashed(name: str) -> str:
    return re.sub(r"[\s_-]+", "", name.lower())


def _words(name: str) -> list[str]:
    return [word for word in re.split(r"[\s_-]+", name.lower()) if word]


def peak_for(device_name: str, dtype: torch.dtype, *, tf32: bool = False) -> tuple[float, str] | None:
    """(peak dense FLOP/s, source line) for a GPU name and compute dtype, or None when unknown."""
    row = lookup(device_name)
    key = dtype_key(dtype, tf32=tf32)
    if row is None or key is None:
        return None
    if key == "tf32" and key not in row.flops:  # pre-Ampere parts have no tf32: plain fp32
        key = "fp32"
    if key not in row.flops:
        return None
    return row.flops[key], f"table: {row.label} {key} dense ({row.source})"
