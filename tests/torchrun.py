"""Run one of the tests' scripts as a torchrun job of 2 CPU processes on 127.0.0.1 (gloo), with a timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script: str, *arguments: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 tests/<script> arguments...` on a free port; its completed process."""
    with socket.socket() as probe:  # a free port on 127.0.0.1
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port), os.path.join(ROOT, "tests", script), *arguments]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
