"""The mode a model was counted in, said where it changes the numbers (issue 21, item 6), and torch's
logging kept quiet while fxflops captures (item 7)."""

from __future__ import annotations

import json
import math
import logging
import warnings

import pytest
import torch
from torch import nn

import fxflops
from tests.test_cli import run_main


class BnDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.bn(x))


def test_a_training_mode_count_says_so_where_it_differs():
    x = torch.zeros(8, 4)
    # by hand: eval batch norm 2 per element (affine), dropout nothing; training 5 per element, dropout
    # one per element (mask) and per element of its output (the DeepSpeed convention the rules follow)
    with pytest.warns(fxflops.CautionWarning, match=r"training mode, where its BatchNorm1d, Dropout modules "
                                                    r"count differently than in eval .*model\.eval\(\)"):
        trained = fxflops.estimate(BnDrop(), (x,))
    assert trained.training is True and trained.total_flops > 2 * 32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluated = fxflops.estimate(BnDrop().eval(), (x,))
        assert evaluated.cautions == [] and evaluated.total_flops == 2 * 32 and evaluated.training is False
        # counting a training step: training mode is what was asked for
        stepped = fxflops.estimate(BnDrop(), (torch.randn(8, 4),), backward=True)
        assert stepped.cautions == []
        # nothing whose count depends on the mode: no caution
        assert fxflops.estimate(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)), (x,)).cautions == []


def test_the_api_report_and_json_state_the_mode(capsys):
    from fxflops.report.machine import to_dict

    with pytest.warns(fxflops.CautionWarning):
        result = fxflops.estimate(BnDrop(), (torch.zeros(8, 4),))
    result.print()
    out = capsys.readouterr().out
    assert "mode:" in out and "train (dropout and batch statistics counted)" in out
    assert "caution:" in out and "training mode" in out
    data = to_dict(result)
    assert data["training"] is True and any("training mode" in c for c in data["cautions"])
    from fxflops.report.html import to_html

    page = to_html(result)
    assert "model in train mode" in page and "training mode" in page  # the header and the cautions section


def test_readme_api_example_counts_what_the_cli_counts(capsys):
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        model = torchvision.models.resnet50()
    with pytest.warns(fxflops.CautionWarning, match="training mode"):
        trained = fxflops.estimate(model, input_shape=(1, 3, 224, 224))
    api = fxflops.estimate(model.eval(), input_shape=(1, 3, 224, 224))
    code, out, _ = run_main(capsys, "torchvision:resnet50", "--format", "json")
    cli = json.loads(out)
    # the README's numbers: eval 8,216,628,712 FLOPs (train: 8,249,970,664, batch statistics)
    assert (api.total_macs, api.total_flops, api.total_params) == (4_089_184_256, 8_216_628_712, 25_557_032)
    assert cli["totals"]["flops"] == api.total_flops and cli["training"] is False
    assert trained.total_flops == 8_249_970_664
    # the difference: batch norm in training costs 5 per element of its input, in eval 2
    bn_inputs = sum(math.prod(n.input_shapes[0]) for n in api.nodes if n.rule == "batch_norm")
    assert trained.total_flops - api.total_flops == 3 * bn_inputs


# ------------------------------------------------------------------ torch's logging (item 7)

MOE_FACTORY = """
import torch
import transformers


def build(batch=1):
    config = transformers.MixtralConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=100)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config).eval()  # float32: _grouped_mm has no fp32 meta kernel
    return model, (torch.zeros(batch, 16, dtype=torch.long, device="meta"),)
"""


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _torch_levels() -> dict[str, int]:
    return {name: logger.level for name, logger in logging.Logger.manager.loggerDict.items()
            if (name == "torch" or name.startswith("torch.")) and isinstance(logger, logging.Logger)}


