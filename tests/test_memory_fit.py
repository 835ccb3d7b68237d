"""The largest micro-batch that fits: from three captures and the check at the answer and the answer + 1,
never by trying each size; hand counts and independent estimates as the oracle."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import fxflops
from fxflops.memory import Allowance, MemoryOptions
from fxflops.memory.fit import SAMPLES, inputs_at_batch, largest_micro_batch

PARAMS = 2 * (64 * 64 + 64) * 4  # two Linear(64, 64), float32
PER_SAMPLE = 64 * 4  # one (1, 64) activation


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def measurer(model, options, **step):
    tried = []

    def measure(batch):
        tried.append(batch)
        args, kwargs = inputs_at_batch((torch.randn(8, 64),), {}, batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fxflops.estimate(model, args, kwargs, memory=options, **step).memory
    return measure, tried


def test_forward_peak_by_hand():
    # the forward's peak (relu, or linear 2): the parameters, the input, two (b, 64) activations; no allowance
    capacity = PARAMS + 3 * PER_SAMPLE * 37 + 100
    options = MemoryOptions(allowance=Allowance(block_bytes=1, context_bytes=0), device_bytes=capacity)
    measure, tried = measurer(mlp(), options)
    found = largest_micro_batch(measure, capacity)
    assert found.largest == (capacity - PARAMS) // (3 * PER_SAMPLE) == 37
    assert found.device_bytes[37] == PARAMS + 3 * PER_SAMPLE * 37 and found.device_bytes[38] > capacity
    assert tried == [*SAMPLES, 37, 38]  # three captures, then the answer and the next: not each size
    assert "affine" in found.how


def test_training_step_answer_holds_at_it_and_fails_one_above():
    capacity = 2 << 20
    options = MemoryOptions(device_bytes=capacity, allowance=Allowance(context_bytes=1 << 20))
    measure, tried = measurer(mlp(), options, backward=True, optimizer="adamw")
    found = largest_micro_batch(measure, capacity)
    # three captures, then a few near the guess (the block rounding is known to within a block per storage)
    assert tried[:3] == list(SAMPLES) and len(tried) <= 3 + 4
    assert {found.largest, found.largest + 1} <= set(tried)
    model = mlp()  # the oracle: estimates of their own at the answer and one above
    at, above = (fxflops.estimate(model, (torch.randn(batch, 64),), backward=True, optimizer="adamw",
                                  memory=options).memory.device_bytes for batch in (found.largest, found.largest + 1))
    assert at <= capacity < above
    assert found.device_bytes[found.largest] == at


def test_nothing_fits():
    options = MemoryOptions(device_bytes=1000)
    measure, _ = measurer(mlp(), options)
    found = largest_micro_batch(measure, 1000)
    assert found.largest == 0 and "none" in found.line("tiny")


def test_inputs_at_batch_keep_values_of_ids_and_leave_other_tensors():
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    image = torch.randn(2, 3, 8, 8)
    positions = torch.arange(3).unsqueeze(0)  # [1, seq]: no batch axis of the example's size
    (new_ids, new_image, new_positions), kwargs = inputs_at_batch((ids, image, positions), {}, 5)
    assert new_ids.tolist() == [[1, 2, 3], [4, 5, 6], [1, 2, 3], [4, 5, 6], [1, 2, 3]]
    assert new_image.shape == (5, 3, 8, 8) and new_image.device.type == "meta"
    assert new_positions is positions and kwargs == {}


def test_cli_train_device_says_whether_the_step_fits_and_the_largest_micro_batch(tmp_path, capsys):
    from fxflops.cli import main as cli

    source = tmp_path / "wide.py"
    source.write_text("import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), "
                      "torch.nn.ReLU(), torch.nn.Linear(1024, 1024))\n")
    assert cli.main([f"{source}:build", "--input-shape", "8,1024", "--train", "--optimizer", "adamw",
                     "--device", "H100 SXM", "--no-detailed"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("training step (forward + backward + adamw) on H100 SXM (80.00 GiB): fits,")
    largest = int(re.search(r"largest micro-batch that fits: ([\d,]+)$", line).group(1).replace(",", ""))
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
    options = MemoryOptions(device="H100 SXM")
    at, above = (fxflops.estimate(model, (torch.empty(batch, 1024, device="meta"),), backward=True,
                                  optimizer="adamw", memory=options).memory for batch in (largest, largest + 1))
    assert at.fits and not above.fits


def test_cli_device_without_a_memory_size_prints_no_fit_line(capsys):
    from fxflops.cli import main as cli

    assert cli.main(["lenet5", "--train", "--device", "V100 PCIe", "--no-detailed"]) == 0
    assert "training step" not in capsys.readouterr().out
