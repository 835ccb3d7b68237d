"""Issue 35 item 9: a model a real kernel refuses is counted with a caution naming the op and the module.

The oracle is the real forward on CPU: a caution exactly where it raises, none where it runs."""

from __future__ import annotations

import warnings

import pytest
import torch

import fxflops


class Call(torch.nn.Module):
    """A module whose forward is `body(self, x)`, holding the given submodules."""

    def __init__(self, body, **modules: torch.nn.Module) -> None:
        super().__init__()
        self.body = body
        for name, module in modules.items():
            self.add_module(name, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self, x)


def _expanded_add(self, x):
    y = x[:, :1].expand(2, 4)
    y.add_(1)
    return y


def _long_mul(self, x):
    y = x.long()
    y.mul_(0.5)
    return y


CASES = {
    # refused by real kernels
    "bf16 linear, f32 input": (lambda: Call(lambda s, x: s.l(x), l=torch.nn.Linear(4, 3).to(torch.bfloat16)),
                               torch.float32, "aten.linear in module 'l' (Linear)"),
    "f64 input, f32 layer norm": (lambda: Call(lambda s, x: s.n(x), n=torch.nn.LayerNorm(4)), torch.float64,
                                  "aten.native_layer_norm in module 'n' (LayerNorm)"),
    "in-place on expanded": (lambda: Call(_expanded_add), torch.float32, "aten.add_ in the model (Call)"),
    "long.mul_(0.5)": (lambda: Call(_long_mul), torch.float32, "aten.mul_ in the model (Call)"),
    "bf16 conv (no bias), f32 input": (lambda: Call(lambda s, x: s.c(x.view(1, 1, 2, 4)), c=torch.nn.Conv2d(1, 2, 1, bias=False).to(torch.bfloat16)),
                             torch.float32, "aten.conv2d in module 'c' (Conv2d)"),
    "matmul f32 x f64": (lambda: Call(lambda s, x: x @ x.double().t()), torch.float32, "aten.matmul in the model (Call)"),
    "f32 input, bf16 group norm": (lambda: Call(lambda s, x: s.g(x), g=torch.nn.GroupNorm(2, 4).to(torch.bfloat16)),
                                   torch.float32, "aten.native_group_norm in module 'g' (GroupNorm)"),
    # accepted by real kernels: no caution
    "bf16 input, f32 layer norm": (lambda: Call(lambda s, x: s.n(x), n=torch.nn.LayerNorm(4)), torch.bfloat16, None),
    "relu_ in place": (lambda: Call(lambda s, x: s.r(x * 2), r=torch.nn.ReLU(inplace=True)), torch.float32, None),
    "masked_fill_ on expanded": (lambda: Call(lambda s, x: x[:, :1].expand(2, 4).masked_fill_(x > 0, 1.0)),
                                 torch.float32, None),
    "long.add_(1)": (lambda: Call(lambda s, x: x.long().add_(1)), torch.float32, None),
    "float.mul_(long)": (lambda: Call(lambda s, x: x.clone().mul_(x.long())), torch.float32, None),
    "bf16 linear, bf16 input": (lambda: Call(lambda s, x: s.l(x), l=torch.nn.Linear(4, 3).to(torch.bfloat16)),
                                torch.bfloat16, None),
}


def _cautions(model: torch.nn.Module, x: torch.Tensor) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(model, (x,)).cautions


@pytest.mark.parametrize("case", list(CASES))
def test_a_caution_exactly_where_a_real_forward_raises(case):
    build, dtype, named = CASES[case]
    x = torch.randn(2, 4).to(dtype)
    try:
        build()(x.clone())
        raises = False
    except RuntimeError:
        raises = True
    assert raises == (named is not None), "the oracle disagrees with the case's expectation"
    cautions = _cautions(build(), x)
    if named is None:
        assert cautions == []
    else:
        assert len(cautions) == 1 and cautions[0].startswith(named), cautions
        assert "a real forward raises" in cautions[0]


def test_the_caution_is_a_warning_naming_dtypes_and_the_users_line():
    model = CASES["bf16 linear, f32 input"][0]()
    with pytest.warns(fxflops.CautionWarning) as caught:
        fxflops.estimate(model, (torch.randn(2, 4),))
    message = str(caught[0].message)
    assert "input float32, weight bfloat16, bias bfloat16" in message
    assert f"{__file__}:" in message  # the line of the forward that called the Linear


def test_one_caution_for_many_layers():
    layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4).to(torch.bfloat16) for _ in range(5)])
    model = Call(lambda s, x: s.layers(x), layers=layers)
    cautions = _cautions(model, torch.randn(2, 4))
    # the first layer gets a float32 input; its bfloat16 output feeds the others, which then run
    assert len(cautions) == 1 and cautions[0].startswith("aten.linear in module 'layers.0' (Linear)")
    many = Call(lambda s, x: sum(layer(x) for layer in s.layers), layers=layers)
    (caution,) = _cautions(many, torch.randn(2, 4))
    assert "layers.0" in caution and "layers.2" in caution and "and 2 more places" in caution and "(5 calls)" in caution


class AutocastInside(torch.nn.Module):
    """Mixed dtypes a real forward accepts: autocast casts each op's operands to one dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 3).to(torch.bfloat16)
        self.c = torch.nn.Linear(3, 2)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.c(self.b(self.a(x)))  # c: a bfloat16 input into float32 weights, cast by autocast


def test_no_caution_where_autocast_casts_the_operands():
    x = torch.randn(2, 4)
    AutocastInside()(x)  # the oracle: it runs
    assert _cautions(AutocastInside(), x) == []
    outside = Call(lambda s, x: s.l(x), l=torch.nn.Linear(4, 3).to(torch.bfloat16))
    for method in ("eager", "export"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outside(x)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert fxflops.estimate(outside, (x,), method=method).cautions == [], method


def test_the_backward_does_not_repeat_the_forwards_caution():
    model = CASES["bf16 linear, f32 input"][0]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cautions = fxflops.estimate(model, (torch.randn(2, 4, requires_grad=True),), backward=True).cautions
    assert len(cautions) == 1 and cautions[0].startswith("aten.linear in module 'l' (Linear)")
