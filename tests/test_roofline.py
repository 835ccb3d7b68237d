"""Bytes moved, arithmetic intensity and the roofline prediction, checked by hand.

An op reads each distinct input tensor once and writes each output once; every expected number
below is that sum of numel x element size, worked out from the shapes.
"""

from __future__ import annotations

import csv
import io
import json
import xml.etree.ElementTree as ElementTree

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxflops
from fxflops.device import peaks
from tests.test_cli import run_main

SIZES = {torch.float32: 4, torch.bfloat16: 2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def one_op_bytes(model: nn.Module, *inputs: torch.Tensor) -> dict[str, int]:
    """Bytes per counted op of a model's forward (views and plumbing omitted)."""
    result = fxflops.estimate(model, inputs)
    return {node.op: node.bytes for node in result.nodes if node.status == "counted"}


@DTYPES
def test_linear_reads_input_weight_bias_and_writes_output(dtype):
    s = SIZES[dtype]
    model = nn.Linear(64, 32).to(dtype)
    found = one_op_bytes(model, torch.zeros(8, 64, dtype=dtype))
    assert found == {"aten.linear.default": (8 * 64 + 32 * 64 + 32 + 8 * 32) * s}


@DTYPES
def test_conv_reads_input_and_weight(dtype):
    s = SIZES[dtype]
    model = nn.Conv2d(3, 16, 3, padding=1).to(dtype)
    found = one_op_bytes(model, torch.zeros(2, 3, 10, 10, dtype=dtype))
    (key,) = found
    assert found[key] == (2 * 3 * 10 * 10 + 16 * 3 * 3 * 3 + 16 + 2 * 16 * 10 * 10) * s


class MatmulSdpaNormAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def forward(self, q, k, v, x, y):
        attention = F.scaled_dot_product_attention(q, k, v)
        product = x @ y  # (2, 4, 8) @ (8, 3): y is broadcast, read once
        normed = self.norm(x)
        scaled = x * 2
        broadcast = x[..., :1].expand(2, 4, 8) + x  # stride-0 view: 2 x 4 stored elements read
        return attention, product, normed, scaled, broadcast, x.transpose(1, 2).reshape(2, 32)


@DTYPES
def test_matmul_sdpa_norm_and_elementwise_bytes(dtype):
    s = SIZES[dtype]
    q = torch.zeros(2, 4, 16, 8, dtype=dtype)
    x, y = torch.zeros(2, 4, 8, dtype=dtype), torch.zeros(8, 3, dtype=dtype)
    result = fxflops.estimate(MatmulSdpaNormAdd().to(dtype), (q, q.clone(), q.clone(), x, y))
    by_op: dict[str, list[int]] = {}
    for node in result.nodes:
        by_op.setdefault(node.op, []).append(node.bytes)
    assert by_op["aten.scaled_dot_product_attention.default"] == [4 * 2 * 4 * 16 * 8 * s]
    assert by_op["aten.matmul.default"] == [(2 * 4 * 8 + 8 * 3 + 2 * 4 * 3) * s]
    # layer norm reads x, weight, bias; writes the output and its per-row mean and rstd (on the CPU
    # in the input's dtype)
    assert by_op["aten.native_layer_norm.default"] == [(64 + 8 + 8 + 64 + 2 * 8) * s]
    assert by_op["aten.mul.Tensor"] == [2 * 64 * s]
    assert by_op["aten.add.Tensor"] == [(2 * 4 + 64 + 64) * s]
    for view in ("aten.transpose.int", "aten.expand.default", "aten.slice.Tensor"):
        assert by_op[view] == [0], view
    # a reshape of a transposed tensor copies (clone: read once, written once), then views the copy
    assert by_op["aten.clone.default"] == [2 * 64 * s] and by_op["aten._unsafe_view.default"] == [0]


def test_modules_sum_their_ops_bytes_and_intensity_is_flops_per_byte():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))
    result = fxflops.estimate(model, (torch.zeros(8, 64),))
    linear0 = (8 * 64 + 32 * 64 + 32 + 8 * 32) * 4
    relu = (8 * 32 + 8 * 32) * 4
    linear2 = (8 * 32 + 4 * 32 + 4 + 8 * 4) * 4
    assert [result.modules[name].bytes for name in ("0", "1", "2")] == [linear0, relu, linear2]
    assert result.total_bytes == linear0 + relu + linear2 == result.modules[""].bytes
    assert result.intensity == result.total_flops / result.total_bytes
    assert result.modules["1"].intensity == result.modules["1"].flops / relu


