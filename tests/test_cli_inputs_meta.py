"""Issue 35 item 12: FILE.py:FACTORY with --input-shape allocates nothing (the help's promise); only a model
that must run (method trace) gets real all-zero inputs, made when it runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxflops.cli.main import main
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


def _run_measured(factory: Path, shape: str) -> tuple[int, int, str, Path]:
    """The command in a fresh process: its exit status, peak RSS (KiB), stderr and the --output path."""
    script = (
        "import json, resource, sys\n"
        "from fxflops.cli.main import main\n"
        f"code = main([{str(factory)!r} + ':build', '--input-shape', {shape!r}, '--format', 'json', '--output', sys.argv[1]])\n"
        "print(json.dumps([code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]))\n")
    out = factory.parent / f"out_{shape.replace(',', '_')}.json"
    done = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    code, rss = json.loads(done.stdout.strip().splitlines()[-1])
    return code, rss, done.stderr, out


def _peak_rss_kib(factory: Path, shape: str) -> tuple[int, dict]:
    code, rss, err, out = _run_measured(factory, shape)
    assert code == 0, err
    return rss, json.loads(out.read_text())


def test_a_huge_input_shape_costs_no_memory(tmp_path):
    factory = tmp_path / "linear_model.py"
    factory.write_text(LINEAR)
    # the 100,000,000 x 8: 3.2 GB of float32 zeros on top of the process; the command's peak RSS
    # with --input-shape 2,8 and with this shape alike was 1.1 GB here (importing torch alone: 0.9 GB)
    rss, data = _peak_rss_kib(factory, "100000000,8")
    assert data["totals"]["macs"] == 100_000_000 * 8 * 4 and data["method"] == "eager"
    assert rss < 2_500_000, f"peak RSS {rss} KiB"


EMBEDDING_FIRST = """import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.emb(x))

def build():
    return Net()
"""


def _meta_embedding_checks_indices() -> bool:
    """Whether aten.embedding's meta kernel refuses float indices (torch 2.11's shapes them without a word)."""
    try:
        torch.ops.aten.embedding.default(torch.empty(10, 4, device="meta"), torch.empty(3, device="meta"))
    except RuntimeError:
        return True
    return False


def test_a_static_failure_of_dtype_allocates_nothing_and_says_what_to_try(tmp_path):
    """Float inputs into an Embedding fail every static method with a dtype error; zeros would fail alike, so
    the command reports it without running on made-up inputs (before: 4.2 GB of zeros, then the same error)."""
    if not _meta_embedding_checks_indices():
        pytest.skip(f"torch {torch.__version__}: aten.embedding's meta kernel takes float indices, so nothing fails")
    factory = tmp_path / "embedding_model.py"
    factory.write_text(EMBEDDING_FIRST)
    code, rss, err, _ = _run_measured(factory, "100000000,8")
    assert code == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "in module 'emb'" in lines[0] and "op aten.embedding.default" in lines[0] and "indices" in lines[0]
    assert "not run on all-zero inputs" in lines[0] and "--input-dtype" in lines[0]
    assert rss < 2_500_000, f"peak RSS {rss} KiB"


def test_input_dtype_makes_integer_inputs_from_shapes(tmp_path, capsys):
    factory = tmp_path / "embedding_model.py"
    factory.write_text(EMBEDDING_FIRST)
    loaded = load(f"{factory}:build", InputOptions(input_shapes=((100_000_000, 8),), input_dtype=torch.long))
    assert loaded.args[0].dtype == torch.long and loaded.args[0].device.type == "meta"
    out = tmp_path / "embedding.json"
    code = main([f"{factory}:build", "--input-shape", "100000000,8", "--input-dtype", "long", "--format", "json",
                 "--output", str(out)])
    data = json.loads(out.read_text())
    # the lookup is free; fc: 4 x 3 MACs per token
    assert code == 0 and data["method"] == "eager" and data["totals"]["macs"] == 100_000_000 * 8 * 4 * 3
    assert main(["lenet5", "--input-dtype", "long"]) == 2  # no inputs made from shapes: refused, not ignored
    assert "give --input-shape" in capsys.readouterr().err
    assert main([f"{factory}:build", "--input-shape", "2,8", "--input-dtype", "lnog"]) == 2
    assert "did you mean 'long'" in capsys.readouterr().err


VALUE_SIZED = """import torch

class Picks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        rows = int(x[0, 0]) + 1  # how many rows are used is read from the values
        return self.fc(x[:rows])

def build():
    return Picks()
"""


def test_a_static_failure_on_values_still_runs_on_made_up_inputs(tmp_path, capsys):
    """Where the static methods failed because the forward reads values, a run on zeros is the one way to a
    count: it runs, and says so."""
    factory = tmp_path / "value_sized.py"
    factory.write_text(VALUE_SIZED)
    out = tmp_path / "picks.json"
    code = main([f"{factory}:build", "--input-shape", "5,8", "--format", "json", "--output", str(out)])
    err = capsys.readouterr().err
    data = json.loads(out.read_text())
    assert code == 0 and data["method"] == "trace", err
    assert data["totals"]["macs"] == 1 * 8 * 8  # all-zero inputs: int(0) + 1 rows
    assert data["input_values"] == "all-zero inputs made from --input-shape" and "all-zero inputs" in err
