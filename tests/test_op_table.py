"""fxflops.predict.op_table: a measured op table's rows as counted ops, and a device's constants fitted
from them. The fit is checked by recovering a device's constants from times that device's own model gives."""

from __future__ import annotations

import pytest

from fxflops.predict import op_table
from fxflops.predict.hardware import device_model, with_constant
from fxflops.predict.op_time import ATTENTION, GEMM, MEMORY


def test_a_gemm_row_is_counted_as_its_op_by_hand() -> None:
    (node,) = op_table.op_nodes("mm", (64, 96, 32))
    assert node.macs == 64 * 96 * 32 and node.flops == 2 * 64 * 96 * 32
    (node,) = op_table.op_nodes("linear", (64, 96, 32))  # x[M, K] @ W[N, K]^T
    assert node.macs == 64 * 96 * 32 and node.output_shapes[0] == (64, 96)


def test_an_attention_row_is_its_forward_and_backward_by_hand() -> None:
    b, h, s, d = 2, 4, 128, 64
    forward, backward = op_table.attention_nodes((b, h, s, d), False)
    assert forward.flops == 4 * b * h * s * s * d  # Q K^T and P V
    assert backward.flops == 10 * b * h * s * s * d  # FlopCounterMode's: 2.5x the forward
    causal, _ = op_table.attention_nodes((b, h, s, d), True)
    assert causal.effective_flops == 4 * b * h * d * s * (s + 1) // 2  # the kept pairs


def test_rows_skip_errors_other_dtypes_and_backward_memory_ops() -> None:
    table = {"ops": {"memory": [
        {"kind": "memory", "op": "gelu", "shape": [8, 64], "dtype": "bfloat16", "seconds": 3e-6, "graph_seconds": 2e-6},
        {"kind": "memory", "op": "gelu_backward", "shape": [8, 64], "dtype": "bfloat16", "seconds": 4e-5},
        {"kind": "memory", "op": "gelu", "shape": [8, 64], "dtype": "float32", "seconds": 3e-6},
        {"kind": "attention", "backend": "cudnn", "shape": [1, 1, 64, 64], "causal": False, "error": "no kernel"},
    ]}}
    (row,) = op_table.rows(table)
    assert row.kind == MEMORY and row.seconds == 2e-6  # the graph replay's time where there is one
    assert row.node.bytes == 2 * 8 * 64 * 2  # read and written once, bf16


def test_a_composite_cuda_fuses_is_timed_as_one_kernel_and_fits_nothing() -> None:
    # rms_norm is recorded as its decomposition (pow, mean, add, rsqrt, mul ...) and timed as the one fused kernel
    # torch runs on CUDA: bf16 16x64 input and 64 weight read, output and 16 fp32 rstd written, one launch
    nodes = op_table.op_nodes("rms_norm", (16, 64))
    assert len(nodes) > 1
    row = op_table.Row("rms_norm 16x64", MEMORY, nodes, 1e-5)
    device = device_model("H200 SXM")
    traffic = 16 * 64 * 2 + 64 * 2 + 16 * 64 * 2 + 16 * 4
    compute = sum(n.flops for n in nodes) / device.vector_peak("bf16")
    assert op_table.predicted(row, device) == pytest.approx(
        max(traffic / device.class_bandwidth("normalization", 64), compute) + device.launch_overhead)
    assert op_table.predicted(row, device) < sum(
        op_table.predicted(op_table.Row("", MEMORY, (n,), 1.0), device) for n in nodes)
    assert not row.single


def synthetic_table(device) -> list[op_table.Row]:
    """Rows whose times are what `device`'s own model predicts: a fit from another base must find its
    constants again."""
    specs = [("mm", (m, n, k)) for m in (2048, 8192) for n in (4096, 8192) for k in (4096, 8192)]
    specs += [("mm", (4096, 4096, k)) for k in (4095, 4094, 4092, 4088)]
    specs += [("gelu", (16, 64)), ("add", (16, 64)), ("gelu", (32768, 8192)), ("add", (32768, 4096))]
    rows = []
    for op, shape in specs:
        nodes = op_table.op_nodes(op, shape)
        row = op_table.Row(op, GEMM if op == "mm" else MEMORY, nodes, 1.0)
        rows.append(op_table.Row(op, row.kind, nodes, op_table.predicted(row, device)))
    for seq in (512, 2048):
        for causal in (False, True):
            entry = {"kind": "attention", "backend": "cudnn", "shape": [4, 8, seq, 128], "causal": causal}
            forward, backward = op_table.attention_nodes((4, 8, seq, 128), causal)
            for node in (forward, backward):
                base = op_table.Row("a", ATTENTION, (node,), 1.0, "cudnn", entry)
                rows.append(op_table.Row("a", ATTENTION, (node,), op_table.predicted(base, device), "cudnn", entry))
    return rows