def test_forward_only_and_combined_calls_keep_their_bytes():
    from fxflops.timing.generate import combine
    from fxflops.tree import forward_only

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
    forward = (8 * 64 + 32 * 64 + 32 + 8 * 32) * 4 + 2 * 8 * 32 * 4
    trained = fxflops.estimate(model, (torch.zeros(8, 64),), backward=True)
    assert trained.total_bytes > forward  # the backward reads and writes too
    assert forward_only(trained).total_bytes == forward == forward_only(trained).modules[""].self_bytes + \
        sum(forward_only(trained).modules[name].bytes for name in ("0", "1"))
    single = fxflops.estimate(model, (torch.zeros(8, 64),))
    assert combine([single, single]).total_bytes == 2 * forward
    assert combine([single, single]).modules["0"].self_bytes == 2 * (8 * 64 + 32 * 64 + 32 + 8 * 32) * 4


def test_prediction_is_each_ops_roofline_time_summed():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
    result = fxflops.estimate(model, (torch.zeros(8, 64),))
    linear_flops, linear_bytes = 2 * 8 * 64 * 32 + 8 * 32, (8 * 64 + 32 * 64 + 32 + 8 * 32) * 4
    relu_flops, relu_bytes = 8 * 32, 2 * 8 * 32 * 4
    peak, bandwidth = 1e6, 2e5
    prediction = result.predict(peak_flops=peak, bandwidth=bandwidth)
    linear = max(linear_flops / peak, linear_bytes / bandwidth)
    relu = max(relu_flops / peak, relu_bytes / bandwidth)
    assert prediction.modules["0"].latency == pytest.approx(linear, rel=1e-12)
    assert prediction.modules["1"].latency == pytest.approx(relu, rel=1e-12)
    assert prediction.latency == pytest.approx(linear + relu, rel=1e-12)
    assert prediction.modules["0"].bound == "memory"  # 33 024 flops / 1e6 < 11 392 bytes / 2e5
    assert prediction.modules["1"].bound == "memory"
    compute_bound = result.predict(peak_flops=1e5, bandwidth=1e9)
    assert compute_bound.modules["0"].bound == "compute" and compute_bound.bound == "compute"
    assert prediction.memory_bound_share == pytest.approx(1.0)
    assert [m.name for m in prediction.top_memory_bound(2)] == ["0", "1"]


def test_device_peaks_come_from_the_table_for_the_dtype():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU()).to(torch.bfloat16)
    result = fxflops.estimate(model, (torch.zeros(8, 64, dtype=torch.bfloat16),))
    prediction = result.predict("H100 SXM")
    assert (prediction.device, prediction.dtype) == ("H100 SXM", "bf16")
    assert prediction.peak_flops == 989.4e12 and prediction.vector_flops == 67e12
    assert prediction.bandwidth == 3.35e12
    # linear: 2*8*64*32 + 8*32 FLOPs at the bf16 tensor peak; relu: 8*32 FLOPs at the fp32 rate
    linear_flops, linear_bytes = 2 * 8 * 64 * 32 + 8 * 32, (8 * 64 + 32 * 64 + 32 + 8 * 32) * 2
    relu_flops, relu_bytes = 8 * 32, 2 * 8 * 32 * 2
    expected = max(linear_flops / 989.4e12, linear_bytes / 3.35e12) + max(relu_flops / 67e12, relu_bytes / 3.35e12)
    assert prediction.latency == pytest.approx(expected, rel=1e-12)
    assert result.predict("H100 SXM", dtype=torch.float32).peak_flops == 67e12


