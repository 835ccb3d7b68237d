"""A sweep grid's cost: time and peak memory of `Sweep.result(grid)` and its CSV and JSON, per point count.

    python benchmarks/sweep_grid.py [--points 2000] [--output benchmarks/results/sweep_grid.md]

One process per measurement (peak resident memory, VmHWM, is per process): a small Llama
(2 layers, hidden 64) swept over batch and seq; the grid is batch 1..N/50 x 50 seq values. Each
run times the capture, then the grid (process CPU seconds: the machine may be shared), and reads
the peak resident memory before and after the grid. The grid two ways: `result()` then `to_csv` and `to_json` (the whole grid held), and
`write_csv` + `write_json` into files (streamed, as the CLI writes it). Nothing here is asserted
by the test suite.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, status_kib  # noqa: E402


def small_llama() -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=176,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                      max_position_embeddings=4096)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config).eval()


def one_run(points: int, streamed: bool) -> dict:
    """In this process: capture, then the whole grid with both writers; seconds and KiB."""
    import tempfile

    from fxflops.report import sweep as report
    from fxflops.sweeps import sweep

    warnings.simplefilter("ignore")
    model = small_llama()
    seqs = 50
    grid = {"batch": range(1, max(points // seqs, 1) + 1), "seq": range(16, 16 + 8 * seqs, 8)}
    start = time.process_time()
    swept = sweep(model, (torch.zeros(2, 16, dtype=torch.long),), dims={"batch": 0, "seq": 1})
    captured = time.process_time() - start
    before = status_kib("VmHWM")
    start = time.process_time()
    if streamed:
        with tempfile.TemporaryDirectory() as folder:
            with open(f"{folder}/grid.csv", "w") as stream:
                report.write_csv(swept, grid, stream)
            with open(f"{folder}/grid.json", "w") as stream:
                report.write_json(swept, grid, stream)
            sizes = [Path(folder, name).stat().st_size for name in ("grid.csv", "grid.json")]
            count = len(json.loads(Path(folder, "grid.json").read_text())["points"])
    else:
        result = swept.result(grid)
        texts = report.to_csv(result), report.to_json(result)
        sizes, count = [len(text) for text in texts], len(result.points)
    elapsed = time.process_time() - start
    return {"points": count, "how": "streamed" if streamed else "result()", "capture_s": captured,
            "grid_s": elapsed, "peak_before_kib": before, "peak_after_kib": status_kib("VmHWM"),
            "csv_bytes": sizes[0], "json_bytes": sizes[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, nargs="*", default=[2000])
    parser.add_argument("--output", type=Path)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process' point count
    parser.add_argument("--streamed", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.one is not None:
        print(json.dumps(one_run(options.one, options.streamed)))
        return
    rows = []
    for points in options.points:
        for streamed in (False, True):
            child = subprocess.run([sys.executable, __file__, "--one", str(points)] + (["--streamed"] * streamed),
                                   capture_output=True, text=True, check=True)
            rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
    lines = ["# Sweep grid: time and peak memory of result(), CSV and JSON over a grid", "",
             environment(("torch", "transformers")), "",
             "| points | grid written | capture | grid (points + CSV + JSON) | per point | peak RSS before grid | "
             "peak RSS after | CSV | JSON |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['points']} | {r['how']} | {r['capture_s']:.2f} s | {r['grid_s']:.2f} s | "
                     f"{1000 * r['grid_s'] / r['points']:.2f} ms | {r['peak_before_kib'] / 1024:.0f} MiB | "
                     f"{r['peak_after_kib'] / 1024:.0f} MiB | {r['csv_bytes']:,} B | {r['json_bytes']:,} B |")
    text = "\n".join(lines) + "\n"
    print(text)
    if options.output:
        options.output.write_text(text)


if __name__ == "__main__":
    main()
