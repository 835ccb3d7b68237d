"""Memory and collectives in the reports: per-module peaks (text, HTML, JSON, CSV), the timeline in JSON,
the HTML plot (drawn by a real browser), collectives in CSV, HTML and the Chrome trace."""

from __future__ import annotations

import csv
import io
import json
import warnings

import pytest
import torch
from torch import nn

import fxflops
from fxflops.report.chrome_trace import trace_events
from fxflops.report.machine import to_csv, to_dict
from fxflops.report.memory_plot import COLORS
from fxflops.report.tables import module_table
from tests.parallel_models import Llama
from tests.test_html import needs_browser, read_png, run_chromium

PARAMS = 2 * (64 * 64 + 64) * 4  # two Linear(64, 64), float32
X = 8 * 64 * 4  # the input, and each (8, 64) activation


def mlp_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    return fxflops.estimate(model, (torch.randn(8, 64),), memory=True)


def test_module_peaks_by_hand():
    memory = mlp_forward().memory
    peaks = memory.module_peaks
    assert peaks["0"] == PARAMS + X + X  # the input and its output
    assert peaks["1"] == PARAMS + X + 2 * X  # relu: the input, linear 0's output and its own
    assert peaks["2"] == PARAMS + X + 2 * X  # linear 0's output is gone; relu's and its own
    assert peaks[""] == memory.peak_bytes == PARAMS + 3 * X


@pytest.fixture(scope="module")
def tp_step():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(Llama(), (torch.randint(0, 256, (2, 16)),), backward=True, memory=True,
                                optimizer="adamw", parallel={"tp": 2})


# tp=2 Megatron plan: an all-reduce of b·s·h = 2·16·64 float32 after each attention and each MLP, forward
# and backward, in each of 2 layers
CALLS, PAYLOAD = 2 * 2 * 2, 2 * 16 * 64 * 4


def test_csv_carries_peak_memory_and_collectives_as_integers(tp_step):
    rows = {row["name"]: row for row in csv.DictReader(io.StringIO(to_csv(tp_step)))}
    assert int(rows[""]["peak_memory"]) == tp_step.memory.peak_bytes
    assert int(rows[""]["collective_calls"]) == CALLS
    assert int(rows[""]["collective_bytes"]) == CALLS * PAYLOAD
    assert int(rows[""]["collective_wire_bytes"]) == CALLS * PAYLOAD  # all-reduce over 2: 2·(2−1)/2 of it
    assert int(rows["layers.0.attention"]["collective_calls"]) == 2
    assert int(rows["layers.0.attention.wo"]["collective_calls"]) == 1  # the row-parallel linear's forward
    assert rows["tok_embeddings"]["collective_calls"] == "0"
    assert int(rows["layers.0"]["peak_memory"]) == tp_step.memory.module_peaks["layers.0"]


def test_csv_without_memory_leaves_the_peak_empty():
    rows = list(csv.DictReader(io.StringIO(to_csv(fxflops.estimate(nn.Linear(4, 4), (torch.randn(2, 4),))))))
    assert rows[0]["peak_memory"] == "" and rows[0]["collective_calls"] == "0"


def test_json_has_the_whole_timeline_and_module_peaks(tp_step):
    record = json.loads(json.dumps(to_dict(tp_step)))
    memory = record["memory"]
    assert len(memory["timeline"]) == len(tp_step.memory.timeline)
    index, phase, module, op, node, total, sizes = memory["timeline"][-1]
    assert phase == "optimizer step" and total == sum(sizes) == tp_step.memory.timeline[-1].total
    assert dict(zip(memory["kinds"], memory["timeline"][0][6])) == tp_step.memory.timeline[0].by_kind
    assert memory["module_peaks"][""] == memory["peak_bytes"]
    root = next(m for m in record["modules"] if m["name"] == "")
    assert root["peak_memory"] == memory["peak_bytes"] and root["collective_calls"] == CALLS
    assert record["ranks"][0]["peak_bytes"] == tp_step.ranks[0].estimate.memory.peak_bytes == memory["peak_bytes"]


def test_text_table_has_a_peak_memory_column(tp_step):
    table = module_table(tp_step, module_depth=1, raw=True)
    header, _, root = table.splitlines()[:3]
    cells = [cell.strip() for cell in root.split("|")[1:-1]]
    names = [cell.strip() for cell in header.split("|")[1:-1]]
    assert int(cells[names.index("peak memory")]) == tp_step.memory.peak_bytes


def test_html_has_the_memory_plot_and_the_collectives(tp_step):
    page = tp_step.to_html()
    section = page[page.index('<section id="memory">'):page.index("</section>", page.index('<section id="memory">'))]
    kinds = {kind for kind, size in tp_step.memory.model_states.items() if size} | {"activations", "temporaries"}
    for kind in kinds:
        assert f'data-kind="{kind}"' in section
    assert 'id="memory-peak"' in section and "optimizer step" in section
    collectives = page[page.index('<section id="collectives">'):]
    assert f"{CALLS} calls of this rank per step" in collectives
    assert "<td>all_reduce</td>" in collectives


def test_the_counted_trace_has_module_flops_collectives_and_memory(tp_step):
    events = trace_events(tp_step)["traceEvents"]
    roots = {e["args"]["phase"]: e["args"]["flops"] for e in events if e["ph"] == "X" and e["args"].get("module") == "(root)"}
    assert roots == {"forward": tp_step.fwd_flops, "backward": tp_step.bwd_flops}
    calls = [e for e in events if e.get("cat") == "collective"]
    assert len(calls) == CALLS and {e["args"]["payload bytes"] for e in calls} == {PAYLOAD}
    counters = [e for e in events if e["ph"] == "C"]
    assert max(sum(e["args"].values()) for e in counters) == tp_step.memory.peak_bytes


@needs_browser
def test_the_memory_plot_is_drawn_in_a_browser(tp_step, tmp_path):
    page = tmp_path / "memory.html"
    html = tp_step.to_html()
    # only the plot's section, so the screenshot shows it whole
    start = html.index('<section id="memory">')
    page.write_text(html[:html.index("<header>")] + html[start:html.index("</section>", start) + 10] + "</body></html>")
    shot = tmp_path / "memory.png"
    done = run_chromium(f"--screenshot={shot}", "--window-size=960,520", url=page.as_uri())
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    width, height, pixels = read_png(shot.read_bytes())
    seen = {pixels[i:i + 3] for i in range(0, len(pixels), 3)}
    for kind in ("parameters", "gradients", "optimizer", "activations"):
        colour = bytes.fromhex(COLORS[kind][1:])
        assert colour in seen, f"{kind} is not drawn"


def test_a_profiles_trace_places_collectives_at_their_modules_first_call():
    import dataclasses

    from fxflops import profile
    from fxflops.results import Collective

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)).eval()
    measured = profile(model, (torch.randn(2, 4),), steps=2)
    sent = Collective(op="all_reduce", target="_c10d_functional.all_reduce.default", module="2", phase="forward",
                      group="0", group_desc="mesh_tp", group_size=2, dtype="float32", bytes=64, wire_bytes=64, node="n")
    events = trace_events(dataclasses.replace(measured, collectives=[sent]))["traceEvents"]
    start = next(e["ts"] for e in events if e["ph"] == "X" and e["args"]["module"] == "2")
    instant = next(e for e in events if e.get("cat") == "collective")
    assert instant["ph"] == "i" and instant["ts"] == start and instant["tid"] == 1
    assert instant["args"]["payload bytes"] == 64 and instant["args"]["group"] == "mesh_tp"
