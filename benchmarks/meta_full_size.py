"""Full-size models whose forward reads values, estimated on the meta device without running them (issue 39):
diffusers' MochiTransformer3DModel at the pipeline's 480x848, 31 frames, with a classifier-free-guidance
batch (a 77-token prompt and an empty one), and torchtitan's Llama 4 17bx16e (tests/third_party) at 8192
tokens with for-loop and grouped-mm experts under balanced routing. CPU seconds of one estimate each, in
this process (the first includes building the rule table), and the FLOPs (torch conventions).

    nice -n 10 python benchmarks/meta_full_size.py     # writes results/meta_full_size.md
"""

from __future__ import annotations

import copy
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import fxflops  # noqa: E402
from benchmarks.common import ROOT, environment  # noqa: E402


def _timed(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None, **options) -> tuple[float, float, int]:
    started, wall = time.process_time(), time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fxflops.estimate(model, args, kwargs, conventions="torch", method="eager", **options)
    return time.process_time() - started, time.perf_counter() - wall, result.total_flops


def main() -> None:
    import diffusers

    from tests.third_party.torchtitan_llama4 import Transformer, llama4_args

    rows = []
    with torch.device("meta"):
        mochi = diffusers.MochiTransformer3DModel()
    mask = torch.arange(256)[None, :] < torch.tensor([77, 1])[:, None]
    kwargs = dict(hidden_states=torch.empty(2, 12, 6, 60, 106, device="meta"),
                  encoder_hidden_states=torch.empty(2, 256, 4096, device="meta"), timestep=torch.tensor([500, 500]),
                  encoder_attention_mask=mask)
    rows.append(("Mochi 10B, 480x848, 31 frames (9540 tokens), prompts of 77 and 1 tokens", *_timed(mochi, (), kwargs)))
    for grouped in (False, True):
        args = copy.deepcopy(llama4_args["17bx16e"])
        args.moe_args.use_grouped_mm = grouped
        with torch.device("meta"):
            llama = Transformer(args)
        tokens = torch.zeros(1, 8192, dtype=torch.long)
        name = f"Llama 4 17bx16e (108B), 8192 tokens, {'grouped-mm' if grouped else 'for-loop'} experts"
        rows.append((name + ", balanced routing", *_timed(llama, (tokens,), routing="balanced")))
        rows.append((name + ", default (balanced + the worst case beside it)", *_timed(llama, (tokens,))))
    lines = ["| model (meta device) | CPU s | wall s | FLOPs |", "|---|---|---|---|"]
    lines += [f"| {name} | {cpu:.2f} | {wall:.2f} | {flops:,} |" for name, cpu, wall, flops in rows]
    text = (f"# Full-size models that read values, on the meta device (issue 39)\n\n"
            f"{environment(('torch', 'diffusers'))}\n\n" + "\n".join(lines) + "\n")
    print(text)
    with open(os.path.join(ROOT, "benchmarks", "results", "meta_full_size.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
