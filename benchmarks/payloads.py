"""Time and memory of estimate() beside a large Python payload (issue 22, items 4 and 5).

A Linear(8, 8) model is estimated on a (2, 8) input while a list of `--items` zeros (8 bytes of pointer
each: 2^27 items = 1 GiB) is held either as a model attribute (`attr`) or inside an input object
(`input`). Each case runs in a fresh subprocess after one warm-up estimate of a plain Linear; the
report gives the wall time of the one call and how far the process' peak RSS (VmHWM) rose over the
resident size before it. Neither should grow with the payload: it is never copied.

    python benchmarks/payloads.py                  # 2^27 items (1 GiB), both cases
    python benchmarks/payloads.py --items 16777216

The markdown table goes to stdout and to benchmarks/results/payloads.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import ROOT, environment, status_kib  # noqa: E402


def one_case(where: str, items: int) -> dict:
    import torch
    from torch import nn

    import fxflops

    fxflops.estimate(nn.Linear(8, 8), (torch.randn(2, 8),))
    payload = [0] * items

    class Box:
        pass

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            if where == "attr":
                self.payload = payload

        def forward(self, x):
            return self.proj(x.x if isinstance(x, Box) else x)

    x = torch.randn(2, 8)
    if where == "input":
        box = Box()
        box.x, box.payload = x, payload
        x = box
    before = status_kib("VmRSS")
    start = time.perf_counter()
    macs = fxflops.estimate(Model(), (x,)).total_macs
    return {"seconds": time.perf_counter() - start, "peak_mib": (status_kib("VmHWM") - before) / 1024, "macs": macs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1 << 27)
    parser.add_argument("--case", choices=["attr", "input"], help=argparse.SUPPRESS)  # one subprocess's case
    options = parser.parse_args()
    if options.case:
        print(json.dumps(one_case(options.case, options.items)))
        return
    rows = ["| payload | items | estimate() time | peak RSS rise |", "|---|---:|---:|---:|"]
    for where in ("attr", "input"):
        out = subprocess.run([sys.executable, __file__, "--case", where, "--items", str(options.items)],
                             capture_output=True, text=True, check=True, cwd=ROOT).stdout
        result = json.loads(out.strip().splitlines()[-1])
        assert result["macs"] == 2 * 8 * 8
        label = "model attribute" if where == "attr" else "inside an input object"
        rows.append(f"| list {label} | {options.items:,} | {result['seconds']:.1f} s | {result['peak_mib']:.0f} MiB |")
    table = "\n".join([environment(), "", *rows])
    print(table)
    with open(os.path.join(ROOT, "benchmarks", "results", "payloads.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
