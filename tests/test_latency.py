"""The timed eager pass: hooks, replay, aggregation, the join onto an Estimate, peaks, the trace.

No assertion here is about how fast anything is (that is benchmarks/); times are only checked
for being positive and nesting, which holds exactly for a host clock read in the hooks.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import fxflops
from fxflops.device import peaks
from fxflops.timing.backward import PhaseTimer
from fxflops.timing.clocks import CpuClock
from fxflops.timing.join import join
from fxflops.timing.latency import ModuleTimer, StepRecord, mean_per_step, replay
from fxflops.timing.profiling import profile, signature
from fxflops.report.chrome_trace import trace_events, write_chrome_trace
from fxflops.results import ROOT_LABEL, Estimate, Measurements, ModuleStats, Profile
from fxflops.tree import module_tree

NS = 1e-9  # the host clock's resolution: the slack for float rounding of integer nanoseconds


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Net(nn.Module):
    """Nesting, a ModuleList that never runs itself, a module called three times, a shared one."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(8), Block(8)])
        self.again = nn.Linear(8, 8)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.alias = self.blocks[0].fc  # the same Linear under a second name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        for _ in range(3):
            x = self.again(x)
        x = self.alias(x)
        return self.head(x)


def hooks_of(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def state_of(model: nn.Module) -> dict:
    return {
        "hooks": hooks_of(model),
        "training": [m.training for m in model.modules()],
        "attrs": [sorted(vars(m)) for m in model.modules()],
        "tensors": {k: v.clone() for k, v in model.state_dict().items()},
        "devices": {t.device for t in model.state_dict().values()},
    }


def assert_same_state(before: dict, after: dict) -> None:
    assert after["hooks"] == before["hooks"] == 0
    assert after["training"] == before["training"]
    assert after["attrs"] == before["attrs"]
    assert after["devices"] == before["devices"]
    assert before["tensors"].keys() == after["tensors"].keys()
    for key, value in before["tensors"].items():
        assert torch.equal(value, after["tensors"][key]), key


@pytest.fixture(scope="module")
def net_profile() -> tuple[Net, Profile]:
    torch.manual_seed(0)
    model = Net().eval()
    return model, profile(model, (torch.randn(2, 4),), steps=2)


# -------------------------------------------------------------------------------- replay


def test_replay_pairs_nested_calls_exactly() -> None:
    names = ["", "a", "a.b"]
    # root [0, 100], a [10, 60] with a.b [20, 30] and a.b [35, 50], a again [70, 90]
    events = [(0, 0), (1, 10), (2, 20), (~2, 30), (2, 35), (~2, 50), (~1, 60), (1, 70), (~1, 90), (~0, 100)]
    record = replay(names, events, [float(t) for _, t in events])
    assert record is not None
    assert record.latency == 100
    assert record.modules == {"": (100, 1), "a": (70, 2), "a.b": (25, 2)}
    assert [(iv.module, iv.start, iv.depth) for iv in record.timeline] == [
        ("", 0, 0), ("a", 10, 1), ("a.b", 20, 2), ("a.b", 35, 2), ("a", 70, 1),
    ]


def test_replay_drops_a_call_that_raised_inside_a_caught_exception() -> None:
    # a.b entered at 20 and never returned (its caller caught the error); a returned at 60
    events = [(0, 0), (1, 10), (2, 20), (~1, 60), (~0, 100)]
    record = replay(["", "a", "a.b"], events, [float(t) for _, t in events])
    assert record.modules == {"": (100, 1), "a": (50, 1)}


def test_replay_without_the_root_returning_is_no_record() -> None:
    events = [(0, 0), (1, 10), (~1, 20)]
    assert replay(["", "a"], events, [float(t) for _, t in events]) is None


def test_mean_per_step_averages_summed_calls() -> None:
    first = StepRecord(10.0, {"": (10.0, 1), "a": (4.0, 2)}, [])
    second = StepRecord(20.0, {"": (20.0, 1), "a": (6.0, 2), "b": (2.0, 1)}, [])
    assert mean_per_step([first, second]) == {"": (15.0, 1), "a": (5.0, 2), "b": (1.0, 0)}


# ---------------------------------------------------------------------------------- join


def _stats(name: str, depth: int, macs: int, children: list[str], calls: int = 1) -> ModuleStats:
    return ModuleStats(name=name, type="T", depth=depth, params=0, macs=macs, flops=2 * macs, self_macs=0,
                       self_flops=0, calls=calls, children=children)


def hand_estimate() -> Estimate:
    modules = {
        "": _stats("", 0, 30, ["list", "fc"]),
        "list": _stats("list", 1, 20, ["list.0", "list.1"], calls=0),
        "list.0": _stats("list.0", 2, 10, []),
        "list.1": _stats("list.1", 2, 10, []),
        "fc": _stats("fc", 1, 10, []),
    }
    return Estimate(model_type="M", method="export", conventions="deepspeed", total_macs=30, total_flops=60,
                    total_params=0, modules=modules, nodes=[], by_op={}, by_rule={}, unknown=[],
                    tree=module_tree(modules))


def hand_measurements() -> Measurements:
    return Measurements(device="cpu", device_name="cpu", timer="perf_counter", warm_up=0, steps=1,
                        fwd_latency=1.0, fwd_latency_min=1.0, fwd_latency_median=1.0, fwd_latency_max=1.0)


def test_join_fills_copies_and_sums_containers() -> None:
    est = hand_estimate()
    latencies = {"": (1.0, 1), "list.0": (0.25, 1), "list.1": (0.5, 2), "fc": (0.125, 1), "extra": (0.1, 1)}
    result = join(est, latencies, hand_measurements())
    assert isinstance(result, Profile)
    assert result.modules["list"].latency == 0.75 and result.modules["list"].latency_calls == 0
    assert (result.modules["list.1"].latency, result.modules["list.1"].latency_calls) == (0.5, 2)
    assert result.modules["fc"].achieved_flops == 20 / 0.125
    assert result.tree.nodes["fc"]["stats"] is result.modules["fc"]
    assert result.measurements.unmatched_measured == ("extra",)
    assert result.measurements.unmatched_graph == ()
    # the estimate given is untouched
    assert all(s.latency is None for s in est.modules.values())
    assert est.tree.nodes["fc"]["stats"] is est.modules["fc"]


def test_join_reports_a_graph_module_that_never_ran() -> None:
    est = hand_estimate()
    est.nodes.append(fxflops.NodeCost("mm", "aten.mm.default", "counted", "linear", "fc", "Linear", (), (), 10, 20))
    result = join(est, {"": (1.0, 1), "list.0": (0.25, 1), "list.1": (0.5, 1)}, hand_measurements())
    assert result.measurements.unmatched_graph == ("fc",)
    assert result.measurements.unmatched_measured == ()


def test_profile_carries_every_estimate_field(net_profile: tuple[Net, Profile]) -> None:
    model, result = net_profile
    static = fxflops.estimate(model, (torch.randn(2, 4),))
    for field in dataclasses.fields(Estimate):
        if field.name in ("modules", "tree", "measurements", "nodes", "source"):  # source: each its own capture
            continue
        assert getattr(result, field.name) == getattr(static, field.name), field.name
    assert [dataclasses.replace(s, latency=None, latency_calls=None) for s in result.modules.values()] == list(
        static.modules.values()
    )
    assert list(result.tree.edges) == list(static.tree.edges)


# ---------------------------------------------------------------------------- a real model


def test_latencies_are_positive_and_nest(net_profile: tuple[Net, Profile]) -> None:
    _, result = net_profile
    for name, stats in result.modules.items():
        assert stats.latency is not None and stats.latency > 0, name
        # blocks.0.fc also runs as `alias`, outside blocks.0: its latency sums both calls, so it cannot nest
        children = [result.modules[c].latency for c in stats.children if c != "blocks.0.fc"]
        assert stats.latency + NS >= sum(children), name
    assert result.measurements.fwd_latency > 0
    assert result.measurements.hooked_fwd_latency > 0
    assert result.measurements.fwd_latency_min <= result.measurements.fwd_latency_median
    assert result.measurements.fwd_latency_median <= result.measurements.fwd_latency_max


def test_join_covers_every_module_that_ran(net_profile: tuple[Net, Profile]) -> None:
    model, result = net_profile
    assert set(result.modules) == {name for name, _ in model.named_modules()}
    assert result.measurements.unmatched_measured == ()
    assert result.measurements.unmatched_graph == ()
    assert result.measurements.timer == "perf_counter"
    assert result.measurements.steps == 2


def test_repeated_shared_and_container_modules(net_profile: tuple[Net, Profile]) -> None:
    _, result = net_profile
    modules = result.modules
    assert modules["again"].latency_calls == 3
    # Linear(8, 8) on a (2, 8) input: 2 * 8 * 8 = 128 MACs per call
    assert modules["again"].macs == 3 * 128
    # the shared Linear is keyed by its first name and has both calls
    assert "alias" not in modules
    assert modules["blocks.0.fc"].latency_calls == 2
    # the ModuleList never runs itself: its latency is its blocks'
    assert modules["blocks"].latency_calls == 0
    assert modules["blocks"].latency == modules["blocks.0"].latency + modules["blocks.1"].latency


def test_model_unchanged_afterwards_in_training_mode() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    x = torch.randn(4, 4)
    before = state_of(model)
    rng = torch.get_rng_state()
    profile(model, (x,), steps=2)
    assert_same_state(before, state_of(model))  # BatchNorm statistics included
    assert torch.equal(rng, torch.get_rng_state())


class Fails(nn.Module):
    """Raises on its third eager call: the warm-up and the plain forward pass, the hooked one fails."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(x) is torch.Tensor and not x.is_meta:  # an eager call, not the estimate's trace
            Fails.count += 1
            if Fails.count == 3:
                raise ValueError("boom")
        return self.bn(self.fc(x))


def test_model_unchanged_after_an_exception_inside_forward() -> None:
    Fails.count = 0
    model = nn.Sequential(nn.ReLU(), Fails()).train()
    before = state_of(model)
    with pytest.raises(ValueError, match="boom"):
        profile(model, (torch.randn(3, 4),), warm_up=1, steps=2)
    assert Fails.count == 3
    assert_same_state(before, state_of(model))


def test_timer_removes_hooks_and_records_nothing_when_forward_raises() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(3, 3))  # the second layer rejects the shape
    timer = ModuleTimer(model, CpuClock())
    with pytest.raises(RuntimeError), timer:
        assert hooks_of(model) > 0
        model(torch.randn(1, 2))
    assert hooks_of(model) == 0
    assert timer.records == []
    with timer:  # the timer still works after the failed step
        model[0](torch.randn(1, 2))
        nn.Sequential(model[0])(torch.randn(1, 2))
    assert timer.records == []  # no call of the root itself


def test_timer_that_cannot_hook_a_module_leaves_no_hooks() -> None:
    model = nn.Sequential(nn.Linear(2, 2), torch.jit.script(nn.Linear(2, 2)))  # ScriptModules refuse hooks
    with pytest.raises(RuntimeError, match="ScriptModule"):
        ModuleTimer(model, CpuClock()).attach()
    assert hooks_of(model) == 0


def test_phase_timer_times_backward_and_optimizer_step() -> None:
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    phases = PhaseTimer(CpuClock()).attach()
    try:
        out = model(torch.randn(2, 3))
        phases.watch(out)
        out.sum().backward()
        opt.step()
    finally:
        phases.detach()
    assert len(phases.bwd) == 1 and phases.bwd[0] > 0
    assert len(phases.step) == 1 and phases.step[0] > 0
    assert not _global_optimizer_pre_hooks and not _global_optimizer_post_hooks
    assert not out._backward_hooks


def test_cpu_utilization_needs_a_user_peak(net_profile: tuple[Net, Profile]) -> None:
    model, without = net_profile
    assert without.measurements.peak_flops is None and without.utilization is None
    with_peak = profile(model, (torch.randn(2, 4),), steps=1, peak_flops=1e12)
    assert with_peak.measurements.peak_flops_source == "user"
    assert with_peak.utilization == with_peak.total_flops / with_peak.measurements.fwd_latency / 1e12


def test_meta_model_is_refused() -> None:
    with pytest.raises(ValueError, match="meta"):
        profile(nn.Linear(2, 2, device="meta"), (torch.randn(1, 2),))


def test_signature_sees_shapes_inside_opaque_objects() -> None:
    class Cache:
        def __init__(self, n: int) -> None:
            self.layers = [torch.zeros(1, n)]

    assert signature(((torch.zeros(2, 3),), {"c": Cache(4)})) == signature(((torch.ones(2, 3),), {"c": Cache(4)}))
    assert signature(((torch.zeros(2, 3),), {"c": Cache(4)})) != signature(((torch.zeros(2, 3),), {"c": Cache(5)}))
    assert signature(((), {"use_cache": True})) != signature(((), {"use_cache": False}))


# ------------------------------------------------------------------------- report outputs


def test_profile_prints_and_exports_latency(net_profile: tuple[Net, Profile]) -> None:
    _, result = net_profile
    text = result.print(as_string=True)
    assert "fwd latency:" in text and "% latency" in text
    assert "fwd latency with per-module hooks:" in text  # what the hooks cost
    data = json.loads(result.to_json())
    root = next(m for m in data["modules"] if m["name"] == "")
    assert root["latency"] == result.root.latency
    assert "latency" in result.to_csv().splitlines()[0]


def test_a_gpu_profile_reports_the_hooks_cost_on_the_host_not_as_a_latency_ratio(
        net_profile: tuple[Net, Profile]) -> None:
    # on a GPU the hooked pass is device time (the host queued ahead) and the plain one host-paced: their
    # ratio (0.78x for GPT-2 on an H200) was printed as the hooks' cost; the host's launch times are that cost
    _, result = net_profile
    m = dataclasses.replace(result.measurements, fwd_latency=14e-3, hooked_fwd_latency=11e-3, extra={
        **result.measurements.extra, "module_latency": "device time, the host queued ahead",
        "host_launch_plain": 8e-3, "host_launch_hooked": 12e-3})
    text = dataclasses.replace(result, measurements=m).print(as_string=True)
    assert "(0.79x)" not in text
    assert "fwd latency with per-module hooks (device time, host queued ahead):" in text
    assert "host time to launch a fwd, plain / with per-module hooks:" in text and "8 ms / 12 ms (1.50x)" in text
    # on a CPU nothing is queued ahead: no such keys, the ratio as before
    assert not {"module_latency", "host_launch_plain", "host_launch_hooked"} & set(result.measurements.extra)
    assert f"({result.measurements.hook_overhead:.2f}x)" in result.print(as_string=True)


def test_the_sleep_ahead_of_a_hooked_pass_stays_bounded_when_the_host_waits_on_the_device() -> None:
    # QueueAhead's arithmetic (the sleep itself needs a GPU). A forward with a sync inside, or one launching more
    # than the stream's queue holds, keeps the host waiting through the sleep: read as launch time, that wait
    # doubled the next sleep each step (10 ms plain, 8 ms of device work: 61, 139, 295, 500, 500... ms)
    from fxflops.timing.clocks import QueueAhead

    plain, device_part = 0.010, 0.008
    sleep = QueueAhead.sleep_for(plain)  # before any hooked pass: 3x the plain launch, twice, plus the margin
    assert sleep == pytest.approx(2 * 3 * plain + QueueAhead.MARGIN)
    for _ in range(10):
        sleep = QueueAhead.sleep_for(plain, hooked_host=sleep + device_part)  # the host waited out the sleep
    assert sleep == pytest.approx(2 * 3 * plain + QueueAhead.MARGIN)
    assert QueueAhead.sleep_for(plain, hooked_host=0.016) == pytest.approx(2 * 0.016 + QueueAhead.MARGIN)
    assert QueueAhead.sleep_for(1.0) == QueueAhead.MAX_SECONDS


def test_chrome_trace_nests_module_calls(net_profile: tuple[Net, Profile], tmp_path) -> None:
    _, result = net_profile
    trace = trace_events(result)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    # one event per call: root, stem, 2 blocks of (block, fc, act), 3 x again, alias, head of 2 + itself
    assert len(spans) == 1 + 1 + 2 * 3 + 3 + 1 + 3
    root = spans[0]
    assert root["args"]["module"] == ROOT_LABEL
    for span in spans[1:]:
        assert root["ts"] <= span["ts"] and span["ts"] + span["dur"] <= root["ts"] + root["dur"] + 1e-3
    path = tmp_path / "trace.json"
    write_chrome_trace(result, path)
    assert json.loads(path.read_text())["traceEvents"] == json.loads(json.dumps(trace))["traceEvents"]
    result.to_chrome_trace(tmp_path / "same.json")
    assert (tmp_path / "same.json").read_text() == path.read_text()


def test_chrome_trace_needs_a_measured_profile() -> None:
    with pytest.raises(ValueError, match="timeline"):
        trace_events(hand_estimate())


# -------------------------------------------------------------------------------- peaks


@pytest.mark.parametrize(
    ("name", "dtype", "tf32", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989.4e12),
        ("NVIDIA H100 PCIe", torch.float16, False, 756e12),
        ("NVIDIA H100 NVL", torch.bfloat16, False, 835.5e12),
        ("NVIDIA H200", torch.bfloat16, False, 989.4e12),
        ("NVIDIA A100-SXM4-80GB", torch.float32, True, 156e12),
        ("NVIDIA A100-SXM4-80GB", torch.float32, False, 19.5e12),
        ("Tesla V100-SXM2-16GB", torch.float16, False, 125e12),
        ("Tesla V100-SXM2-16GB", torch.float32, True, 15.7e12),  # no tf32 before Ampere
        ("Tesla V100-SXM2-16GB", torch.bfloat16, False, None),
        ("NVIDIA L4", torch.bfloat16, False, 121e12),
        ("NVIDIA L40S", torch.bfloat16, False, 362.05e12),
        ("NVIDIA GeForce RTX 4090", torch.float16, False, 165.2e12),
        ("Some Other GPU", torch.float16, False, None),
    ],
)
def test_peak_table(name: str, dtype: torch.dtype, tf32: bool, expected: float | None) -> None:
    found = peaks.peak_for(name, dtype, tf32=tf32)
    if expected is None:
        assert found is None
    else:
        assert found[0] == pytest.approx(expected)
        assert found[1].startswith("table: ")
