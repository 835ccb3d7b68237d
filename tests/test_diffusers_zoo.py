"""diffusers' model classes at small configs (tests/diffusers_zoo.py): every one counted on fake tensors without
a real run, equal to FlopCounterMode (torch preset, MATH SDPA, the MHA fast path off) on a real run of the same model.

Models whose forward reads values the inputs determine (a mask's True count, grid sizes read with .tolist(),
a size lifted from torch.tensor(shape)) are among them: their values come from the example inputs
(capture.input_values); HiDream's MoE reads routed counts with .numpy(), counted under balanced routing (its
experts are alike, so any routing counts the same). `method="eager"` is asked for: no model runs for real."""

from __future__ import annotations

import warnings

import pytest
import torch

import fxflops
from tests import diffusers_zoo as zoo
from tests.oracle import _no_fused_attention, oracle_flex_flops, oracle_flops

pytest.importorskip("diffusers")

# entries without an oracle to compare with, each with the reason
NO_ORACLE = {
    "AutoencoderRAE": "its test config names an encoder ('tiny_test') that diffusers 0.42.1 does not have",
    # the real CPU run fails in torch 2.14 (view_as_complex on a strided rotary table: "Tensor must have a
    # last dimension of size 2"), so FlopCounterMode has nothing to count; fxflops' count is checked elsewhere
    "NucleusMoEImageTransformer2DModel": "the real run fails on the CPU (view_as_complex)",
    "QwenImageTransformer2DModel": "the real run fails on the CPU (view_as_complex)",
}
# entries whose real run takes too long for the suite (a minute or more on 2 cores): benchmarks/diffusers_zoo.py
# compares them
SLOW = {"AutoencoderVidTok", "UNetSpatioTemporalConditionModel"}
# flex_attention callers: FlopCounterMode plus its own flex formulas (tests/oracle.py)
FLEX = {"AnyFlowFARTransformer3DModel", "LTX2VideoDiffusionDecoderModel"}
NAMES = [name for name in zoo.ENTRIES if name not in NO_ORACLE and name not in SLOW]


class _Keywords(torch.nn.Module):
    """A model called with keyword arguments, for oracle_flex_flops (which passes positional ones)."""

    def __init__(self, model: torch.nn.Module, kwargs: dict) -> None:
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self) -> object:
        return self.model(**self.kwargs)


def _oracle(name: str, model: torch.nn.Module) -> int:
    if name in FLEX:  # (their other attention is SDPA: the MATH kernel, which FlopCounterMode sees)
        with _no_fused_attention():
            return oracle_flex_flops(_Keywords(model, zoo.inputs(name)))[0]
    return oracle_flops(model, (), zoo.inputs(name))


@pytest.mark.parametrize("name", NAMES)
def test_a_diffusers_model_is_counted_without_a_real_run_equal_to_flop_counter_mode(name):
    model = zoo.build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fxflops.estimate(model, kwargs=zoo.inputs(name), conventions="torch", method="eager")
        expected = _oracle(name, model)
    assert result.method == "eager"
    assert result.total_flops == expected