def test_the_table_holds_the_datasheet_bandwidths_and_names():
    expected = {"H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H200 SXM": 4.8e12,
                "A100 80GB SXM": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100 40GB": 1.555e12,
                "V100 SXM2": 0.9e12, "L4": 0.3e12, "L40S": 0.864e12, "T4": 0.32e12, "A10": 0.6e12,
                "RTX 4090": 1.008e12, "RTX 3090": 0.936e12}
    for label, bandwidth in expected.items():
        assert peaks.lookup(label).bandwidth == pytest.approx(bandwidth), label
    assert peaks.lookup("NVIDIA H100 80GB HBM3").label == "H100 SXM"
    assert peaks.lookup("NVIDIA A100-SXM4-80GB").label == "A100 80GB SXM"
    assert peaks.lookup("NVIDIA A100 80GB PCIe").label == "A100 80GB PCIe"
    assert peaks.lookup("NVIDIA A100-PCIE-40GB").label == "A100 40GB"
    assert peaks.lookup("h100 sxm").label == "H100 SXM"
    # dense (not "with sparsity") tensor rates
    assert peaks.lookup("H100 SXM").flops["bf16"] == 989.4e12 and peaks.lookup("A100 40GB").flops["bf16"] == 312e12


def test_predict_without_a_device_says_what_to_give():
    result = fxflops.estimate(nn.Linear(4, 4), (torch.zeros(1, 4),))
    with pytest.raises(ValueError, match="device 'B200' is not in the peaks table.*H100 SXM"):
        result.predict("B200")
    with pytest.raises(ValueError, match="peak_flops must be positive"):
        result.predict(peak_flops=0, bandwidth=1e9)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a device"):
            result.predict()


def test_sweep_points_carry_bytes():
    model = nn.Sequential(nn.Linear(16, 8), nn.GELU())
    swept = fxflops.sweep(model, (torch.zeros(2, 16),), dims={"batch": 0})
    for batch in (3, 7):
        direct = fxflops.estimate(model, (torch.zeros(batch, 16),))
        assert swept.at(batch=batch).total_bytes == direct.total_bytes


# --------------------------------------------------------------------------------------- CLI


