"""Text, table, JSON and CSV reports, checked against numbers worked out by hand.

Reports are parsed back into numbers (tests/report_parsing.py, which does not use fxflops'
formatter) and compared with the hand-derived values; nothing is compared with a stored copy
of our own output.
"""

from __future__ import annotations

import csv
import io
import json
import re
import warnings

import pytest
import torch
from torch import nn

import fxflops
from fxflops import report
from fxflops.report import fold as folding
from fxflops.report.formats import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    percent,
)
from fxflops.results import UNKNOWN, UNKNOWN_RULE, ZERO, Measurements
from tests.report_parsing import (
    assert_percent,
    assert_shows,
    counted,
    estimate_by_hand,
    node,
    parse_aggregated,
    parse_detailed,
    parse_summary,
)

# ------------------------------------------------------------------------------ hand numbers

BATCH = 1024
CONV = "kernel_size=(5, 5), stride=(1, 1)"
POOL = "kernel_size=2, stride=2, padding=0"
# LeNet5 per sample (../shared/DESIGN.md conventions): conv MACs = out numel * C_in * 25, flops = 2 MACs +
# out numel (bias); linear MACs = in * out, flops = 2 MACs + out; tanh = out numel; avg pool =
# input numel; softmax over 10 logits = 10 (in the root's own forward).
LENET5 = [
    # name, type, params, self MACs, self FLOPs, extra_repr
    ("", "LeNet5", 61706, 0, 10, ""),
    ("feature_extractor", "Sequential", 50692, 0, 0, ""),
    ("feature_extractor.0", "Conv2d", 156, 6 * 28 * 28 * 1 * 25, 2 * 117600 + 4704, f"1, 6, {CONV}"),
    ("feature_extractor.1", "Tanh", 0, 0, 4704, ""),
    ("feature_extractor.2", "AvgPool2d", 0, 0, 4704, POOL),
    ("feature_extractor.3", "Conv2d", 2416, 16 * 10 * 10 * 6 * 25, 2 * 240000 + 1600, f"6, 16, {CONV}"),
    ("feature_extractor.4", "Tanh", 0, 0, 1600, ""),
    ("feature_extractor.5", "AvgPool2d", 0, 0, 1600, POOL),
    ("feature_extractor.6", "Conv2d", 48120, 120 * 16 * 25, 2 * 48000 + 120, f"16, 120, {CONV}"),
    ("feature_extractor.7", "Tanh", 0, 0, 120, ""),
    ("classifier", "Sequential", 11014, 0, 0, ""),
    ("classifier.0", "Linear", 10164, 120 * 84, 2 * 10080 + 84, "in_features=120, out_features=84, bias=True"),
    ("classifier.1", "Tanh", 0, 0, 84, ""),
    ("classifier.2", "Linear", 850, 84 * 10, 2 * 840 + 10, "in_features=84, out_features=10, bias=True"),
]
LENET5_MACS_PER_SAMPLE = 117600 + 240000 + 48000 + 10080 + 840  # 416520
LENET5_FLOPS_PER_SAMPLE = sum(row[4] for row in LENET5)


def inclusive(rows, field_index):
    """Subtree sums of a per-module column of a hand table (index into the row after the name)."""
    own = {name: rest[field_index] for name, *rest in rows}
    return {
        name: sum(value for other, value in own.items()
                  if other == name or not name or other.startswith(name + "."))
        for name in own
    }


LENET5_MACS = {name: BATCH * value for name, value in inclusive(LENET5, 2).items()}
LENET5_FLOPS = {name: BATCH * value for name, value in inclusive(LENET5, 3).items()}
LENET5_PARAMS = {row[0]: row[2] for row in LENET5}
LENET5_TYPES = {row[0]: row[1] for row in LENET5}


def lenet5_nodes(batch: int = BATCH, unknown: bool = True) -> list:
    """One node per op, as the capture would produce them, plus a flatten (zero) and two unknowns."""
    nodes = []
    for name, type_name, _params, macs, flops, _extra in LENET5:
        rule = {"Conv2d": "conv", "Linear": "linear", "Tanh": "activation", "AvgPool2d": "pool"}.get(type_name)
        if rule:
            op = {"conv": "aten.conv2d.default", "linear": "aten.linear.default",
                  "activation": "aten.tanh.default", "pool": "aten.avg_pool2d.default"}[rule]
            nodes.append(counted(f"n_{name}", op, rule, name, batch * macs, batch * flops))
    nodes.append(counted("softmax", "aten.softmax.int", "softmax", "", 0, batch * 10))
    nodes.append(node("flatten", "aten.flatten.using_ints", ZERO, "view", ""))
    if unknown:
        nodes.append(node("mystery_1", "aten.mystery.default", UNKNOWN, None, "classifier.1"))
        nodes.append(node("mystery_2", "aten.mystery.default", UNKNOWN, None, "classifier"))
    return nodes


