"""The HTML report: a self-contained page whose numbers come from the estimate, checked as data and
in a real headless Chromium (rendered DOM, clicks, console, screenshot).

The browser tests skip with a reason where no Chromium can be found; `.ci/run` installs Debian's.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

import fxflops
from fxflops.cli.main import main
from fxflops.report.html import to_html


@torch.library.custom_op("fxflops_html_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    """An op no rule knows, so the page has an unknown op to mark."""
    return x.clone()


@mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Odd(nn.Module):
    """A leaf whose extra_repr tries to end the page's script element."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4, bias=False)

    def extra_repr(self) -> str:
        return '</script><script>document.title="pwned"</script> & <b>'

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Mystery(nn.Module):
    """Nothing but an unknown op: it counts nothing, so only the marking shows it in the icicle."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.fxflops_html_test.mystery(x)


class Stack(nn.Module):
    """Three identical Linear(8, 8) (folded into one entry), a head, and a tail with an unknown op."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
        self.head = Odd()
        self.tail = Mystery()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.head(self.layers(x)))


BATCH = 2
# By hand: Linear(8, 8) on 2 rows: 2 * 8 * 8 = 128 MACs, 2 * 128 + 2 * 8 (bias) = 272 FLOPs, 72 params.
# Linear(8, 4) without bias: 2 * 8 * 4 = 64 MACs, 2 * 64 = 128 FLOPs, 32 params (so its share of params,
# 32 / 248, differs from its share of MACs, 64 / 448, and switching the metric resizes it).
LAYER_MACS, LAYER_FLOPS, LAYER_PARAMS = 128, 272, 72
HEAD_MACS, HEAD_FLOPS, HEAD_PARAMS = 64, 128, 32


@pytest.fixture(scope="module")
def stack_estimate():
    with pytest.warns(fxflops.UnknownOpsWarning):
        return fxflops.estimate(Stack(), (torch.randn(BATCH, 8),))


