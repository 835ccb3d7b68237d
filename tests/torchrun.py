"""Run one of the tests' scripts as a torchrun job of 2 CPU processes on 127.0.0.1 (gloo), with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script: str, *arguments: str, timeout: float = 240, cwd: str | os.PathLike | None = None
             ) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 SCRIPT arguments...` on 127.0.0.1, its completed process. SCRIPT is a file of
    tests/ by name, or a path (relative to `cwd`); this checkout comes first on the workers' path.

    The rendezvous store binds port 0 itself (c10d rendezvous at 127.0.0.1:0): a port probed free here and passed
    as --master_port could be taken by another job before torchrun bound it, which aborted a rank at startup."""
    path = script if cwd is not None or os.path.isabs(script) else os.path.join(ROOT, "tests", script)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", uuid.uuid4().hex,
               path, *arguments]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
