"""The training flag as counted: where a model left in training mode counts differently from eval.

Batch norm in training normalizes by batch statistics (5 FLOPs per element affine, not eval's 2) and
dropout draws and applies a mask; `model.eval()` counts inference. A forward-only count of a model in
training mode is most often a model not yet switched to eval (torchvision and transformers build
models in training mode), so it is said where it changes the numbers.
"""

from __future__ import annotations

import torch

# module classes whose count depends on their training flag
_MODE_DEPENDENT = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.dropout._DropoutNd)


def training_mode_cautions(model: torch.nn.Module, backward: bool) -> list[str]:
    """One sentence when a forward-only count ran batch norm or dropout modules in training mode."""
    if backward:  # counting a training step: training mode is what is asked for
        return []
    found = sorted({type(m).__name__ for m in model.modules()
                    if isinstance(m, _MODE_DEPENDENT) and m.training and not _inert(m)})
    if not found:
        return []
    return [f"the model is in training mode, where its {', '.join(found)} modules count differently than in "
            "eval (batch statistics, dropout masks): call model.eval() first to count inference (the CLI "
            "counts eval unless given --train)"]


def _inert(module: torch.nn.Module) -> bool:
    """Dropout with p = 0 costs the same in either mode."""
    return isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p == 0