@pytest.fixture(scope="module")
def stack_page(stack_estimate, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("html") / "stack.html"
    stack_estimate.to_html(str(path))
    return path


def page_data(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="fxflops-data">(.*?)</script>', page, re.S)
    assert found, "the page carries its data as JSON"
    return json.loads(found.group(1))


def by_name(groups: list[dict]) -> dict[str, dict]:
    return {group["name"]: group for group in groups}


# --- the page as data ----------------------------------------------------------------------------


def test_page_compares_the_presets(stack_estimate, stack_page):
    page = stack_page.read_text(encoding="utf-8")
    section = html.unescape(re.search(r'<section id="compare">(.*?)</section>', page, re.S).group(1))
    comparison = stack_estimate.compare()
    assert f"{comparison.totals['fvcore'][1]:,}" in section  # the fvcore total, FMA = 1: 3 x 128 + 64 MACs
    assert comparison.totals["fvcore"] == (3 * LAYER_MACS + HEAD_MACS,) * 2
    assert "one FLOP per multiply-accumulate" in section


def test_page_is_self_contained(stack_page):
    page = stack_page.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    for reference in ("http:", "https:", "//cdn", "<link", "@import", "url(", " src=", "fetch(", "XMLHttpRequest"):
        assert reference not in page, f"the page must not reach the network: found {reference!r}"


def test_icicle_data_is_the_folded_tree_with_values_summed_over_instances(stack_estimate, stack_page):
    data = page_data(stack_page.read_text(encoding="utf-8"))
    keys = [metric["key"] for metric in data["metrics"]]
    assert keys == ["macs", "flops", "params", "bytes"]  # no latency, prediction or backward to show
    macs, flops, params = keys.index("macs"), keys.index("flops"), keys.index("params")
    groups = by_name(data["groups"])
    root = groups[""]
    assert root["v"][macs] == 3 * LAYER_MACS + HEAD_MACS
    assert root["v"][flops] == 3 * LAYER_FLOPS + HEAD_FLOPS
    assert root["v"][params] == 3 * LAYER_PARAMS + HEAD_PARAMS
    folded = groups["layers.0"]  # the three identical layers are one entry standing for all three
    assert (folded["label"], folded["count"], folded["type"]) == ("0-2", 3, "Linear")
    assert folded["v"][macs] == 3 * LAYER_MACS and folded["v"][params] == 3 * LAYER_PARAMS
    children = [data["groups"][index]["name"] for index in root["children"]]
    assert children == ["layers", "head", "tail"]
    assert groups["head"]["v"][macs] == HEAD_MACS
    assert groups["tail"]["unknown"] == ["fxflops_html_test.mystery.default"]
    assert groups["tail"]["v"][macs] == 0
    assert groups["head"]["unknown"] == [] and groups[""]["unknown"] == []


def test_tables_mark_unknown_ops_and_carry_raw_numbers_for_sorting(stack_page):
    page = stack_page.read_text(encoding="utf-8")
    ops = re.search(r'<table id="ops".*?</table>', page, re.S).group(0)
    unknown_row = re.search(r'<tr class="unknown"><td class="name">fxflops_html_test\.mystery\.default</td>'
                            r'<td data-v="1">1</td>', ops)
    assert unknown_row, "the unknown op's row is marked in the ops table"
    modules = re.search(r'<table id="modules".*?</table>', page, re.S).group(0)
    assert f'<td data-v="{LAYER_MACS}">128 MACs</td>' in modules
    assert '<tr class="unknown"><td class="name">tail</td>' in modules
    assert 'id="unknown"' in page and "These ops match no rule" in page


def test_names_are_escaped_everywhere(stack_page):
    page = stack_page.read_text(encoding="utf-8")
    assert '<script>document.title="pwned"' not in page
    config = [row[1] for row in by_name(page_data(page)["groups"])["head"]["info"] if row[0] == "config"]
    assert config == ['</script><script>document.title="pwned"</script> & <b>']  # kept, as text
    assert page.count("<script") == 2  # the data and the code, nothing injected by a module's text


def test_profile_page_offers_measured_latency():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    result = fxflops.profile(model, (torch.randn(4, 16),), steps=2, warm_up=1)
    data = page_data(result.to_html())
    keys = [metric["key"] for metric in data["metrics"]]
    assert "latency" in keys
    latency = keys.index("latency")
    root = by_name(data["groups"])[""]
    assert root["v"][latency] == pytest.approx(result.modules[""].latency)
    assert any(row[0] == "measured latency" for row in root["info"])


def test_prediction_adds_its_metric_and_the_roofline(stack_estimate):
    estimate = fxflops.estimate(nn.Linear(64, 64), input_shape=(8, 64))
    estimate.prediction = estimate.predict(peak_flops=1e12, bandwidth=1e11)
    page = to_html(estimate)
    data = page_data(page)
    keys = [metric["key"] for metric in data["metrics"]]
    assert "predicted" in keys
    assert by_name(data["groups"])[""]["v"][keys.index("predicted")] == pytest.approx(estimate.prediction.latency)
    assert '<section id="roofline">' in page and "<svg" in page


def test_backward_page_splits_forward_and_backward():
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False))
    estimate = fxflops.estimate(model, (torch.randn(2, 8),), backward=True)
    data = page_data(estimate.to_html())
    labels = [metric["label"] for metric in data["metrics"]]
    assert labels[:5] == ["fwd MACs", "fwd FLOPs", "params", "bwd MACs", "bwd FLOPs"]
    groups = by_name(data["groups"])
    # Forward by hand: 2 * 8 * 8 = 128 and 2 * 8 * 4 = 64 MACs. Backward: the last layer's input and
    # weight gradients, (2x4)(4x8) and (4x2)(2x8): 64 + 64; the first layer's weight gradient only (its
    # input needs none), (8x2)(2x8): 128.
    assert [groups[name]["v"][0] for name in ("", "0", "1")] == [192, 128, 64]
    assert [groups[name]["v"][3] for name in ("", "0", "1")] == [256, 128, 128]


def test_cli_writes_html(tmp_path, capsys):
    out = tmp_path / "lenet.html"
    assert main(["lenet5", "--format", "html", "--output", str(out), "--quiet"]) == 0
    data = page_data(out.read_text(encoding="utf-8"))
    assert data["model"] == "LeNet5"
    assert {group["name"] for group in data["groups"]} >= {"", "feature_extractor", "classifier"}


def test_cli_refuses_html_for_a_sweep(capsys):
    assert main(["gpt2-small", "--format", "html", "--sweep", "seq=64,128", "--set", "n_layer=1"]) != 0
    assert "--format html shows one estimate" in capsys.readouterr().err


# --- the page in a real browser -------------------------------------------------------------------


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


CHROMIUM = _chromium()
needs_browser = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on this machine (Debian: apt-get install -y chromium; .ci/run does)")