def lenet5_by_hand(batch: int = BATCH, unknown: bool = True, latencies=None, measurements=None):
    rows = [(name, type_name, params, batch * macs, batch * flops, 1, extra)
            for name, type_name, params, macs, flops, extra in LENET5]
    return estimate_by_hand("LeNet5", rows, lenet5_nodes(batch, unknown), latencies=latencies,
                            measurements=measurements, input_shapes=(((batch, 1, 32, 32),), {}))


# Latencies for a measured LeNet5: leaves chosen freely, parents = sum of children + a little.
LEAF_LATENCY = {
    "feature_extractor.0": 10e-3, "feature_extractor.1": 2e-3, "feature_extractor.2": 2.5e-3,
    "feature_extractor.3": 1e-3, "feature_extractor.4": 0.5e-3, "feature_extractor.5": 0.75e-3,
    "feature_extractor.6": 0.6e-3, "feature_extractor.7": 0.07e-3,
    "classifier.0": 2.7e-3, "classifier.1": 0.08e-3, "classifier.2": 4.2e-3,
}
LATENCY = dict(LEAF_LATENCY, feature_extractor=18e-3, classifier=7e-3)
LATENCY[""] = 25.5e-3


def measurements(**changes) -> Measurements:
    values = dict(
        device="cuda:0", device_name="NVIDIA H100 80GB HBM3", timer="cuda-event", warm_up=2, steps=10,
        fwd_latency=25e-3, fwd_latency_min=24e-3, fwd_latency_median=25e-3, fwd_latency_max=27e-3,
        hooked_fwd_latency=25.5e-3, peak_flops=989.4e12, peak_flops_source="table: H100 SXM bf16 dense",
        batch_size=BATCH, bwd_latency=50e-3, step_latency=1e-3, iter_latency=76e-3,
        world_size=4, dp_size=4, mp_size=2,
    )
    values.update(changes)
    return Measurements(**values)


# ------------------------------------------------------------------------------------ formats


@pytest.mark.parametrize(
    ("function", "value", "expected"),
    [
        (params_to_string, 590_590, "590.59 k"),
        (params_to_string, 61_706, "61.71 k"),
        (params_to_string, 156, "156"),
        (params_to_string, 0, "0"),
        (params_to_string, 109_482_240, "109.48 M"),
        (macs_to_string, 1_210_000_000, "1.21 GMACs"),
        (macs_to_string, 44_700_000_000, "44.7 GMACs"),
        (macs_to_string, 860_160, "860.16 KMACs"),
        (macs_to_string, 672, "672 MACs"),
        (macs_to_string, 0, "0 MACs"),
        (number_to_string, 89_450_000_000, "89.45 G"),
        (number_to_string, 0, "0"),
        (duration_to_string, 0.13552, "135.52 ms"),
        (duration_to_string, 34.09e-6, "34.09 us"),
        (duration_to_string, 1.89, "1.89 s"),
        (flops_to_string, 660.07e9, "660.07 GFLOPS"),
        (flops_to_string, 81.9e12, "81.9 TFLOPS"),
        (flops_to_string, 0.0, "0 FLOPS"),
    ],
)
def test_human_formats(function, value, expected):
    assert function(value) == expected


def test_percent_of_nothing_is_zero():
    assert percent(5, 0) == "0.00%"
    assert percent(1, 3) == "33.33%"


# -------------------------------------------------------------------------- text: LeNet5


def test_lenet5_detailed_profile_has_hand_numbers_in_place():
    estimate = lenet5_by_hand()
    entries = parse_detailed(estimate.print(as_string=True))
    assert set(entries) == set(LENET5_PARAMS)
    total_macs = LENET5_MACS[""]
    for name, entry in entries.items():
        fields = entry["fields"]
        assert entry["type"] == LENET5_TYPES[name]
        assert_shows(fields[0], LENET5_PARAMS[name])
        assert fields[1].endswith(" Params")
        assert_percent(fields[1], LENET5_PARAMS[name], 61706)
        assert_shows(fields[2], LENET5_MACS[name], "MACs")
        assert fields[3].endswith(" MACs")
        assert_percent(fields[3], LENET5_MACS[name], total_macs)
    # conv1: 1024 * 6*28*28 * 25 = 120,422,400 MACs = 28.23% of 426,516,480
    assert entries["feature_extractor.0"]["fields"][:4] == ["156", "0.25% Params", "120.42 MMACs", "28.23% MACs"]
    # the module's own extra_repr follows the numbers
    assert ", ".join(entries["feature_extractor.0"]["fields"][4:]) == f"1, 6, {CONV}"
    assert entries["classifier.1"]["fields"][4:] == []


