"""Whether estimate() was handed a torch.distributed.pipelining stage or schedule: asked of every model, so
kept apart from what counts one (`stage`, `schedule`, imported on use), and never importing torch.distributed."""

from __future__ import annotations

import sys
from typing import Any

_STAGES = "torch.distributed.pipelining.stage"
_SCHEDULES = "torch.distributed.pipelining.schedules"


def is_pipeline_stage(value: Any) -> bool:
    """Whether `value` is a torch.distributed.pipelining stage (never imports torch.distributed)."""
    module = sys.modules.get(_STAGES)
    stage = getattr(module, "_PipelineStageBase", None) if module is not None else None
    return stage is not None and isinstance(value, stage)


def is_pipeline_schedule(value: Any) -> bool:
    """Whether `value` is a torch.distributed.pipelining schedule (never imports torch.distributed)."""
    module = sys.modules.get(_SCHEDULES)
    schedule = getattr(module, "_PipelineSchedule", None) if module is not None else None
    return schedule is not None and isinstance(value, schedule)