def test_the_fit_recovers_the_constants_that_made_the_times() -> None:
    base = device_model("H200 SXM")
    truth = base
    for name, value in (("launch_overhead", 4e-6), ("sustained_bandwidth", 0.6),
                        ("gemm_alignment", [[2, 0.2], [4, 0.3], [8, 0.5], [16, 1.0], [128, 1.0]]),
                        ("cudnn_attention_forward", [[512, 0.4], [2048, 0.6]]),
                        ("cudnn_attention_forward_causal", [[512, 0.3], [2048, 0.5]]),
                        ("cudnn_attention_backward", [[512, 0.3], [2048, 0.45]])):
        truth = with_constant(truth, name, value, "truth")
    fitted_device, fitted = op_table.fit_device(synthetic_table(truth), base, "synthetic")
    assert fitted["launch_overhead"][0] == pytest.approx(4e-6, rel=1e-3)  # tiny ops: their ~1 ns of traffic in it
    assert fitted["sustained_bandwidth"][0] == pytest.approx(0.6, abs=1e-4)
    assert all(abs(factor - 1.0) < 1e-3 for _, factor in fitted["gemm_size_correction"][0])  # none was applied
    assert dict(map(tuple, fitted["gemm_alignment"][0])) == pytest.approx({2.0: 0.2, 4.0: 0.3, 8.0: 0.5, 16.0: 1.0, 128.0: 1.0},
                                                                             abs=1e-3)
    for name, curve in (("cudnn_attention_forward", {512.0: 0.4, 2048.0: 0.6}),
                        ("cudnn_attention_forward_causal", {512.0: 0.3, 2048.0: 0.5}),
                        ("cudnn_attention_backward", {512.0: 0.3, 2048.0: 0.45})):
        assert dict(map(tuple, fitted[name][0])) == pytest.approx(curve, abs=1e-3), name
    assert "synthetic" in fitted_device.constants["gemm_alignment"].source


def _entries(device, specs, graphed: bool) -> list[dict]:
    """Table rows (as gpu_check.py writes them) of (op, shape) whose times are `device`'s own model's."""
    out = []
    for op, shape in specs:
        nodes = op_table.op_nodes(op, shape)
        seconds = op_table.predicted(op_table.Row(op, MEMORY, nodes, 1.0), device)
        entry = {"kind": "gemm" if op == "mm" else "memory", "op": op, "shape": list(shape), "dtype": "bfloat16",
                 "seconds": seconds + (0.0 if graphed else 3e-6)}  # one by one: the host's dispatch in small ops
        if graphed:
            entry["graph_seconds"] = seconds
        out.append(entry)
    return out


def test_the_launch_overhead_is_fitted_from_graph_replays_only() -> None:
    # tiny ops timed one by one carry the host's dispatch: fitted as the launch overhead they made it 5 us and
    # said "back to back from a CUDA graph"; without a replay in the table the base's constant stays
    truth = with_constant(device_model("H200 SXM"), "launch_overhead", 2e-6, "truth")
    tiny = [("gelu", (16, 64)), ("add", (16, 64)), ("silu", (16, 64))]
    _, fitted = op_table.fit_device(op_table.rows({"memory": _entries(truth, tiny, graphed=False)}), "H200 SXM", "x")
    assert "launch_overhead" not in fitted
    rows = op_table.rows({"memory": _entries(truth, tiny, graphed=True)})
    assert all(row.graphed for row in rows)
    _, fitted = op_table.fit_device(rows, "H200 SXM", "x")
    assert fitted["launch_overhead"][0] == pytest.approx(2e-6, rel=1e-3)


def test_the_gemm_fits_cite_only_the_compute_bound_gemms_they_used() -> None:
    # mm 32768x128x128 moves more than it computes in the model: no efficiency is read from it, so it is not
    # one of the GEMMs the sources count (they said 5 of 4 used)
    base = device_model("H200 SXM")
    specs = [("mm", (4096, 4096, 4096)), ("mm", (8192, 8192, 8192)), ("mm", (4096, 4096, 4095)),
             ("mm", (4096, 4094, 4096)), ("mm", (32768, 128, 128))]
    (skinny,) = op_table.op_nodes("mm", (32768, 128, 128))
    assert op_table.op_time(skinny, base, "bf16").memory > op_table.op_time(skinny, base, "bf16").compute
    _, fitted = op_table.fit_device(op_table.rows({"gemm": _entries(base, specs, graphed=True)}), base, "x")
    assert fitted["gemm_size_correction"][1].startswith("measured / modelled efficiency of 2 GEMMs whose K and N")
    assert fitted["gemm_alignment"][1].startswith("measured / modelled efficiency of 4 GEMMs by the largest")