def test_lenet5_summary_rows():
    estimate = lenet5_by_hand()
    rows = parse_summary(estimate.print(as_string=True))
    assert rows["model:"] == "LeNet5"
    assert rows["input shapes:"] == "(1024, 1, 32, 32)"
    assert rows["capture method:"] == "export"
    assert rows["conventions:"] == "deepspeed"
    assert_shows(rows["params:"], 61706)
    assert_shows(rows["fwd MACs:"], BATCH * LENET5_MACS_PER_SAMPLE, "MACs")
    assert_shows(rows["fwd flops:"], BATCH * LENET5_FLOPS_PER_SAMPLE)
    # nothing measured: no latency rows at all
    assert not any("latency" in label or "FLOPS" in label for label in rows)


def test_node_shares_and_unknown_ops_are_listed():
    text = lenet5_by_hand().print(as_string=True)
    rows = parse_summary(text)
    # 11 module ops + softmax counted, flatten zero, 2 unknown = 15 nodes
    share = rows["graph nodes:"]
    assert share.startswith("15 (")
    numbers = re.findall(r"(counted|zero|unknown) (\d+) = (\d+\.\d\d)%", share)
    assert numbers == [("counted", "12", "80.00"), ("zero", "1", "6.67"), ("unknown", "2", "13.33")]
    assert rows["unknown ops:"].startswith("1 kind, 2 nodes")
    listing = [line for line in text.splitlines() if "aten.mystery.default" in line]
    assert len(listing) == 1 and "x2" in listing[0] and "classifier.1" in listing[0]


def test_no_unknown_ops_says_none():
    rows = parse_summary(lenet5_by_hand(unknown=False).print(as_string=True))
    assert rows["unknown ops:"] == "none"
    assert "unknown 0 = 0.00%" in rows["graph nodes:"]


def test_aggregated_profile_sums_types_per_depth():
    text = lenet5_by_hand().print(as_string=True, top_modules=3)
    aggregated = parse_aggregated(text)
    assert sorted(aggregated) == [0, 1, 2]
    depth2 = aggregated[2]
    assert list(depth2["params"]) == ["Conv2d", "Linear", "Tanh"]
    assert_shows(depth2["params"]["Conv2d"], 156 + 2416 + 48120)
    assert_shows(depth2["params"]["Linear"], 10164 + 850)
    assert list(depth2["MACs"])[:2] == ["Conv2d", "Linear"]
    assert_shows(depth2["MACs"]["Conv2d"], BATCH * (117600 + 240000 + 48000), "MACs")
    assert_shows(depth2["MACs"]["Linear"], BATCH * (10080 + 840), "MACs")
    assert_shows(aggregated[1]["params"]["Sequential"], 61706)
    assert "fwd latency" not in depth2


def test_top_modules_limits_entries():
    aggregated = parse_aggregated(lenet5_by_hand().print(as_string=True, top_modules=1))
    assert all(len(entry["MACs"]) == 1 for entry in aggregated.values())


def test_module_depth_limits_both_profiles():
    text = lenet5_by_hand().print(as_string=True, module_depth=1)
    assert sorted(parse_aggregated(text)) == [0, 1]
    entries = parse_detailed(text)
    assert set(entries) == {"", "feature_extractor", "classifier"}
    assert entries["feature_extractor"]["fields"][-1] == "..."  # submodules hidden


def test_not_detailed_leaves_out_the_tree():
    text = lenet5_by_hand().print(as_string=True, detailed=False)
    assert "Detailed Profile" not in text
    assert "Aggregated Profile" in text


def test_print_writes_stdout_or_file(tmp_path, capsys):
    estimate = lenet5_by_hand()
    assert estimate.print() is None
    printed = capsys.readouterr().out
    assert printed == estimate.print(as_string=True) == report.text.text(estimate, as_string=True)
    target = tmp_path / "profile.txt"
    assert estimate.print(output_file=str(target)) is None
    assert capsys.readouterr().out == ""
    assert target.read_text(encoding="utf-8") == printed


def test_cost_per_rule_table_under_the_summary():
    text = lenet5_by_hand().print(as_string=True)
    rows = {line.split()[0]: line.split() for line in text.splitlines() if re.match(r"^(conv|linear|pool) ", line)}
    assert rows["conv"][2] == "3"  # three conv nodes
    assert " ".join(rows["conv"][3:5]) == macs_to_string(BATCH * 405600)
    assert_shows(" ".join(rows["conv"][3:5]), BATCH * 405600, "MACs")
    assert_percent(rows["conv"][5], 405600, LENET5_MACS_PER_SAMPLE)


# -------------------------------------------------------------------------- text: measured


