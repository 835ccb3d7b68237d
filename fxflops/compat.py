"""DeepSpeed Flops Profiler API on top of fxflops (`from fxflops.compat import get_model_profile`): the
public path of fxflops.integrations.deepspeed, where the code lives beside the other integrations."""

from fxflops.integrations.deepspeed import (
    Accelerator,
    FlopsProfiler,
    get_accelerator,
    get_model_profile,
    print_profile_report,
)

__all__ = ["Accelerator", "FlopsProfiler", "get_accelerator", "get_model_profile", "print_profile_report"]
