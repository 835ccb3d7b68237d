"""One training step's FLOPs against a measured step time: what MFU a run got (`fxflops MODEL --step-time`)."""

from __future__ import annotations

from fxflops.timing.steps import StepStats


def render_step(model_type: str, shape: str, stats: StepStats, peak_source: str | None) -> str:
    """A few lines: the step's FLOPs, tokens/s, achieved TFLOP/s, MFU, and 6N beside the count."""
    lines = [f"{model_type}, {shape}: one training step (forward + backward) in {stats.time:g} s",
             f"  step FLOPs      {_si(stats.flops)}FLOPs (forward {_si(stats.fwd_flops)}FLOPs + backward "
             f"{_si(stats.bwd_flops)}FLOPs)"]
    if stats.optimizer_flops:
        lines.append(f"  optimizer step  {_si(stats.optimizer_flops)}FLOPs (apart, not in the step's FLOPs)")
    if stats.tokens_per_sec is not None:
        lines.append(f"  tokens/s        {_si(stats.tokens_per_sec).strip()}")
    lines.append(f"  samples/s       {_si(stats.samples_per_sec).strip()}")
    lines.append(f"  achieved        {stats.tflops:.2f} TFLOP/s")
    if stats.mfu is not None:
        lines.append(f"  MFU             {stats.mfu:.2%} of {_si(stats.peak_flops)}FLOP/s ({peak_source})")
    else:
        lines.append("  MFU             no peak known: give --device (a GPU of the peaks table)")
    if stats.six_n_flops is not None:
        lines.append(f"  6N              {_si(stats.six_n_flops)}FLOPs: {stats.six_n_flops / stats.flops:.3f}x the count "
                     f"(MFU {_mfu(stats, stats.six_n_flops)})")
    if stats.six_n_flops is not None and stats.attention_flops is not None:
        both = stats.six_n_flops + stats.attention_flops
        lines.append(f"  6N + 12·L·H·Q·T {_si(both)}FLOPs: {both / stats.flops:.3f}x the count (MFU {_mfu(stats, both)})")
    return "\n".join(lines) + "\n"


def _mfu(stats: StepStats, flops: int) -> str:
    if stats.peak_flops is None or not stats.time:
        return "n/a"
    return f"{flops / stats.time / stats.peak_flops:.2%}"


def _si(value: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.2f} "