def test_a_float32_moe_captures_without_torch_tracebacks(tmp_path, capsys):
    pytest.importorskip("transformers")
    namespace: dict = {}
    exec(MOE_FACTORY, namespace)
    model, args = namespace["build"]()
    fake_tensor = logging.getLogger("torch._subclasses.fake_tensor")
    records = Records()
    fake_tensor.addHandler(records)
    levels = _torch_levels()
    try:
        result = fxflops.estimate(model, args)  # the API
    finally:
        fake_tensor.removeHandler(records)
    assert result.total_macs > 0 and not result.unknown
    assert records.records == []  # was one traceback per _grouped_mm call ("failed while attempting to run meta")
    assert capsys.readouterr().err == ""
    assert _torch_levels() == levels  # every level as it was
    # the CLI: nothing on stderr but fxflops' own lines
    (tmp_path / "moe.py").write_text(MOE_FACTORY)
    code, out, err = run_main(capsys, f"{tmp_path / 'moe.py'}:build")
    assert code == 0 and "MixtralForCausalLM" in out
    assert "fake_tensor" not in err and "Traceback" not in err


def test_a_failed_capture_leaks_no_torch_traceback_and_restores_levels(capsys):
    class Expands(nn.Module):
        def forward(self, x):
            return torch.zeros(1, 4).expand(1, x.shape[1])  # fails on fake tensors past 4 columns

    levels = _torch_levels()
    with pytest.raises(fxflops.CaptureError):
        fxflops.estimate(Expands(), (torch.zeros(1, 8),), method="eager")
    assert "fake_tensor.py" not in capsys.readouterr().err
    assert _torch_levels() == levels


def test_the_structured_trace_keeps_its_level_while_the_rest_of_torch_is_quiet():
    """torch's structured trace is its own logger (TORCH_TRACE files, never printed): raised with the others it
    wrote nothing, but torch built each record it would have written (a new symbol's, a guard's, with their
    stacks) while its handler stayed, which without TORCH_TRACE takes itself off at its first record."""
    from torch._logging._internal import trace_log

    from fxflops.capture.quiet import STRUCTURED_TRACE, torch_logging_quiet

    assert trace_log.name == STRUCTURED_TRACE  # the logger torch's trace_structured writes to
    # torch's own handler without a directory (TORCH_TRACE unset) alone: pytest's capture handlers, which a
    # run under pytest adds, are handlers that take the records (the trace is raised with them)
    handlers = trace_log.handlers
    trace_log.handlers = [handler for handler in handlers if getattr(handler, "root_dir", True) is None]
    try:
        before, levels = trace_log.level, _torch_levels()
        with torch_logging_quiet():
            assert trace_log.level == before
            assert logging.getLogger("torch").level > logging.CRITICAL
            assert all(level > logging.CRITICAL for name, level in _torch_levels().items()
                       if name != STRUCTURED_TRACE and levels[name] != logging.NOTSET)
        assert _torch_levels() == levels
    finally:
        trace_log.handlers = handlers


def test_a_capture_writes_nothing_into_the_users_structured_trace(tmp_path):
    """Where the structured trace writes (TORCH_TRACE names a directory: torch's handler with that directory), a
    sweep's symbolic capture adds none of its fake-tensor records (new symbols, guards) to the user's trace
    files, as before the trace was left at its level; its level is restored after."""
    from torch._logging._internal import LazyTraceHandler, trace_log

    from fxflops.sweeps import sweep

    handler = LazyTraceHandler(str(tmp_path))
    level = trace_log.level
    trace_log.addHandler(handler)
    trace_log.setLevel(logging.DEBUG)  # as torch sets it where TORCH_TRACE is given
    try:
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
        swept = sweep(model, (torch.zeros(3, 5, 4),), dims={"batch": 0, "seq": 1})
        assert swept.at(batch=2, seq=7).total_macs == 2 * 7 * (4 * 6 + 6 * 2)
        assert trace_log.level == logging.DEBUG
    finally:
        trace_log.removeHandler(handler)
        handler.close()
        trace_log.setLevel(level)
    assert [path.name for path in tmp_path.iterdir() if path.stat().st_size] == []