def run_chromium(*options: str, url: str, timeout: float = 60) -> subprocess.CompletedProcess:
    profile = tempfile.mkdtemp(prefix="fxflops-chromium-")  # never the user's own profile
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--disable-dev-shm-usage", f"--user-data-dir={profile}",
               "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000", *options, url]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


# Clicks as a user would (real click events through the DOM), then records what the page shows.
DRIVER = """
<script>
(function () {
  function names() { return Array.prototype.map.call(document.querySelectorAll("#icicle .cell"),
                                                      function (c) { return c.getAttribute("data-name"); }); }
  function top() { return document.querySelector("#icicle .cell.focus").getAttribute("data-name"); }
  function click(node) { node.dispatchEvent(new MouseEvent("click", {bubbles: true, cancelable: true})); }
  function cell(name) { return document.querySelector('#icicle .cell[data-name="' + name + '"]'); }
  function hover(name) {
    var box = cell(name).getBoundingClientRect();
    cell(name).dispatchEvent(new MouseEvent("mousemove", {bubbles: true, clientX: box.left + 3, clientY: box.top + 3}));
    return document.getElementById("tooltip").textContent;
  }
  function widths() {
    return {root: cell("").getBoundingClientRect().width, layers: cell("layers").getBoundingClientRect().width,
            head: cell("head").getBoundingClientRect().width};
  }
  var out = {before: names(), title: document.title, macs: widths(), hover: hover("head")};
  var tail = document.querySelector('#icicle .cell[data-name="tail"]');
  out.tail = {width: tail.getBoundingClientRect().width, classes: tail.className,
              root: document.querySelector('#icicle .cell[data-name=""]').className};
  click(document.querySelector('#icicle .cell[data-name="layers"]'));
  out.zoomed = {top: top(), names: names(), crumbs: document.getElementById("crumbs").textContent};
  click(document.querySelector("#icicle .cell.focus"));
  out.back = {top: top(), names: names()};
  click(cell("layers"));
  document.dispatchEvent(new KeyboardEvent("keydown", {key: "Escape", bubbles: true}));
  out.escape = top();
  click(document.querySelector('.metrics button[data-metric="2"]'));
  out.params = {checked: document.querySelector('.metrics button[aria-checked="true"]').textContent,
                widths: widths()};
  function column(index) {
    return Array.prototype.map.call(document.querySelectorAll("#modules tbody tr"),
                                    function (row) { return row.cells[index].textContent; });
  }
  var header = document.querySelectorAll("#modules thead th")[5];
  click(header);
  out.descending = column(0);
  click(header);
  out.ascending = column(0);
  click(document.querySelectorAll("#modules thead th")[0]);
  out.byName = column(0);
  out.rootExplain = document.getElementById("explain").textContent;
  click(cell("layers.0"));
  out.explain = document.getElementById("explain").textContent;
  document.body.setAttribute("data-driver", JSON.stringify(out));
}());
</script>
"""


