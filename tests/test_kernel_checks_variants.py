"""Issue 35 item 9, variants: index_add / index_copy read a source of another dtype than self, which
FakeTensorMode accepts and real kernels refuse: cautioned, naming the op; the same dtypes are not."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxflops


class IndexWrite(nn.Module):
    def __init__(self, write) -> None:
        super().__init__()
        self.write = write

    def forward(self, x, index, source):
        return self.write(x, index, source)


WRITES = {
    "aten.index_add_": lambda x, i, s: x.clone().index_add_(0, i, s),
    "aten.index_add": lambda x, i, s: x.index_add(0, i, s),
    "aten.index_copy_": lambda x, i, s: x.clone().index_copy_(0, i, s),
}


def _cautions(model: nn.Module, args: tuple) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxflops.estimate(model, args)
    return [str(w.message) for w in caught if issubclass(w.category, fxflops.CautionWarning)]


@pytest.mark.parametrize("op", list(WRITES))
def test_an_index_write_of_another_dtype_is_cautioned_as_real_kernels_refuse_it(op):
    model = IndexWrite(WRITES[op])
    args = (torch.zeros(3, 4), torch.tensor([0, 2]), torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="same (dtype|scalar type)"):  # the oracle: a real run
        model(*args)
    cautions = _cautions(model, args)
    assert len(cautions) == 1 and cautions[0].startswith(op) and "float64" in cautions[0]
    same = (args[0], args[1], args[2].float())
    model(*same)
    assert _cautions(model, same) == []
