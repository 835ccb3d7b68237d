"""What the benchmark scripts share: reading this process' memory, and describing the environment."""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
import time
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS = resident now, VmHWM = peak resident)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def environment(libraries: Sequence[str] = ("torch", "transformers")) -> str:
    """One line: fxflops commit, library versions, Python, CPUs, torch threads, date."""
    import torch

    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "fxflops", "rules"],
                               capture_output=True, text=True, check=True).stdout.strip()
        commit = f"fxflops at {commit}{' + local changes' if dirty else ''}"
    except (OSError, subprocess.CalledProcessError):
        commit = f"fxflops from {ROOT} (not a git checkout)"
    versions = ", ".join(f"{name} {importlib.import_module(name).__version__}" for name in libraries)
    return (f"{commit}; {versions}, Python {platform.python_version()}, {os.cpu_count()} CPUs "
            f"({platform.machine()}), torch threads {torch.get_num_threads()}; {time.strftime('%Y-%m-%d')}.")
