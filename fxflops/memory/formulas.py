"""Hand formulas the counted memory is checked against, and what they stand for until fxflops counts it.

These are formulas, not counts: they take sizes and return bytes. The ZeRO divisions stand in for
each rank's shards until fxflops.parallel captures a rank's own step (where the count replaces them).

- Model states (ZeRO paper, Rajbhandari et al. 2020, §3.1): mixed-precision Adam holds a 2-byte
  parameter and a 2-byte gradient, and fp32 master weights, momentum and variance (4 + 4 + 4 bytes):
  16 bytes per parameter, K = 12 of them the optimizer's. ZeRO-1 shards the optimizer's K bytes over
  the dp ranks, ZeRO-2 the gradients too, ZeRO-3 the parameters too.
- Activations of a GPT layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", §4): s·b·h·(34 + 5·a·s/h) bytes saved for the backward with 16-bit activations
  and 1-byte dropout masks; with tensor parallelism t and sequence parallelism both divided by t;
  with selective recomputation (the attention core recomputed) s·b·h·34/t; full recomputation keeps
  only the layer's input, 2·s·b·h.
"""

from __future__ import annotations

ADAM_MIXED_PRECISION = {"parameters": 2, "gradients": 2, "optimizer": 12}  # bytes per parameter (ZeRO §3.1)


def model_state_bytes(params: int, *, param_bytes: int = 2, grad_bytes: int = 2, optimizer_bytes: int = 12,
                      dp: int = 1, zero_stage: int = 0) -> dict[str, int]:
    """FORMULA (ZeRO paper): parameter, gradient and optimizer bytes per rank for `params` parameters,
    data parallel over `dp` ranks at ZeRO stage 0-3 (shards rounded up: a rank holds the largest)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage is 0, 1, 2 or 3; got {zero_stage!r}")
    if dp < 1:
        raise ValueError(f"dp is a number of ranks, at least 1; got {dp!r}")

    def shard(total: int, sharded: bool) -> int:
        return -(-total // dp) if sharded else total

    return {"parameters": shard(params * param_bytes, zero_stage >= 3),
            "gradients": shard(params * grad_bytes, zero_stage >= 2),
            "optimizer": shard(params * optimizer_bytes, zero_stage >= 1)}


def gpt_layer_activation_bytes(s: int, b: int, h: int, a: int, *, t: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none") -> float:
    """FORMULA (Korthikanti et al. 2022, Table 2): bytes one GPT layer saves for its backward, sequence
    s, micro-batch b, hidden h, a heads, tensor parallel t; recompute "none", "selective" or "full"."""
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute is 'none', 'selective' or 'full'; got {recompute!r}")
    attention_core = 0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return s * b * h / t * (34 + attention_core)
    return s * b * h * (10 + 24 / t + attention_core / t)
