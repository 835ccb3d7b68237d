"""Unusual uses that once reached users as raw errors (or wrong files): each gives a working result or
one clear line. Issue 22, items 12 to 16."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxflops

# ------------------------------------------------------------------ a sparse buffer under profile()


class SparseAdjacency(nn.Module):
    """A graph layer: a sparse adjacency buffer times the input, then a Linear(4, 4)."""

    def __init__(self, write: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("adj", torch.eye(4).to_sparse())
        self.write = write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.write:
            self.adj.mul_(2)  # a forward that writes into its sparse buffer: put back afterwards
        return self.lin(torch.sparse.mm(self.adj, x))


LINEAR_4x4_ON_4_ROWS = 4 * 4 * 4  # MACs by hand; the sparse mm is reported unknown, not counted


@pytest.mark.parametrize("write", [False, True])
def test_profile_works_on_a_model_with_a_sparse_buffer(write):
    model = SparseAdjacency(write)
    before = model.adj.to_dense().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxflops.UnknownOpsWarning)
        profiled = fxflops.profile(model, (torch.randn(4, 4),), warm_up=1, steps=2)
    assert profiled.total_macs == LINEAR_4x4_ON_4_ROWS
    assert profiled.measurements.fwd_latency > 0
    assert model.adj.is_sparse and torch.equal(model.adj.to_dense(), before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxflops.UnknownOpsWarning)
        traced = fxflops.estimate(model, (torch.randn(4, 4),), method="trace")  # the same guard: it failed too
    assert traced.total_macs == LINEAR_4x4_ON_4_ROWS
    assert torch.equal(model.adj.to_dense(), before)


def test_get_model_profile_works_on_a_model_with_a_sparse_buffer():
    from fxflops.compat import get_model_profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxflops.UnknownOpsWarning)
        flops, macs, params = get_model_profile(SparseAdjacency(), args=[torch.randn(4, 4)], print_profile=False,
                                                as_string=False)
    assert (macs, params) == (LINEAR_4x4_ON_4_ROWS, 4 * 4 + 4)
    assert flops == 2 * LINEAR_4x4_ON_4_ROWS + 4 * 4  # the bias adds one FLOP per output


# ------------------------------------------------------------------ predict() and --device / --roofline


@pytest.mark.parametrize("peak, bandwidth, named, shown", [
    (float("inf"), 1e12, "peak_flops", "inf"),  # before: a latency of 0 s
    (True, 1e12, "peak_flops", "True"),  # before: accepted as 1 FLOP/s
    (1e15, True, "bandwidth", "True"),
    (1e15, float("nan"), "bandwidth", "nan"),
    (1e15, "1e12", "bandwidth", "'1e12'"),
    (1e15, -1.0, "bandwidth", "-1.0"),
])
def test_predict_wants_finite_positive_rates(peak, bandwidth, named, shown):
    result = fxflops.estimate(nn.Linear(4, 4), input_shape=(2, 4))
    unit = "FLOP/s" if named == "peak_flops" else "bytes/s"
    with pytest.raises(ValueError) as raised:
        result.predict(peak_flops=peak, bandwidth=bandwidth)
    assert str(raised.value) == f"{named} must be positive and finite ({unit}), got {shown}"
    with pytest.raises(ValueError, match=f"{named} must be positive and finite"):
        result.predict("H100 SXM", **{named: peak if named == "peak_flops" else bandwidth})


def test_predict_takes_numpy_and_int_rates():
    np = pytest.importorskip("numpy")
    result = fxflops.estimate(nn.Linear(4, 4), input_shape=(2, 4))
    # 2*4*4 MACs -> 64 FLOPs + 8 bias FLOPs at 72 FLOP/s: compute-bound ops of one second at most
    prediction = result.predict(peak_flops=np.float64(72.0), bandwidth=10**15)
    assert prediction.modules[""].latency == pytest.approx(1.0)


@pytest.mark.parametrize("argv, message", [
    (["--device", ""], "--device is empty: name a GPU from the peaks table, e.g. --device 'H100 SXM'"),
    (["--device", "  "], "--device is empty: name a GPU from the peaks table, e.g. --device 'H100 SXM'"),
    (["--device", "H100 SXM", "--roofline", "{folder}/r.png"],
     "--roofline '{folder}/r.png': the roofline is an SVG image; give a file name ending in .svg"),
    (["--device", "H100 SXM", "--roofline", "{folder}/r"],
     "--roofline '{folder}/r': the roofline is an SVG image; give a file name ending in .svg"),
])
def test_cli_device_and_roofline_mistakes_are_one_line(capsys, tmp_path, argv, message):
    from fxflops.cli.main import main

    code = main(["lenet5", *(a.format(folder=tmp_path) for a in argv)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == f"fxflops: error: {message.format(folder=tmp_path)}\n"
    assert not list(tmp_path.iterdir())  # nothing written (before: SVG text in r.png)


# ------------------------------------------------------------------ a module named with a lone surrogate


def surrogate_named() -> nn.Module:
    model = nn.Sequential()
    setattr(model, "a\udcff", nn.Linear(4, 4))  # Python allows it; UTF-8 cannot encode it
    return model


ESCAPED = "a\\udcff"  # how every writer writes the name: a backslash escape


def test_every_writer_escapes_a_lone_surrogate(tmp_path, monkeypatch):
    import csv
    import io
    import json

    result = fxflops.estimate(surrogate_named(), input_shape=(2, 4))
    result.to_csv(tmp_path / "m.csv")  # before: UnicodeEncodeError
    rows = list(csv.DictReader(open(tmp_path / "m.csv", encoding="utf-8")))
    assert [row["name"] for row in rows] == ["", ESCAPED]
    result.to_html(tmp_path / "m.html")  # before: UnicodeEncodeError
    assert ESCAPED in (tmp_path / "m.html").read_text(encoding="utf-8")
    result.print(output_file=str(tmp_path / "m.txt"))  # before: UnicodeEncodeError
    assert ESCAPED in (tmp_path / "m.txt").read_text(encoding="utf-8")
    result.to_json(tmp_path / "m.json")
    modules = json.loads((tmp_path / "m.json").read_text(encoding="utf-8"))["modules"]
    assert [m["name"] for m in modules] == ["", "a\udcff"]  # JSON's own escape, read back as the name
    strict = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    monkeypatch.setattr("sys.stdout", strict)
    result.print()  # before: UnicodeEncodeError on a strict UTF-8 stdout
    strict.flush()
    assert ESCAPED in strict.buffer.getvalue().decode("utf-8")


def test_compat_output_file_escapes_a_lone_surrogate(tmp_path):
    from fxflops.compat import get_model_profile

    get_model_profile(surrogate_named(), input_shape=(2, 4), output_file=str(tmp_path / "p.txt"))
    assert ESCAPED in (tmp_path / "p.txt").read_text(encoding="utf-8")


@pytest.mark.parametrize("form", ["text", "csv", "html", "json"])
def test_cli_escapes_a_lone_surrogate(tmp_path, monkeypatch, form):
    import io

    from fxflops.cli.main import main

    factory = tmp_path / "odd.py"
    factory.write_text("from torch import nn\n\ndef build():\n    model = nn.Sequential()\n"
                       "    setattr(model, 'a\\udcff', nn.Linear(4, 4))\n    return model\n")
    model = [f"{factory}:build", "--input-shape", "2,4", "--format", form, "--quiet"]
    assert main([*model, "--output", str(tmp_path / "out")]) == 0  # before: 1, UnicodeEncodeError
    written = (tmp_path / "out").read_text(encoding="utf-8")
    assert ESCAPED in written  # JSON: its own escape, the same text
    strict = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    monkeypatch.setattr("sys.stdout", strict)
    assert main(model) == 0
    strict.flush()
    assert strict.buffer.getvalue().decode("utf-8") == written


# ------------------------------------------------------------------ factories (MODULE:FACTORY)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    from fxflops.cli.main import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("where", ["factory", "import"])
def test_a_factory_that_exits_is_an_error_naming_it(capsys, tmp_path, where):
    factory = tmp_path / "exits.py"
    body = "def build():\n    raise SystemExit(0)\n" if where == "factory" else "import sys\nsys.exit(0)\n"
    factory.write_text(body)
    code, out, err = run_cli(capsys, f"{factory}:build", "--input-shape", "2,4")  # before: 0, and nothing
    what = f"the factory {factory}:build" if where == "factory" else f"importing {factory}"
    assert (code, out) == (2, "")
    assert err == (f"fxflops: error: {what} raised SystemExit(0) instead of returning; a factory returns a model or "
                   "(model, inputs), and a model file runs no script at import\n")


def test_batch_and_seq_len_go_only_to_factories_that_name_them(capsys, tmp_path):
    # torchvision's builders take **kwargs and pass them to the model's class: batch= broke resnet18
    pytest.importorskip("torchvision")
    code, out, err = run_cli(capsys, "torchvision.models:resnet18", "--input-shape", "2,3,32,32", "--format", "csv")
    assert code == 0, err
    import csv
    import io

    rows = {row["name"]: row for row in csv.DictReader(io.StringIO(out))}
    # the first conv by hand: batch 2 x 64 out channels x 16 x 16 outputs x 3 x 7 x 7 kernel
    assert int(rows["conv1"]["macs"]) == 2 * 64 * 16 * 16 * 3 * 7 * 7
    factory = tmp_path / "f.py"
    factory.write_text("from torch import nn\n\ndef build(batch, **options):\n    assert 'seq_len' not in options\n"
                       "    return nn.Linear(options.get('width', 4), 4), ((), {'input': __import__('torch')"
                       ".zeros(batch, options.get('width', 4))})\n")
    code, out, err = run_cli(capsys, f"{factory}:build", "--batch", "3", "--set", "width=5", "--format", "csv")
    assert code == 0, err
    assert int(next(csv.DictReader(io.StringIO(out)))["macs"]) == 3 * 5 * 4  # --set still reaches **options


def test_a_file_that_is_not_python_is_one_line(capsys):
    code, out, err = run_cli(capsys, "/etc/passwd:f")  # before: 'NoneType' object has no attribute 'loader'
    assert (code, out) == (2, "")
    assert err == "fxflops: error: '/etc/passwd' is not a Python file: give FILE.py:FACTORY or package.module:FACTORY\n"


# ------------------------------------------------------------------ odd shapes, deep models, float dims


def test_input_shape_of_bools_is_one_line():
    with pytest.raises(ValueError) as raised:  # before: TypeError from torch.empty
        fxflops.estimate(nn.Linear(4, 4), input_shape=(True, 4))
    assert str(raised.value) == "input_shape must be a tuple of non-negative ints (or a list of them), got (True, 4)"


def test_input_shape_too_large_even_for_a_fake_tensor_says_so(capsys):
    with pytest.raises(ValueError) as raised:  # before: RuntimeError "Storage size calculation overflowed"
        fxflops.estimate(nn.Linear(10**6, 4), input_shape=(10**13, 10**6))
    assert str(raised.value) == ("input_shape (10000000000000, 1000000) is too large for a tensor, even a fake one: "
                                 "1e+19 elements of torch.float32 exceed torch's 2**63 - 1 bytes")
    code, out, err = run_cli(capsys, "lenet5", "--input-shape", "10000000000000,1000000")
    assert (code, out) == (2, "")
    assert err == ("fxflops: error: --input-shape 10000000000000,1000000 is too large for a tensor, even a fake "
                   "one: more than torch's 2**63 - 1 bytes\n")


def nested(depth: int) -> nn.Module:
    model: nn.Module = nn.Linear(4, 4)
    for _ in range(depth):
        model = nn.Sequential(model)
    return model


def test_a_1000_deep_sequential_is_counted_and_the_limit_put_back():
    import sys

    limit = sys.getrecursionlimit()
    model = nested(1000)  # before: RecursionError in torch's named_modules()
    assert fxflops.estimate(model, input_shape=(2, 4)).total_macs == 2 * 4 * 4
    assert fxflops.sweep(model, input_shape=(2, 4), dims={"batch": 0}).at(batch=7).total_macs == 7 * 4 * 4
    assert sys.getrecursionlimit() == limit


def test_a_model_deeper_than_the_limit_is_one_line():
    from fxflops.api import MAX_MODULE_DEPTH

    model = nested(MAX_MODULE_DEPTH + 1)
    for call in (lambda: fxflops.estimate(model, input_shape=(2, 4)),
                 lambda: fxflops.profile(model, (torch.zeros(2, 4),))):
        with pytest.raises(ValueError) as raised:
            call()
        assert str(raised.value) == (f"Sequential nests modules {MAX_MODULE_DEPTH + 1} deep; fxflops counts models "
                                     f"up to {MAX_MODULE_DEPTH:,} deep (deeper, a forward can overflow the C stack)")


@pytest.mark.parametrize("spec", [1.0, True, "1", None, (1, 2.0)])
def test_a_sweep_axis_that_is_not_an_int_is_one_line(spec):
    with pytest.raises(ValueError) as raised:  # before: TypeError 'float' object is not iterable
        fxflops.sweep(nn.Linear(4, 4), input_shape=(2, 4), dims={"seq": spec})
    assert str(raised.value) == f"dims['seq'] must be an axis (int) or a tuple of axes, got {spec!r}"