@needs_browser
def test_page_renders_and_zooms_in_chromium(stack_page, tmp_path):
    driven = tmp_path / "driven.html"
    driven.write_text(stack_page.read_text(encoding="utf-8").replace("</body>", DRIVER + "</body>"), encoding="utf-8")
    done = run_chromium("--dump-dom", url=driven.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    assert console_lines(done.stderr) == [], "the page logs nothing and throws nothing"
    body = re.search(r"<body([^>]*)>", done.stdout).group(1)
    assert 'data-ready="true"' in body and "data-errors" not in body
    record = json.loads(html.unescape(re.search(r'data-driver="(.*?)"', body).group(1)))
    assert record["title"] == "fxflops: Stack", "no module text ran as script"
    # The live DOM holds a cell per module entry, made by the script: the folded layers are one.
    assert record["before"] == ["", "layers", "layers.0", "head", "head.proj", "tail"]
    # The tail counts nothing but ran an unknown op: it stays visible and marked, its parent flagged.
    assert record["tail"]["width"] >= 6 and "unknown" in record["tail"]["classes"].split()
    assert "holds-unknown" in record["tail"]["root"].split()
    assert record["zoomed"]["top"] == "layers"
    assert record["zoomed"]["names"] == ["layers", "layers.0"]
    assert "Stack" in record["zoomed"]["crumbs"]
    assert record["back"] == {"top": "", "names": record["before"]}
    assert record["escape"] == "", "Escape zooms back out"
    # Widths follow the shares worked out by hand. The tail ran an unknown op and counts nothing, so it
    # gets 6 px and the others share the rest: head = 64 / 448 of (root - 6) under MACs, 32 / 248 under
    # params.
    macs, params = record["macs"], record["params"]["widths"]
    assert record["params"]["checked"] == "params"
    assert abs(macs["head"] - (macs["root"] - 6) * HEAD_MACS / 448) < 1.5
    assert abs(macs["layers"] - (macs["root"] - 6) * 3 * LAYER_MACS / 448) < 1.5
    assert abs(params["head"] - (params["root"] - 6) * HEAD_PARAMS / 248) < 1.5
    # Hovering shows the module's numbers: 64 MACs, 64 / 448 = 14.29% of the model.
    assert "head.proj" not in record["hover"] and "64 MACs (14.29%)" in record["hover"]
    assert "32 (12.90%)" in record["hover"]  # its params, 32 / 248
    # Column 5 is MACs: a click sorts it largest first, a second smallest first (ties keep table order).
    assert record["descending"][:3] == ["(root)", "layers", "layers.0"]
    assert record["ascending"][:3] == ["tail", "head", "head.proj"]
    assert record["byName"] == sorted(record["byName"])
    # Clicking a module shows why its own ops cost what they do: Linear(8, 8) on 2 rows, by hand above.
    assert "module layers.0 (Linear)" in record["explain"]
    assert "macs  = numel(out) * weight.shape[-1]" in record["explain"]
    assert f"= {LAYER_MACS} MACs, {LAYER_FLOPS} FLOPs" in record["explain"]
    assert record["rootExplain"].startswith("module (root) (Stack)")


@needs_browser
def test_screenshot_is_not_blank(stack_page, tmp_path):
    shot = tmp_path / "page.png"
    done = run_chromium(f"--screenshot={shot}", "--window-size=1000,760", url=stack_page.as_uri())
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    width, height, pixels = read_png(shot.read_bytes())
    assert (width, height) == (1000, 760)
    colours = {pixels[i:i + 3] for i in range(0, len(pixels), 3 * 97)}  # a sample of every 97th pixel
    not_white = sum(1 for i in range(0, len(pixels), 3 * 97) if pixels[i:i + 3] != b"\xff\xff\xff")
    assert len(colours) > 20, "the page shows text, cells and tables in many colours"
    assert not_white > 0.05 * (len(pixels) // (3 * 97))


def read_png(blob: bytes) -> tuple[int, int, bytes]:
    """Width, height and RGB bytes of an 8-bit RGB or RGBA PNG (what Chromium writes)."""
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    position, chunks, header = 8, [], None
    while position < len(blob):
        (length,) = struct.unpack(">I", blob[position:position + 4])
        kind = blob[position + 4:position + 8]
        body = blob[position + 8:position + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
        position += 12 + length
    width, height, depth, colour_type = header[:4]
    assert depth == 8 and colour_type in (2, 6), header
    channels = 3 if colour_type == 2 else 4
    raw = zlib.decompress(b"".join(chunks))
    stride = width * channels
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            left = line[x - channels] if x >= channels else 0
            up = previous[x]
            corner = previous[x - channels] if x >= channels else 0
            if kind == 1:
                line[x] = (line[x] + left) & 0xFF
            elif kind == 2:
                line[x] = (line[x] + up) & 0xFF
            elif kind == 3:
                line[x] = (line[x] + (left + up) // 2) & 0xFF
            elif kind == 4:
                guess = left + up - corner
                pa, pb, pc = abs(guess - left), abs(guess - up), abs(guess - corner)
                line[x] = (line[x] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 0xFF
        rows.append(bytes(line if channels == 3 else b"".join(line[i:i + 3] for i in range(0, stride, 4))))
        previous = line
    return width, height, b"".join(rows)


@needs_browser
def test_unknown_ops_show_where_nothing_is_counted(tmp_path):
    """A model that counts no MACs at all still draws the module that ran an unknown op."""
    model = nn.Sequential()
    model.add_module("a", Mystery())
    model.add_module("b", nn.ReLU())
    with pytest.warns(fxflops.UnknownOpsWarning):
        estimate = fxflops.estimate(model, (torch.randn(2, 8),))
    page = tmp_path / "nothing.html"
    estimate.to_html(str(page))
    done = run_chromium("--dump-dom", url=page.as_uri())
    assert console_lines(done.stderr) == []
    cells = re.findall(r'<div class="cell([^"]*)"[^>]*data-name="([^"]*)"', done.stdout)
    assert [(name, "unknown" in classes.split()) for classes, name in cells] == [("", False), ("a", True)]
