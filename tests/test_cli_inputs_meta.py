"""Issue 35 item 12: FILE.py:FACTORY with --input-shape allocates nothing (the help's promise); only a model
that must run (method trace) gets real all-zero inputs, made when it runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fxflops.cli.model_spec import load
from fxflops.cli.options import InputOptions

ROOT = Path(__file__).resolve().parent.parent

LINEAR = "import torch\n\ndef build():\n    return torch.nn.Linear(8, 4)\n"


def test_inputs_from_shapes_are_meta_tensors(tmp_path):
    factory = tmp_path / "linear_model.py"
    factory.write_text(LINEAR)
    loaded = load(f"{factory}:build", InputOptions(input_shapes=((100_000_000, 8),)))
    assert [t.device.type for t in loaded.args] == ["meta"]
    named = load(f"{factory}:build", InputOptions(named_shapes=(("input", (100_000_000, 8)),)))
    assert named.kwargs["input"].device.type == "meta"
    assert loaded.made_up is None  # nothing made up yet: nothing ran
    assert loaded.real_inputs is not None  # what a run would take (method trace), made only then


def _peak_rss_kib(factory: Path, shape: str) -> tuple[int, dict]:
    script = (
        "import json, resource, sys\n"
        "from fxflops.cli.main import main\n"
        f"code = main([{str(factory)!r} + ':build', '--input-shape', {shape!r}, '--format', 'json', '--output', sys.argv[1]])\n"
        "print(json.dumps([code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]))\n")
    out = factory.parent / f"out_{shape.replace(',', '_')}.json"
    done = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    code, rss = json.loads(done.stdout.strip().splitlines()[-1])
    assert code == 0, done.stderr
    return rss, json.loads(out.read_text())


def test_a_huge_input_shape_costs_no_memory(tmp_path):
    factory = tmp_path / "linear_model.py"
    factory.write_text(LINEAR)
    # the 100,000,000 x 8: 3.2 GB of float32 zeros on top of the process; the command's peak RSS
    # with --input-shape 2,8 and with this shape alike was 1.1 GB here (importing torch alone: 0.9 GB)
    rss, data = _peak_rss_kib(factory, "100000000,8")
    assert data["totals"]["macs"] == 100_000_000 * 8 * 4 and data["method"] == "eager"
    assert rss < 2_500_000, f"peak RSS {rss} KiB"