def test_measured_summary_has_deepspeed_rows():
    m = measurements()
    estimate = lenet5_by_hand(latencies=LATENCY, measurements=m)
    rows = parse_summary(estimate.print(as_string=True))
    flops = BATCH * LENET5_FLOPS_PER_SAMPLE
    params = 61706
    assert rows["world size:"] == "4"
    assert rows["data parallel size:"] == "4"
    assert rows["model parallel size:"] == "2"
    assert rows["batch size per GPU:"] == "1024"
    assert_shows(rows["params per GPU:"], params)
    assert_shows(rows["params of model = params per GPU * mp_size:"], 2 * params)
    assert_shows(rows["fwd flops of model = fwd flops per GPU * mp_size:"], 2 * flops)
    assert_shows(rows["fwd latency:"], 25e-3, "s")
    assert_shows(rows["fwd FLOPS per GPU = fwd flops per GPU / fwd latency:"], flops / 25e-3, "FLOPS")
    assert_shows(rows["bwd latency:"], 50e-3, "s")
    assert_shows(rows["bwd FLOPS per GPU = 2 * fwd flops per GPU / bwd latency:"], 2 * flops / 50e-3, "FLOPS")
    assert_shows(
        rows["fwd+bwd FLOPS per GPU = 3 * fwd flops per GPU / (fwd+bwd latency):"], 3 * flops / 75e-3, "FLOPS"
    )
    assert_shows(rows["step latency:"], 1e-3, "s")
    assert_shows(rows["iter latency:"], 76e-3, "s")
    assert_shows(rows["FLOPS per GPU = 3 * fwd flops per GPU / iter latency:"], 3 * flops / 76e-3, "FLOPS")
    # DeepSpeed: batch per GPU * dp_size / iter latency
    assert float(rows["samples/second:"]) == round(BATCH * 4 / 76e-3, 2)
    utilization = rows["fwd FLOPS utilization = fwd FLOPS / peak FLOPS:"]
    assert float(utilization.rstrip("%")) == pytest.approx(100 * flops / 25e-3 / 989.4e12, rel=1e-2)


def test_measured_rows_appear_only_when_measured():
    m = measurements(bwd_latency=None, step_latency=None, iter_latency=None, world_size=None,
                     dp_size=None, mp_size=None, peak_flops=None, batch_size=None, device="cpu")
    rows = parse_summary(lenet5_by_hand(latencies=LATENCY, measurements=m).print(as_string=True))
    assert "fwd latency:" in rows
    assert "fwd FLOPS per device = fwd flops per device / fwd latency:" in rows
    for absent in ("bwd", "step latency", "iter latency", "world size", "parallel size", "samples",
                   "mp_size", "utilization", "batch size"):
        assert not any(absent in label for label in rows), absent


def test_measured_detailed_and_aggregated_latency():
    estimate = lenet5_by_hand(latencies=LATENCY, measurements=measurements())
    text = estimate.print(as_string=True, top_modules=2)
    entries = parse_detailed(text)
    for name, latency in LATENCY.items():
        fields = entries[name]["fields"]
        assert_shows(fields[4], latency, "s")
        assert fields[5].endswith(" latency")
        assert_percent(fields[5], latency, LATENCY[""])  # share of the top module's latency
        assert_shows(fields[6], LENET5_FLOPS[name] / latency, "FLOPS")
    aggregated = parse_aggregated(text)
    assert list(aggregated[2]["fwd latency"]) == ["Conv2d", "Linear"]
    assert_shows(aggregated[2]["fwd latency"]["Conv2d"], 10e-3 + 1e-3 + 0.6e-3, "s")


# ------------------------------------------------------------------------------------ folding


BLOCK_MACS = 2 * 4 * 16 * 16  # two Linear(16,16) on 4 tokens


def stack_by_hand(layers: int = 4, odd_layer: int | None = None, latencies=None):
    """A root holding a ModuleList of identical blocks of two Linear(16, 16), then a head."""
    linear = "in_features=16, out_features=16, bias=True"
    rows = [("", "Stack", 0, 0, 0, 1, ""), ("blocks", "ModuleList", 0, 0, 0, 0, "")]
    for index in range(layers):
        extra_macs = 100 if index == odd_layer else 0
        rows.append((f"blocks.{index}", "Block", 2 * 272, extra_macs, 0, 1, ""))
        for part in ("up", "down"):
            rows.append((f"blocks.{index}.{part}", "Linear", 272, 4 * 16 * 16, 2 * 4 * 16 * 16 + 4 * 16, 1, linear))
    rows.append(("head", "Linear", 272, 4 * 16 * 16, 2 * 4 * 16 * 16 + 4 * 16, 1, linear))
    params = layers * 2 * 272 + 272
    rows[0] = ("", "Stack", params, 0, 0, 1, "")
    rows[1] = ("blocks", "ModuleList", layers * 2 * 272, 0, 0, 0, "")
    return estimate_by_hand("Stack", rows, [], latencies=latencies)


