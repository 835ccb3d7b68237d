"""Training FLOPs: fxflops.estimate(backward=True) against FlopCounterMode over a real backward, on CPU.

For each zoo model (torchvision at 2x3x224x224 in training mode; Hugging Face models from config
classes at batch 2, seq 128), each run in its own subprocess:

  fxflops      fxflops.estimate(model, args, kwargs, backward=True) on a model built on the meta
               device (no weights), default (deepspeed) conventions; then, untimed, conventions="torch"
  flopcounter  FlopCounterMode(display=False) over one real forward and `.backward()` of the sum of
               the output's floating tensors, with real random weights, under sdpa_kernel(MATH) and
               with the MHA fast path off (what the tests' oracle runs)

Only the counting call is timed (wall); building the model is not. The table gives the bwd/fwd ratio
under both conventions, whether the torch preset equals FlopCounterMode, and the time ratio.
`--llama 70b` instead estimates a Llama-2-70B-shaped training step (seq 2048) on the meta device and
reports its time and peak RSS.

    python benchmarks/training_flops.py                     # zoo, writes results/training_flops.md
    python benchmarks/training_flops.py --models resnet18 --output ''
    python benchmarks/training_flops.py --llama 70b         # appends the Llama row to the results
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import environment

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "training_flops.md")
VISION = ("resnet18", "resnet50", "mobilenet_v2", "efficientnet_b0", "vit_b_16", "convnext_tiny", "swin_t")
TEXT = ("bert", "gpt2", "llama")

CHILD = r'''
import json, sys, time, resource, warnings
warnings.simplefilter("ignore")
import torch
name, tool = sys.argv[1], sys.argv[2]

def build(device):
    import torchvision
    if name in torchvision.models.list_models(module=torchvision.models):
        with torch.device(device):
            model = getattr(torchvision.models, name)().train()
        shape = (2, 3, 224, 224)
        x = torch.zeros(shape) if device == "meta" else torch.randn(shape)
        return model, (x,), {}
    import transformers as tf
    configs = {
        "bert": (tf.BertForMaskedLM, tf.BertConfig()),
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config()),
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                                       num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)),
        "llama2-7b": (tf.LlamaForCausalLM, tf.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                                           num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)),
        "llama2-70b": (tf.LlamaForCausalLM, tf.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                                            num_attention_heads=64, num_key_value_heads=8, vocab_size=32000)),
    }
    cls, config = configs[name]
    seq = 2048 if name.startswith("llama2") else 128
    batch = 1 if name.startswith("llama2") else 2
    with torch.device(device):
        model = cls(config).train()
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, (), {"input_ids": ids}

if tool == "fxflops":
    import fxflops
    model, args, kwargs = build("meta")
    start = time.perf_counter()
    e = fxflops.estimate(model, args, kwargs, backward=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"seconds": seconds, "peak_kib": peak, "fwd": e.fwd_flops, "bwd": e.bwd_flops, "fwd_macs": e.fwd_macs,
           "bwd_macs": e.bwd_macs, "unknown": sum(u.count for u in e.unknown),
           "rules": {k: [v.macs - v.bwd_macs, v.bwd_macs, v.flops - v.bwd_flops, v.bwd_flops] for k, v in e.by_rule.items()}}
    if not name.startswith("llama2"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            t = fxflops.estimate(model, args, kwargs, backward=True, conventions="torch")
        out.update(torch_fwd=t.fwd_flops, torch_bwd=t.bwd_flops)
else:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from torch.utils import _pytree as pytree
    torch.manual_seed(0)
    model, args, kwargs = build("cpu")
    torch.backends.mha.set_fastpath_enabled(False)
    start = time.perf_counter()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        output = model(*args, **kwargs)
        fwd = counter.get_total_flops()
        leaves = pytree.tree_leaves(dict(output) if isinstance(output, dict) else output)
        sum(t.sum() for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad).backward()
    seconds = time.perf_counter() - start
    out = {"seconds": seconds, "fwd": fwd, "bwd": counter.get_total_flops() - fwd}
print("RESULT " + json.dumps(out))
'''


def run(name: str, tool: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", CHILD, name, tool], capture_output=True, text=True, env=env,
                          check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{name} / {tool} failed:\n{done.stderr[-3000:]}")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "n/a"


def zoo_table(models: list[str]) -> list[str]:
    lines = [
        "| model | fwd FLOPs | bwd FLOPs | bwd/fwd (deepspeed) | bwd/fwd MACs | bwd/fwd (torch preset) "
        "| FlopCounterMode bwd/fwd | torch preset = FlopCounterMode | fxflops s | FlopCounterMode s | time ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    details = []
    for name in models:
        ours, ref = run(name, "fxflops"), run(name, "flopcounter")
        equal = (ours["torch_fwd"], ours["torch_bwd"]) == (ref["fwd"], ref["bwd"])
        lines.append(
            f"| {name} | {ours['fwd']:.4g} | {ours['bwd']:.4g} | {ratio(ours['bwd'], ours['fwd'])} "
            f"| {ratio(ours['bwd_macs'], ours['fwd_macs'])} | {ratio(ours['torch_bwd'], ours['torch_fwd'])} "
            f"| {ratio(ref['bwd'], ref['fwd'])} | {'yes' if equal else 'NO'} | {ours['seconds']:.2f} "
            f"| {ref['seconds']:.2f} | {ours['seconds'] / ref['seconds']:.2f} |"
        )
        top = sorted(ours["rules"].items(), key=lambda item: -(item[1][2] + item[1][3]))[:6]
        details.append(f"- {name}: " + "; ".join(
            f"{rule} fwd {f:.3g} bwd {b:.3g}" for rule, (_, _, f, b) in top))
        print(lines[-1], flush=True)
    return lines + ["", "Largest rules per model (deepspeed FLOPs, forward and backward):", ""] + details


def llama_row(size: str) -> list[str]:
    ours = run(f"llama2-{size}", "fxflops")
    return [
        f"Llama-2-{size.upper()}-shaped training step (meta device, batch 1, seq 2048, deepspeed conventions):",
        "",
        f"- fwd {ours['fwd']:.4g} FLOPs, bwd {ours['bwd']:.4g} FLOPs, bwd/fwd {ratio(ours['bwd'], ours['fwd'])}, "
        f"unknown ops {ours['unknown']}",
        f"- estimate(backward=True) took {ours['seconds']:.1f} s wall; peak RSS of the process "
        f"{ours['peak_kib'] / 1024:.0f} MiB",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(VISION + TEXT))
    parser.add_argument("--llama", choices=("7b", "70b"))
    parser.add_argument("--output", default=RESULTS)
    options = parser.parse_args()
    if options.llama:
        lines = [""] + llama_row(options.llama)
        mode = "a"
    else:
        lines = ["# Training FLOPs: estimate(backward=True) vs FlopCounterMode over a real backward", "",
                 environment(), ""] + zoo_table(options.models.split(","))
        mode = "w"
    text = "\n".join(lines) + "\n"
    print(text)
    if options.output:
        with open(options.output, mode, encoding="utf-8") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
