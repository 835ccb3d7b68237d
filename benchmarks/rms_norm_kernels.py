"""Which kernels nn.RMSNorm launches on CUDA, forward and backward, and their device time (torch.profiler):
the check of op_time's fused rms_norm timing (one normalization kernel forward, one normalization_backward kernel
for the backward). Run on a GPU:

    python benchmarks/rms_norm_kernels.py OUT.json

benchmarks/results/gpu/h200_rms_norm_kernels.json came from this code (sent to the lent H200 inline, the device
machine running main's checkout) on 2026-11-27: torch 2.11.0+cu130, NVIDIA H200; kernel names cut at 90 characters.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

REPEATS = 20


def kernels(rows: int, width: int) -> dict[str, dict[str, list[float]]]:
    """{"forward": {kernel: [launches, us] per call}, "backward": ...} of nn.RMSNorm on (rows, width) bf16."""
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    norm = torch.nn.RMSNorm(width, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    out: dict[str, dict[str, list[float]]] = {}
    for phase in ("forward", "backward"):
        for _ in range(5):
            y = norm(x)
            torch.autograd.grad(y, (x, norm.weight), grad)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPEATS):
                if phase == "forward":
                    with torch.no_grad():
                        norm(x)
                else:
                    y = norm(x)
                    torch.autograd.grad(y, (x, norm.weight), grad)
            torch.cuda.synchronize()
        found: dict[str, list[float]] = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                entry = found.setdefault(event.name[:90], [0.0, 0.0])
                entry[0] += 1 / REPEATS
                entry[1] += getattr(event, "device_time", getattr(event, "cuda_time", 0.0)) / REPEATS
        out[phase] = found
    return out


def main() -> None:
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
               "shapes": {f"{rows}x{width}": kernels(rows, width) for rows, width in
                          ((1024, 4096), (8192, 4096), (32768, 4096), (8192, 8192))}}
    text = json.dumps(results, indent=1)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