def test_identical_siblings_fold_and_keep_totals():
    estimate = stack_by_hand(layers=4)
    entries = parse_detailed(estimate.print(as_string=True))
    assert "blocks.0-3" in entries
    block = entries["blocks.0-3"]
    assert block["type"] == "Block" and block["count"] == 4
    assert_shows(block["fields"][2], BLOCK_MACS, "MACs")  # one instance's numbers
    blocks = entries["blocks"]
    # count x one instance = what the parent holds; the parent's total is the model's minus the head
    assert_shows(blocks["fields"][2], block["count"] * BLOCK_MACS, "MACs")
    assert estimate.modules["blocks"].macs == 4 * BLOCK_MACS
    assert_shows(entries[""]["fields"][2], 4 * BLOCK_MACS + BLOCK_MACS // 2, "MACs")  # + head
    assert entries["blocks.0-3.up"]["count"] == entries["blocks.0-3.down"]["count"] == 1  # named apart: never folded
    assert not any(path.startswith("blocks.1") for path in entries)
    assert "identical numbered repeats" in estimate.print(as_string=True)


def test_no_fold_shows_every_instance():
    estimate = stack_by_hand(layers=4)
    entries = parse_detailed(estimate.print(as_string=True, fold=False))
    assert {f"blocks.{i}" for i in range(4)} <= set(entries)
    assert all(entry["count"] == 1 for entry in entries.values())
    assert "identical numbered repeats" not in estimate.print(as_string=True, fold=False)


def test_different_sibling_breaks_the_run():
    entries = parse_detailed(stack_by_hand(layers=5, odd_layer=2).print(as_string=True))
    assert {"blocks.0-1", "blocks.2", "blocks.3-4"} <= set(entries)
    assert entries["blocks.0-1"]["count"] == 2 and entries["blocks.3-4"]["count"] == 2
    assert_shows(entries["blocks.2"]["fields"][2], BLOCK_MACS + 100, "MACs")
    # instances shown x counts add up to the parent
    shown = sum(entries[path]["count"] * (BLOCK_MACS + (100 if path == "blocks.2" else 0))
                for path in ("blocks.0-1", "blocks.2", "blocks.3-4"))
    assert shown == stack_by_hand(layers=5, odd_layer=2).modules["blocks"].macs


def test_differently_named_siblings_never_fold():
    # up and down are identical Linear leaves, but named apart: only numbered repeats fold (was
    # "(up, down): 2 x Linear"), in the text report, the tables and the HTML report alike
    estimate = stack_by_hand(layers=1)
    entries = parse_detailed(estimate.print(as_string=True))
    assert "blocks.0.up" in entries and "blocks.0.down" in entries
    assert entries["blocks.0.up"]["count"] == entries["blocks.0.down"]["count"] == 1
    labels = {group.label: group.count for group, _ in folding.walk(estimate)}
    assert labels["up"] == labels["down"] == 1 and "up, down" not in labels
    from fxflops.report.html import to_html

    page = to_html(estimate)  # the HTML report folds with the same function
    assert "up, down" not in page and '"up"' in page and '"down"' in page


def test_folded_latency_is_the_mean():
    latencies = {f"blocks.{i}": (i + 1) * 1e-3 for i in range(4)}
    latencies.update({f"blocks.{i}.{p}": (i + 1) * 0.4e-3 for i in range(4) for p in ("up", "down")})
    latencies[""] = 20e-3
    estimate = stack_by_hand(layers=4, latencies=latencies)
    entries = parse_detailed(estimate.print(as_string=True))
    assert_shows(entries["blocks.0-3"]["fields"][4], 2.5e-3, "s")  # mean of 1..4 ms
    assert_shows(entries["blocks.0-3.up"]["fields"][4], 1e-3, "s")  # mean of 0.4..1.6 ms
    group = next(g for g, _ in folding.walk(estimate) if g.label == "0-3")
    assert group.count == 4 and folding.mean_latency(estimate, group) == pytest.approx(2.5e-3)


# ------------------------------------------------------------------------------------- tables


def markdown_rows(table: str) -> list[dict[str, str]]:
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def test_op_table_by_op_and_rule():
    estimate = lenet5_by_hand()
    by_op = {row["op"]: row for row in markdown_rows(report.op_table(estimate, by="op"))}
    conv = by_op["aten.conv2d.default"]
    assert conv["count"] == "3" and conv["status"] == "counted"
    assert_shows(conv["MACs"], BATCH * 405600, "MACs")
    assert_percent(conv["% MACs"], 405600, LENET5_MACS_PER_SAMPLE)
    assert by_op["aten.mystery.default"]["status"] == "unknown"
    assert by_op["aten.mystery.default"]["count"] == "2"
    assert by_op["total"]["count"] == "15"
    by_rule = {row["rule"]: row for row in markdown_rows(report.op_table(estimate, by="rule"))}
    assert by_rule[UNKNOWN_RULE]["count"] == "2"
    assert by_rule["pool"]["FLOPs"] == number_to_string(BATCH * (4704 + 1600))
    raw = {row["op"]: row for row in markdown_rows(report.op_table(estimate, raw=True))}
    assert raw["aten.conv2d.default"]["MACs"] == str(BATCH * 405600)


def test_op_table_rejects_unknown_grouping():
    with pytest.raises(ValueError):
        report.op_table(lenet5_by_hand(), by="module")


def test_module_table_folds_and_formats():
    estimate = stack_by_hand(layers=4)
    rows = {row["module"]: row for row in markdown_rows(report.module_table(estimate))}
    assert rows["blocks.[0-3]"]["count"] == "4"
    assert "blocks.[0-3].up" in rows and "blocks.[0-3].down" in rows  # named siblings stay apart
    assert_shows(rows["blocks.[0-3]"]["MACs"], BLOCK_MACS, "MACs")
    unfolded = markdown_rows(report.module_table(estimate, fold=False, raw=True))
    assert len(unfolded) == len(estimate.modules)
    assert sum(int(row["MACs"]) for row in unfolded if row["type"] == "Linear") == 4 * BLOCK_MACS + BLOCK_MACS // 2
    plain = report.module_table(estimate, tablefmt="plain")
    assert "|" not in plain and "blocks.[0-3]" in plain


def test_module_table_latency_columns_only_when_measured():
    plain = markdown_rows(report.module_table(lenet5_by_hand()))
    assert "latency" not in plain[0]
    measured = markdown_rows(report.module_table(lenet5_by_hand(latencies=LATENCY, measurements=measurements())))
    assert_shows(measured[0]["latency"], 25.5e-3, "s")


def test_tables_has_three_sections():
    text = report.tables.tables(lenet5_by_hand())
    assert [line for line in text.splitlines() if line.startswith("Cost per")] == [
        "Cost per rule", "Cost per op", "Cost per module"]


# ------------------------------------------------------------------------------- JSON and CSV


def assert_json_matches(estimate, data):
    assert data["schema"] == report.SCHEMA and data["schema_version"] == report.SCHEMA_VERSION
    assert data["fxflops_version"] == fxflops.__version__
    assert data["torch_version"] == torch.__version__
    assert data["totals"] == {"macs": estimate.total_macs, "flops": estimate.total_flops,
                              "params": estimate.total_params, "bytes": estimate.total_bytes}
    assert [item["name"] for item in data["modules"]] == list(estimate.modules)
    for item in data["modules"]:
        stats = estimate.modules[item["name"]]
        for key in ("type", "depth", "params", "macs", "flops", "self_macs", "self_flops", "calls",
                    "extra_repr", "children", "latency", "latency_calls"):
            assert item[key] == getattr(stats, key), (item["name"], key)
    assert data["by_op"] == {op: {"count": t.count, "macs": t.macs, "flops": t.flops, "bwd_macs": t.bwd_macs,
                                  "bwd_flops": t.bwd_flops, "status": estimate.statuses("op")[op]}
                             for op, t in estimate.by_op.items()}
    assert data["by_rule"] == {rule: {"count": t.count, "macs": t.macs, "flops": t.flops, "bwd_macs": t.bwd_macs,
                                      "bwd_flops": t.bwd_flops, "status": estimate.statuses("rule")[rule]}
                               for rule, t in estimate.by_rule.items()}
    for op, t in estimate.by_op.items():  # the status column the text report shows, from the nodes
        assert data["by_op"][op]["status"] == "/".join(sorted({n.status for n in estimate.nodes if n.op == op}))
    assert data["unknown"] == [{"op": u.op, "count": u.count, "modules": list(u.modules)}
                               for u in estimate.unknown]
    assert data["node_status"] == estimate.node_status_counts()
    assert data["method"] == estimate.method and data["conventions"] == estimate.conventions


def test_json_says_what_the_estimate_says(tmp_path):
    estimate = lenet5_by_hand()
    path = tmp_path / "estimate.json"
    text = estimate.to_json(str(path))
    assert path.read_text(encoding="utf-8") == text
    data = json.loads(text)
    assert_json_matches(estimate, data)
    # hand numbers, not just self-consistency
    assert data["totals"]["macs"] == BATCH * LENET5_MACS_PER_SAMPLE
    assert data["modules"][2]["macs"] == BATCH * 117600
    assert data["input_shapes"] == [[[BATCH, 1, 32, 32]], {}]
    assert data["measurements"] is None
    assert "nodes" not in data


def test_json_round_trip_rebuilds_the_estimate():
    estimate = lenet5_by_hand()
    back = report.from_json(estimate.to_json(include_nodes=True))
    assert back.modules == estimate.modules
    assert back.nodes == estimate.nodes
    assert (back.by_op, back.by_rule, back.unknown) == (estimate.by_op, estimate.by_rule, estimate.unknown)
    assert (back.total_macs, back.total_flops, back.total_params) == (
        estimate.total_macs, estimate.total_flops, estimate.total_params)
    assert set(back.tree.edges) == set(estimate.tree.edges)
    assert back.print(as_string=True) == estimate.print(as_string=True)


def test_json_round_trip_with_measurements():
    m = measurements()
    estimate = lenet5_by_hand(latencies=LATENCY, measurements=m)
    data = estimate.to_dict()
    assert data["measurements"]["bwd_latency"] == m.bwd_latency
    assert data["measurements"]["achieved_flops"] == pytest.approx(estimate.total_flops / m.fwd_latency)
    assert data["measurements"]["utilization"] == pytest.approx(estimate.total_flops / m.fwd_latency / m.peak_flops)
    back = report.from_dict(json.loads(json.dumps(data)))
    assert isinstance(back, fxflops.Profile)
    assert back.measurements == m
    assert back.modules[""].latency == LATENCY[""]


def test_from_dict_refuses_other_documents():
    with pytest.raises(ValueError):
        report.from_dict({"schema": "something else"})


def test_csv_one_row_per_module(tmp_path):
    estimate = lenet5_by_hand(latencies=LATENCY, measurements=measurements())
    path = tmp_path / "modules.csv"
    text = estimate.to_csv(str(path))
    assert path.read_text(encoding="utf-8") == text
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [row["name"] for row in rows] == list(estimate.modules)
    assert tuple(rows[0]) == report.CSV_COLUMNS
    for row in rows:
        name = row["name"]
        assert int(row["params"]) == LENET5_PARAMS[name]
        assert int(row["macs"]) == LENET5_MACS[name]
        assert int(row["flops"]) == LENET5_FLOPS[name]
        assert float(row["latency"]) == LATENCY[name]
        assert float(row["achieved_flops"]) == pytest.approx(LENET5_FLOPS[name] / LATENCY[name])
    unmeasured = list(csv.DictReader(io.StringIO(lenet5_by_hand().to_csv())))
    assert unmeasured[0]["latency"] == "" and unmeasured[0]["achieved_flops"] == ""


# ------------------------------------------------------------- with the estimator, end to end


def estimate_example(name: str, batch: int, seq_len: int = 8, **sizes):
    from fxflops.cli import examples

    example = examples.get_example(name)
    with torch.device("meta"):
        model = example.build(**sizes)
    return fxflops.estimate(model, example.inputs(batch=batch, seq_len=seq_len))


def test_estimated_lenet5_report_has_hand_numbers():
    estimate = estimate_example("lenet5", batch=BATCH)
    text = estimate.print(as_string=True, top_modules=3)
    entries = parse_detailed(text)
    assert set(entries) == set(LENET5_PARAMS)
    for name, entry in entries.items():
        assert_shows(entry["fields"][0], LENET5_PARAMS[name])
        assert_shows(entry["fields"][2], LENET5_MACS[name], "MACs")
        assert_percent(entry["fields"][3], LENET5_MACS[name], LENET5_MACS[""])
    rows = parse_summary(text)
    assert_shows(rows["fwd MACs:"], BATCH * LENET5_MACS_PER_SAMPLE, "MACs")
    assert_shows(rows["fwd flops:"], BATCH * LENET5_FLOPS_PER_SAMPLE)
    assert rows["unknown ops:"] == "none"
    assert_shows(parse_aggregated(text)[2]["MACs"]["Conv2d"], BATCH * 405600, "MACs")


# A GPT-2-shaped model small enough to reason about: B=2, S=8, d=32, H=4, V=100, 3 layers.
B, S, D, H, V, LAYERS = 2, 8, 32, 4, 100, 3
GPT_SIZES = dict(vocab_size=V, n_positions=16, d_model=D, n_layer=LAYERS, n_head=H)
ATTN_MACS = B * S * D * 3 * D + B * S * D * D + B * H * S * S * (D // H + D // H)  # qkv, proj, SDPA
MLP_MACS = B * S * D * 4 * D * 2
BLOCK_PARAMS = 2 * 2 * D + (D * 3 * D + 3 * D) + (D * D + D) + (D * 4 * D + 4 * D) + (4 * D * D + D)
HEAD_MACS = B * S * D * V


def test_estimated_transformer_report_has_hand_numbers():
    estimate = estimate_example("gpt2-small", batch=B, seq_len=S, **GPT_SIZES)
    text = estimate.print(as_string=True, top_modules=2)
    entries = parse_detailed(text)
    total_macs = LAYERS * (ATTN_MACS + MLP_MACS) + HEAD_MACS
    params = V * D + 16 * D + LAYERS * BLOCK_PARAMS + 2 * D  # lm_head shares wte's weight
    assert_shows(entries[""]["fields"][0], params)
    assert_shows(entries[""]["fields"][2], total_macs, "MACs")
    layers = entries["h.0-2"]
    assert layers["type"] == "GPT2Block" and layers["count"] == LAYERS
    assert_shows(layers["fields"][0], BLOCK_PARAMS)
    assert_shows(layers["fields"][2], ATTN_MACS + MLP_MACS, "MACs")
    assert_percent(layers["fields"][3], ATTN_MACS + MLP_MACS, total_macs)
    assert_shows(entries["h.0-2.attn"]["fields"][2], ATTN_MACS, "MACs")
    assert_shows(entries["h.0-2.mlp"]["fields"][2], MLP_MACS, "MACs")
    assert_shows(entries["lm_head"]["fields"][2], HEAD_MACS, "MACs")
    assert_shows(entries["h"]["fields"][2], LAYERS * (ATTN_MACS + MLP_MACS), "MACs")
    rows = parse_summary(text)
    assert_shows(rows["fwd MACs:"], total_macs, "MACs")
    assert rows["input shapes:"] == f"({B}, {S})"
    assert list(parse_aggregated(text)[2]["MACs"]) == ["GPT2Block"]
    # Unfolded, every layer appears with the same numbers
    unfolded = parse_detailed(estimate.print(as_string=True, fold=False))
    for index in range(LAYERS):
        assert_shows(unfolded[f"h.{index}"]["fields"][2], ATTN_MACS + MLP_MACS, "MACs")


def test_estimated_transformer_json_round_trip():
    estimate = estimate_example("gpt2-small", batch=B, seq_len=S, **GPT_SIZES)
    data = json.loads(estimate.to_json(include_nodes=True))
    assert_json_matches(estimate, data)
    assert data["totals"]["macs"] == LAYERS * (ATTN_MACS + MLP_MACS) + HEAD_MACS
    back = report.from_dict(data)
    assert back.modules == estimate.modules and back.nodes == estimate.nodes
    rows = list(csv.DictReader(io.StringIO(estimate.to_csv())))
    assert len(rows) == len(estimate.modules)
    assert int(rows[0]["macs"]) == estimate.total_macs


def test_unknown_ops_are_one_row_of_the_rule_table_and_counted_once():
    # a real estimate (not a hand-built one): 2 unknown matrix_exp calls and 1 counted linear
    class Unknown(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(3, 3)

        def forward(self, x):
            return torch.linalg.matrix_exp(self.proj(x)) + torch.linalg.matrix_exp(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimate = fxflops.estimate(Unknown(), (torch.randn(3, 3),))
    rows = {row["rule"]: row for row in markdown_rows(report.op_table(estimate, by="rule"))}
    assert [key for key in rows if "unknown" in key] == [UNKNOWN_RULE]
    assert rows[UNKNOWN_RULE]["count"] == "2"
    assert rows["total"]["count"] == str(len(estimate.nodes))
    text = estimate.print(as_string=True)
    assert text.count("unknown ") >= 1 and "<unknown>" not in text


def test_repr_of_an_estimate_is_one_short_line():
    estimate = fxflops.estimate(nn.Linear(4, 5), (torch.randn(2, 4),))
    text = repr(estimate)
    assert "\n" not in text and len(text) < 300
    # 2 x 4 x 5 MACs; 2 x MACs + a bias add per output element; 4 x 5 + 5 parameters
    assert text == ("Estimate(model=Linear, method=eager, conventions=deepspeed, macs=40, flops=90, params=25, "
                    "modules=1, nodes=1, unknown ops=0)")



def test_report_package_keeps_its_submodule_names():
    import types

    assert isinstance(report.text, types.ModuleType) and isinstance(report.tables, types.ModuleType)


def test_top_zero_prints_no_aggregated_profile():
    text = lenet5_by_hand().print(top_modules=0, as_string=True)
    assert "{}" not in text and "Aggregated Profile" not in text
    assert "Detailed Profile" in text


def test_timer_line_counts_steps_in_words_and_shows_the_profile_step():
    estimate = lenet5_by_hand(measurements=measurements(warm_up=1, steps=1))
    text = estimate.print(as_string=True)
    assert "1 warm-up + 1 timed step" in text and "timed steps" not in text
    estimate.measurements.extra["profile_step"] = 3  # as DeepSpeed's print_model_profile(profile_step=3)
    assert "Profile Summary at step 3" in estimate.print(as_string=True)