def test_a_table_fitted_over_the_users_own_device_file_names_it_so_it_loads(tmp_path, monkeypatch) -> None:
    # a base read from a user's file was written as its name ("my H100s"), which no preset has: the written
    # file could not be loaded. It is written as the file's absolute path (a relative one as given would be
    # read from wherever the new file is loaded), and a base changed in code is refused before any writing
    truth = with_constant(device_model("H100 SXM"), "sustained_bandwidth", 0.5, "truth")
    table = {"env": {"name": "ours"}, "memory": _entries(truth, [("gelu", (32768, 8192))], graphed=True)}
    (tmp_path / "mine.toml").write_text('name = "my H100s"\nbase = "H100 SXM"\nsm_count = 100\n')
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    for base in (device_model("mine.toml"), "mine.toml"):
        device = op_table.calibrate_table(table, base, str(out / "ours.toml"))
        assert f'base = "{tmp_path / "mine.toml"}"' in (out / "ours.toml").read_text()
        assert device.sm_count == 100 and device.sustained_bandwidth == pytest.approx(0.5, abs=1e-4)
    with pytest.raises(ValueError, match="base 'H100 SXM' is not a preset or a file as it stands"):
        op_table.calibrate_table(table, with_constant(device_model("H100 SXM"), "sm_count", 100), str(out / "x.toml"))
    assert not (out / "x.toml").exists()
    op_table.calibrate_table(table, device_model("H100"), str(out / "p.toml"))  # a preset: by its name
    assert 'base = "H100 SXM"' in (out / "p.toml").read_text()


def test_an_unknown_op_in_a_table_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no known op 'conv9d'"):
        op_table.op_nodes("conv9d", (1, 2))


def test_a_shipped_preset_may_start_from_another() -> None:
    measured = device_model("H200 SXM measured")
    assert measured.name == "H200 SXM measured" and measured.gpu == "H200 SXM"
    preset = device_model("H200 SXM")
    assert measured.peak("bf16") == preset.peak("bf16") and measured.sm_count == preset.sm_count  # from its base
    assert measured.gemm_alignment != preset.gemm_alignment  # fitted
    assert "measured on NVIDIA H200" in measured.constants["gemm_alignment"].source


def test_a_measured_table_becomes_a_device_file_citing_its_run(tmp_path) -> None:
    truth = with_constant(device_model("H200 SXM"), "sustained_bandwidth", 0.5, "truth")
    ops = {"memory": []}
    for op, shape in (("add", (16, 64)), ("gelu", (32768, 8192)), ("silu", (32768, 4096))):
        (node,) = op_table.op_nodes(op, shape)
        seconds = op_table.predicted(op_table.Row(op, MEMORY, (node,), 1.0), truth)
        ops["memory"].append({"kind": "memory", "op": op, "shape": list(shape), "dtype": "bfloat16",
                              "seconds": seconds})
    table = {"env": {"name": "NVIDIA H200", "torch": "2.11.0", "date": "2026-11-27T16:53:06"}, "ops": ops}
    path = tmp_path / "ours.toml"
    device = op_table.calibrate_table(table, "H200 SXM", str(path))
    assert device.sustained_bandwidth == pytest.approx(0.5, abs=1e-4)
    assert "measured on NVIDIA H200, torch 2.11.0, 2026-11-27" in device.constants["sustained_bandwidth"].source
    assert device.gemm_alignment == device_model("H200 SXM").gemm_alignment  # no GEMM in the table: the base's
    assert path.read_text().count("[sustained_bandwidth]") == 1
    with pytest.raises(ValueError, match="no op rows"):
        op_table.calibrate_table({"ops": {}}, "H200 SXM")


def test_each_memory_class_bandwidth_is_fitted_from_its_own_large_ops() -> None:
    # times made by a device whose softmax kernels run at 0.3 of HBM at rows of 768 and 0.5 at 8192, its pointwise
    # kernels at the sustained 0.6: the fit finds each class's curve again from the ops >= 64 MiB (by row length
    # for softmax, by octave of bytes for pointwise), and leaves classes without such ops (gather) as they were
    truth = with_constant(with_constant(device_model("H200 SXM"), "sustained_bandwidth", 0.6, "truth"),
                          "bandwidth_softmax", [[768, 0.3], [8192, 0.5]], "truth")
    specs = [("softmax", (32768, 768)), ("softmax", (32768, 8192)), ("gelu", (32768, 8192)), ("softmax", (16, 768))]
    _, fitted = op_table.fit_device(op_table.rows({"memory": _entries(truth, specs, graphed=True)}), "H200 SXM", "x")
    assert dict(map(tuple, fitted["bandwidth_softmax"][0])) == pytest.approx({768.0: 0.3, 8192.0: 0.5}, abs=1e-4)
    # gelu 32768 x 8192 in bf16 reads and writes 512 MiB each: 2^30 bytes, one octave
    assert dict(map(tuple, fitted["bandwidth_pointwise"][0])) == pytest.approx({2.0 ** 30: 0.6}, abs=1e-4)
    assert "bandwidth_gather" not in fitted
    assert fitted["bandwidth_softmax"][1].startswith("softmax ops measured (softmax; 2 moving >= 64 MiB)")