def test_cli_device_adds_the_prediction_everywhere(capsys, tmp_path):
    code, out, _ = run_main(capsys, "lenet5", "--device", "A100 80GB SXM", "--depth", "1")
    assert code == 0
    assert "predicted latency (A100 80GB SXM, fp32 roofline):" in out and "time in memory-bound ops:" in out
    assert "predicted latency, compute- or memory-bound" in out and "-bound" in out
    code, out, _ = run_main(capsys, "lenet5", "--device", "A100 80GB SXM", "--format", "json")
    data = json.loads(out)
    assert data["prediction"]["device"] == "A100 80GB SXM" and data["prediction"]["bandwidth"] == 2.039e12
    root = data["modules"][0]
    assert root["predicted_latency"] == pytest.approx(data["prediction"]["latency"])
    assert root["bound"] in ("compute", "memory") and root["bytes"] == data["totals"]["bytes"] > 0
    code, out, _ = run_main(capsys, "lenet5", "--device", "L4", "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert rows[0]["bound"] in ("compute", "memory") and float(rows[0]["predicted_latency"]) > 0
    code, out, _ = run_main(capsys, "lenet5", "--device", "L4", "--format", "table")
    assert "predicted" in out and "flops/byte" in out


def test_cli_roofline_writes_an_svg_with_a_point_per_leaf_module(capsys, tmp_path):
    target = tmp_path / "roofline.svg"
    code, _, err = run_main(capsys, "lenet5", "--device", "H100 SXM", "--roofline", str(target))
    assert code == 0 and str(target) in err
    root = ElementTree.parse(target).getroot()
    circles = root.findall("{http://www.w3.org/2000/svg}circle")
    titles = [c.find("{http://www.w3.org/2000/svg}title").text for c in circles
              if c.find("{http://www.w3.org/2000/svg}title") is not None]  # the legend's have none
    assert any(t.startswith("feature_extractor.0 (Conv2d)") for t in titles)
    assert all("predicted" in t for t in titles)
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 1  # fp32: one roof for all ops
    run_main(capsys, "lenet5", "--device", "H100 SXM", "--dtype", "bfloat16", "--roofline", str(target))
    root = ElementTree.parse(target).getroot()
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 2  # tensor cores and the rest


def test_cli_device_errors(capsys):
    code, _, err = run_main(capsys, "lenet5", "--device", "H1OO SXM")
    assert code == 2 and "did you mean 'H100 SXM'" in err
    code, _, err = run_main(capsys, "lenet5", "--roofline", "x.svg")
    assert code == 2 and "--device" in err


# ------------------------------------------------------------------------- lookups (issue 21, item 3)


def test_embedding_reads_the_rows_it_gathers_not_the_table():
    # GPT-2-small's wte at 128 tokens: 128 rows of 768 fp32 read, the 128 int64 indices, the rows written
    from fxflops.cli.examples import gpt2_small, token_inputs

    result = fxflops.estimate(gpt2_small(), token_inputs(seq_len=128))
    rows, indices = 128 * 768 * 4, 128 * 8
    assert result.modules["wte"].bytes == rows + indices + rows  # was 50257 * 768 * 4 + ...: 154.78 MB
    assert result.modules["wpe"].bytes == rows + indices + rows
    top = result.predict("H100 SXM").top_memory_bound(8)
    assert "wte" not in [m.name for m in top] and "wpe" not in [m.name for m in top]


class Lookups(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(1000, 16))
        self.bag = nn.EmbeddingBag(1000, 16, mode="sum")

    def forward(self, ids, index2d):
        a = self.table.index_select(0, ids)  # (5, 16)
        b = torch.gather(self.table, 0, index2d)  # (3, 16)
        c = self.table[ids]  # aten.index: (5, 16)
        d = self.bag(ids.view(1, 5))  # one bag of 5 rows: (1, 16)
        return a, b, c, d


def test_index_select_gather_indexing_and_embedding_bag_read_their_rows():
    ids, index2d = torch.zeros(5, dtype=torch.long), torch.zeros(3, 16, dtype=torch.long)
    result = fxflops.estimate(Lookups(), (ids, index2d))
    by_op = {n.op: n.bytes for n in result.nodes if n.bytes}
    assert by_op["aten.index_select.default"] == 5 * 16 * 4 + 5 * 8 + 5 * 16 * 4
    assert by_op["aten.gather.default"] == 3 * 16 * 4 + 3 * 16 * 8 + 3 * 16 * 4
    assert by_op["aten.index.Tensor"] == 5 * 16 * 4 + 5 * 8 + 5 * 16 * 4
    bag = result.modules["bag"].bytes
    assert bag < 1000 * 16 * 4  # 5 rows of the table, not its 1000
    assert [n.rule for n in result.nodes if n.op == "aten.index_select.default"] == ["lookup"]


def test_a_sweeps_lookup_bytes_are_symbolic_rows():
    from fxflops.cli.examples import GPT2

    model = GPT2(vocab_size=100, n_positions=256, d_model=16, n_layer=1, n_head=2).eval()
    tokens = lambda seq: (torch.zeros(1, seq, dtype=torch.long, device="meta"),)  # noqa: E731
    swept = fxflops.sweep(model, tokens(16), dims={"seq": 1})
    for seq in (16, 100):
        assert swept.at(seq=seq).modules["wte"].bytes == seq * 16 * 4 * 2 + seq * 8
        assert swept.at(seq=seq).total_bytes == fxflops.estimate(model, tokens(seq)).total_bytes


def test_a_gathers_entry_must_name_its_argument(tmp_path):
    from fxflops.rules import RuleFileError, load_rule_file

    path = tmp_path / "bad.toml"
    path.write_text('[[zero]]\nname = "x"\nops = ["aten.take"]\ngathers = "self"\n')
    with pytest.raises(RuleFileError, match="'gathers' must be a table naming the argument read"):
        load_rule_file(path)


# ------------------------------------------------------------ the roofline's labels (issue 21, item 13)

SVG = "{http://www.w3.org/2000/svg}"


def _text_boxes(root, char_width=6.2, height=13):
    """(text, box) of every text in the plot, its box from its anchor and an estimated width."""
    found = []
    for element in root.iter(f"{SVG}text"):
        text, x, y = element.text or "", float(element.get("x")), float(element.get("y"))
        width = len(text) * char_width
        anchor = element.get("text-anchor", "start")
        left = x if anchor == "start" else x - width if anchor == "end" else x - width / 2
        found.append((text, (left, y - height + 3, left + width, y + 3)))
    return found


def _overlap(a, b):
    return min(a[2], b[2]) > max(a[0], b[0]) and min(a[3], b[3]) > max(a[1], b[1])


def test_roofline_names_its_top_modules_off_the_points_and_each_other(capsys, tmp_path):
    target = tmp_path / "gpt2.svg"
    code, _, _ = run_main(capsys, "gpt2-small", "--device", "H100 SXM", "--roofline", str(target))
    assert code == 0
    root = ElementTree.parse(target).getroot()
    circles = []
    for circle in root.iter(f"{SVG}circle"):
        if circle.find(f"{SVG}title") is None:
            continue  # the legend's
        x, y, r = (float(circle.get(k)) for k in ("cx", "cy", "r"))
        circles.append((x - r, y - r, x + r, y + r))
    texts = _text_boxes(root)
    labels = [(text, box) for text, box in texts if text and any(
        element.text == text and element.get("font-size") == "11" for element in root.iter(f"{SVG}text"))]
    names = [text for text, _ in labels]
    # GPT-2's 12 identical layers sit on one spot each: named once, with how many
    assert "lm_head" in names and "h.*.attn.c_attn x12" in names and "h.*.mlp.c_fc, h.*.mlp.c_proj x24" in names
    assert 5 <= len(labels) <= 8
    assert len(root.findall(f"{SVG}line")) >= len(labels)  # each on a leader line
    for text, box in labels:
        assert not any(_overlap(box, c) for c in circles), text
        assert not any(_overlap(box, other) for other_text, other in labels if other_text != text), text
    (roof_label, roof_box), = [(t, b) for t, b in texts if t.startswith("all ops")]
    assert not any(_overlap(roof_box, c) for c in circles)  # it sat on the cluster
    assert not any(_overlap(roof_box, box) for _, box in labels)


def test_mi250x_elementwise_ops_run_at_its_vector_rate_not_the_matrix_rate():
    # AMD Instinct MI250X datasheet: FP32 matrix 95.7 TFLOPS (GEMMs), FP32 vector 47.9 (everything else)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
    prediction = fxflops.estimate(model, (torch.zeros(8, 64),)).predict("MI250X")
    assert (prediction.peak_flops, prediction.vector_flops) == (95.7e12, 47.9e12)
    assert fxflops.estimate(model, (torch.zeros(8, 64),)).predict("MI300X").vector_flops == 163.4e12
    double = nn.Sequential(nn.Linear(64, 32), nn.ReLU()).double()
    assert fxflops.estimate(double, (torch.zeros(8, 64, dtype=torch.float64),)).predict("MI250X").vector_flops == 47.9e12


def test_numbers_given_beside_a_device_are_named_given_not_the_datasheets():
    result = fxflops.estimate(nn.Linear(4, 4), (torch.zeros(1, 4),))
    assert result.predict("H100 SXM").source == "table: H100 SXM (NVIDIA H100 datasheet)"
    assert result.predict("H100 SXM", peak_flops=1e12).source == \
        "given: peak_flops; table: H100 SXM (NVIDIA H100 datasheet) for its bandwidth"
    assert result.predict("H100 SXM", bandwidth=1e9).source == \
        "given: bandwidth; table: H100 SXM (NVIDIA H100 datasheet) for its peaks"
    assert result.predict("H100 SXM", peak_flops=1e12, bandwidth=1e9).source == \
        "given: peak_flops and bandwidth (device H100 SXM)"


def test_calls_of_one_shape_each_read_their_own_tensors():
    """Three adds of (4, 8) fp32 tensors (one memo key for their counts): each reads its own inputs."""
    class Adds(nn.Module):
        def forward(self, x, y):
            return x + y, x + x, x[:, :1].expand(4, 8) + y

    result = fxflops.estimate(Adds(), (torch.zeros(4, 8), torch.zeros(4, 8)))
    adds = [node.bytes for node in result.nodes if node.op == "aten.add.Tensor"]
    whole = 4 * 8 * 4
    # x and y, then x once (passed twice), then the expanded view's 4 stored elements and y; each writes 4 x 8
    assert adds == [whole + whole + whole, whole + whole, 4 * 4 + whole + whole]
