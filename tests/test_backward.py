"""Training FLOPs: the backward autograd runs, counted op by op on fake tensors.

Under the torch preset every total equals FlopCounterMode counting a real forward and
`loss.backward()` (SDPA through the math backend); under the deepspeed preset the counts are
derived by hand below, one op at a time.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torchvision
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import fxflops
from fxflops.results import BACKWARD, FORWARD, RECOMPUTE
from tests.models import SharedTwice, ValueDependent, tiny_transformers_model
from tests.oracle import oracle_training_flops


def estimate_like_the_oracle(model, args=(), kwargs=None, **options):
    """The torch preset, with SDPA through the math backend as the oracle runs it."""
    with sdpa_kernel(SDPBackend.MATH):
        return fxflops.estimate(model, args, kwargs, conventions="torch", backward=True, **options)


def assert_matches_oracle(model, args=(), kwargs=None, loss=None):
    estimate = estimate_like_the_oracle(model, args, kwargs, loss=loss)
    forward, backward = oracle_training_flops(model, args, kwargs, loss=loss)
    assert (estimate.fwd_flops, estimate.bwd_flops) == (forward, backward)
    assert estimate.total_flops == forward + backward
    assert not estimate.unknown
    return estimate


# ------------------------------------------------------------------------- against the oracle


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "convnext_tiny"])
def test_torchvision_convnets_match_flop_counter_mode(name):
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)()
    assert_matches_oracle(model, (torch.randn(2, 3, 64, 64),))


def test_vision_transformer_matches_flop_counter_mode():
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                                                 hidden_dim=64, mlp_dim=128)
    assert_matches_oracle(model, (torch.randn(2, 3, 32, 32),))


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_transformers_models_match_flop_counter_mode(kind):
    torch.manual_seed(0)
    model, inputs = tiny_transformers_model(kind)
    estimate = assert_matches_oracle(model, kwargs=inputs)
    assert estimate.bwd_fwd_ratio == pytest.approx(2.0, abs=0.05)
    head = "lm_head" if kind != "bert" else "encoder"
    assert estimate.modules[head].bwd_flops > 0


def test_a_loss_function_of_the_output_is_differentiated():
    torch.manual_seed(0)
    model, inputs = tiny_transformers_model("gpt2")
    labels = torch.randint(0, 1000, (2, 16))
    loss = lambda out: nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())  # noqa: E731
    assert_matches_oracle(model, kwargs=inputs, loss=loss)


def test_frozen_parameters_get_no_weight_gradient():
    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for parameter in model.fc.parameters():
        parameter.requires_grad_(True)
    estimate = assert_matches_oracle(model, (torch.randn(2, 3, 64, 64),))
    # only the head trains: nothing upstream of it has a backward
    assert estimate.modules["layer4"].bwd_flops == 0
    assert estimate.modules["fc"].bwd_macs == 2 * 512 * 1000  # grad_weight = g^T x, (1000 x 2) @ (2 x 512)


class LoRA(nn.Module):
    """A frozen linear plus a trainable low-rank update B(A(x))."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def test_a_lora_adapter_costs_what_autograd_runs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32).requires_grad_(False), nn.ReLU(), LoRA(nn.Linear(32, 64)), nn.ReLU(),
                          LoRA(nn.Linear(64, 8)))
    x = torch.randn(4, 32)
    estimate = assert_matches_oracle(model, (x,))
    # by hand, torch preset (matmuls only, 2 FLOPs per MAC). The first linear is frozen and its
    # input needs no grad: no backward. LoRA 2 (64 -> 8, rank 4): up's weight (8x4 <- 8x4 @ 4x4
    # rows), down's weight, the input gradient through base and through the adapter.
    batch = 4
    lora2 = batch * (8 * 4 + 4 * 64 + 64 * 8 + 64 * 4 + 4 * 8)
    # LoRA 1 (32 -> 64): up's weight, the gradient into up (down's weight needs it), down's weight;
    # its own input needs no grad (a frozen linear of an input that needs none)
    lora1 = batch * (64 * 4 + 64 * 4 + 4 * 32)
    assert estimate.bwd_flops == 2 * (lora1 + lora2)
    assert estimate.modules["0"].bwd_flops == 0


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_counts_the_recomputed_forward(reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    x = torch.randn(3, 16, requires_grad=True)
    estimate = assert_matches_oracle(model, (x,))
    recomputed = {node.module for node in estimate.nodes if node.phase == RECOMPUTE and node.flops}
    # the reentrant form reruns the whole block; the other stops once the tensors it needs are back
    assert recomputed == ({"block.0", "block.2"} if reentrant else {"block.0"})
    assert estimate.modules["block"].calls == 1  # a recomputation is not another call
    plain = fxflops.estimate(Checkpointed(reentrant), (x,), conventions="torch", backward=True)
    assert plain.fwd_flops == estimate.fwd_flops


def test_grouped_and_transposed_convolutions_match_flop_counter_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, groups=4), nn.ReLU(), nn.Conv2d(16, 16, 3, groups=16),
                          nn.ConvTranspose2d(16, 8, 3, stride=2, groups=2))
    assert_matches_oracle(model, (torch.randn(2, 8, 12, 12, requires_grad=True),))


def test_grouped_query_attention_with_a_mask_matches_flop_counter_mode():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(32, 32)
            self.kv = nn.Linear(32, 16)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            q = self.q(x).view(2, 6, 4, 8).transpose(1, 2)
            k, v = self.kv(x).view(2, 6, 2, 8).transpose(1, 2).chunk(2, dim=-1)
            return nn.functional.scaled_dot_product_attention(q, k.repeat(1, 1, 1, 2), v.repeat(1, 1, 1, 2),
                                                              attn_mask=mask, enable_gqa=True)

    torch.manual_seed(0)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    assert_matches_oracle(Attention(), (torch.randn(2, 6, 32), mask))


# --------------------------------------------------------------------- by hand, deepspeed preset


def backward_of(model, *args, **options):
    return fxflops.estimate(model, args, backward=True, **options)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("input_grad", [True, False])
def test_linear_backward_by_hand(bias, input_grad):
    x = torch.randn(4, 8, requires_grad=input_grad)
    estimate = backward_of(nn.Linear(8, 16, bias=bias), x)
    # weight gradient g^T x: 16 x 8 outputs, each reducing over the 4 rows; the input gradient
    # g W: 4 x 8 outputs reducing over 16; the bias gradient sums g over the rows (one add each)
    macs = 16 * 8 * 4 + (4 * 8 * 16 if input_grad else 0)
    assert estimate.bwd_macs == macs
    assert estimate.bwd_flops == 2 * macs + (4 * 16 if bias else 0)


@pytest.mark.parametrize("groups, cin, cout", [(1, 4, 8), (2, 4, 8), (4, 4, 4)])  # plain, grouped, depthwise
@pytest.mark.parametrize("input_grad", [True, False])
def test_conv_backward_by_hand(groups, cin, cout, input_grad):
    x = torch.randn(2, cin, 6, 6, requires_grad=input_grad)
    estimate = backward_of(nn.Conv2d(cin, cout, 3, groups=groups), x)
    forward_macs = 2 * cout * 4 * 4 * (cin // groups) * 9  # out numel x (in / groups) x kernel
    # weight gradient: as many MACs as the forward; input gradient (a transposed conv): as many again
    macs = forward_macs * (2 if input_grad else 1)
    assert estimate.fwd_macs == forward_macs
    assert estimate.bwd_macs == macs
    assert estimate.bwd_flops == 2 * macs + 2 * cout * 4 * 4  # + the bias gradient's sum over grad_output


def test_transposed_conv_backward_by_hand():
    x = torch.randn(1, 4, 5, 5, requires_grad=True)
    estimate = backward_of(nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, bias=False), x)
    forward_macs = 4 * 5 * 5 * (6 // 2) * 9  # input numel x (out / groups) x kernel
    assert estimate.fwd_macs == forward_macs
    assert estimate.bwd_macs == 2 * forward_macs
    assert estimate.bwd_flops == 4 * forward_macs


class MatmulWith(nn.Module):
    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(*shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_matmul_with_broadcasting_backward_by_hand():
    x = torch.randn(2, 3, 4, 5, requires_grad=True)
    shared = backward_of(MatmulWith(5, 6), x)
    # x's gradient g W^T and W's gradient x^T g: each 2*3*4 x 6 x 5 MACs, as the forward
    assert shared.fwd_macs == 2 * 3 * 4 * 6 * 5
    assert shared.bwd_macs == 2 * shared.fwd_macs
    batched = backward_of(MatmulWith(3, 5, 6), x)
    # the weight broadcast over the leading 2: its gradient is summed back over it (one add per element)
    assert batched.bwd_macs == 2 * batched.fwd_macs
    assert batched.bwd_flops == 4 * batched.fwd_macs + 2 * 3 * 5 * 6


def test_fused_attention_backward_by_hand():
    class Attention(nn.Module):
        def forward(self, q, k, v):
            return nn.functional.scaled_dot_product_attention(q, k, v)

    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        estimate = backward_of(Attention(), q, k, v)
    # forward Q K^T and P V: 2 x 4 queries x 4 keys x 8 each; the flash backward recomputes Q K^T,
    # then forms dV, dP, dQ and dK: five such products, 2.5x the forward
    assert estimate.fwd_macs == 2 * 4 * 4 * (8 + 8)
    assert estimate.bwd_macs == 2 * 4 * 4 * (3 * 8 + 2 * 8)
    assert estimate.bwd_flops == 2 * estimate.bwd_macs
    assert estimate.by_rule["sdpa_backward"].count == 1


def test_layer_norm_softmax_and_elementwise_backward_by_hand():
    x = torch.randn(4, 8, requires_grad=True)
    norm = backward_of(nn.LayerNorm(8), x)
    # input gradient 10 per element (affine), weight gradient 2, bias gradient 1
    assert norm.bwd_flops == 4 * 8 * (10 + 2 + 1)
    assert norm.fwd_flops == 4 * 8 * 5
    softmax = backward_of(nn.Softmax(dim=-1), x)
    assert softmax.bwd_flops == softmax.fwd_flops == 4 * 8  # one per element each way

    class Square(nn.Module):
        def forward(self, x):
            return x * x

    # d(x*x): grad * x for each operand (2 multiplies), then the two gradients of x are added
    assert backward_of(Square(), x).bwd_flops == 3 * 4 * 8


# ----------------------------------------------------------------------------- attribution


def test_backward_ops_belong_to_the_module_whose_forward_they_differentiate():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    estimate = backward_of(model, torch.randn(2, 8))
    backward = [node for node in estimate.nodes if node.phase == BACKWARD]
    mms = [node for node in backward if node.op == "aten.mm.default"]
    assert {node.module for node in mms} == {"0", "2"}
    assert all(node.differentiates for node in mms)
    forward_names = {node.name for node in estimate.nodes if node.phase == FORWARD}
    assert {node.differentiates for node in mms} <= forward_names
    assert estimate.modules["1"].bwd_flops == 2 * 16  # relu's gradient, one per element
    assert estimate.modules[""].bwd_flops == sum(node.flops for node in backward)


def test_a_shared_module_gets_the_backward_of_both_calls():
    torch.manual_seed(0)
    model = SharedTwice()
    x = torch.randn(2, 8)
    estimate = assert_matches_oracle(model, (x,))
    shared = next(name for name, stats in estimate.modules.items() if stats.calls == 2)
    assert estimate.modules[shared].bwd_flops > 0


def test_nothing_trainable_warns_and_counts_no_backward():
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.warns(UserWarning, match="nothing in the output requires grad"):
        estimate = backward_of(model, torch.randn(2, 4))
    assert estimate.bwd_flops == 0 and estimate.backward


def test_the_model_and_its_inputs_are_left_alone():
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    backward_of(model, x)
    assert all(p.grad is None for p in model.parameters()) and x.grad is None
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())


def test_a_model_on_the_meta_device_is_counted_without_weights():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
    estimate = fxflops.estimate(model, input_shape=(8, 1024), backward=True)
    assert estimate.bwd_macs == 2 * estimate.fwd_macs - 8 * 1024 * 4096  # no gradient for the input


def test_backward_needs_a_method_that_records_it():
    with pytest.raises(ValueError, match="'eager', 'trace'"):
        fxflops.estimate(nn.Linear(2, 2), (torch.randn(1, 2),), method="export", backward=True)
    with pytest.raises(ValueError, match="backward=True"):
        fxflops.estimate(nn.Linear(2, 2), (torch.randn(1, 2),), loss=lambda out: out.sum())


# ----------------------------------------------------------------------------- optimizer step


@pytest.mark.parametrize("optimizer, per_param", [
    ("sgd", 2), ("adam", 13), ("adamw", 14),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4), 2 + 3 + 2 + 2),
    (lambda p: torch.optim.Adam(p, weight_decay=0.1, amsgrad=True), 2 + 13 + 1),
    (lambda p: torch.optim.Adam(p, weight_decay=0.1, decoupled_weight_decay=True), 1 + 13),
    (lambda p: type("MyAdamW", (torch.optim.AdamW,), {})(p), 14),
])
def test_optimizer_step_flops_per_trainable_parameter(optimizer, per_param):
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model[1].requires_grad_(False)
    chosen = optimizer if isinstance(optimizer, str) else optimizer(model.parameters())
    estimate = fxflops.estimate(model, (torch.randn(1, 4),), backward=True, optimizer=chosen)
    trainable = 4 * 8 + 8
    assert (estimate.optimizer.params, estimate.optimizer.flops_per_param) == (trainable, per_param)
    assert estimate.optimizer.flops == trainable * per_param
    assert str(per_param) in estimate.optimizer.formula


def test_unknown_optimizers_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="sgd, adam, adamw"):
        fxflops.estimate(nn.Linear(2, 2), (torch.randn(1, 2),), optimizer="lion")


# ----------------------------------------------------------------------------- reports


def test_reports_show_forward_backward_and_their_ratio(tmp_path):
    torch.manual_seed(0)
    estimate = backward_of(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(2, 8),
                           optimizer="adam")
    text = estimate.print(as_string=True)
    for label in ("fwd flops:", "bwd flops:", "bwd / fwd flops:", "fwd+bwd flops:", "optimizer step flops"):
        assert label in text
    assert f"{estimate.bwd_fwd_ratio:.3f}" in text
    assert "x bwd/fwd" in text
    data = json.loads(estimate.to_json())
    assert data["backward"] is True
    assert data["fwd"] == {"macs": estimate.fwd_macs, "flops": estimate.fwd_flops}
    assert data["bwd"] == {"macs": estimate.bwd_macs, "flops": estimate.bwd_flops}
    assert data["totals"]["flops"] == estimate.fwd_flops + estimate.bwd_flops
    assert data["optimizer"]["flops"] == estimate.optimizer.flops
    root = data["modules"][0]
    assert root["bwd_flops"] == estimate.bwd_flops and root["bwd_fwd_ratio"] == estimate.bwd_fwd_ratio
    back = fxflops.report.from_json(estimate.to_json())
    assert (back.bwd_flops, back.fwd_flops, back.backward) == (estimate.bwd_flops, estimate.fwd_flops, True)
    assert back.modules["2"].bwd_flops == estimate.modules["2"].bwd_flops
    header = estimate.to_csv().splitlines()[0].split(",")
    assert {"bwd_macs", "bwd_flops", "fwd_flops", "bwd_fwd_ratio"} <= set(header)


def test_cli_counts_the_backward(capsys):
    from fxflops.cli.main import main

    assert main(["lenet5", "--backward", "--optimizer", "sgd", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["backward"] is True and data["bwd"]["flops"] > 0
    assert data["optimizer"]["name"] == "sgd"


def test_flops_profiler_uses_the_counted_backward():
    from fxflops.compat import FlopsProfiler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
    result = profiler.profile
    profiler.end_profile()
    counted = backward_of(model, torch.randn(2, 8))
    assert result.backward and result.bwd_flops == counted.bwd_flops
    assert profiler is not None and result.fwd_flops == counted.fwd_flops
    text = result.print(as_string=True)
    assert "bwd FLOPS per device = bwd flops per device / bwd latency:" in text


# ----------------------------------------------------------------------------- timed backward


def test_profile_times_the_backward_per_module_and_restores_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 64), nn.GELU()), nn.Sequential(nn.Linear(64, 8)))
    model[1][0].weight.grad = marker = torch.ones(8, 64)
    x = torch.randn(32, 16)
    result = fxflops.profile(model, (x,), steps=2, backward=True)
    m = result.measurements
    assert m.bwd_latency is not None and m.bwd_latency > 0 and len(m.extra["bwd_latencies"]) == 2
    assert result.backward and result.bwd_flops == backward_of(model, x).bwd_flops
    for name in ("", "0", "0.0", "0.1", "1", "1.0"):
        assert result.modules[name].bwd_latency > 0, name
    # autograd nodes do not nest: a parent's backward time is its children's, summed
    children = result.modules["0"].bwd_latency + result.modules["1"].bwd_latency
    assert result.root.bwd_latency == pytest.approx(children)
    assert result.modules["1.0"].achieved_bwd_flops == pytest.approx(
        result.modules["1.0"].bwd_flops / result.modules["1.0"].bwd_latency)
    assert model[1][0].weight.grad is marker and model[0][0].weight.grad is None
    text = result.print(as_string=True)
    assert "bwd latency:" in text and "bwd FLOPS per device = bwd flops per device / bwd latency:" in text
    assert " bwd, " in text  # per-module bwd latency and FLOPS in the tree
    table = fxflops.report.module_table(result)
    assert "bwd latency" in table.splitlines()[0]


def test_profile_backward_of_a_frozen_model_is_refused_clearly():
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="nothing in the output requires grad"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fxflops.profile(model, (torch.randn(2, 4),), steps=1, backward=True)


def test_value_dependent_models_get_their_backward_from_one_real_run():
    torch.manual_seed(0)
    model = ValueDependent()
    x = torch.randn(3, 4)
    model.proj.weight.grad = marker = torch.zeros_like(model.proj.weight)
    estimate = fxflops.estimate(model, (x,), conventions="torch", backward=True)
    assert estimate.method == "trace" and estimate.backward
    model.proj.weight.grad = None
    forward, backward = oracle_training_flops(model, (x,))
    assert (estimate.fwd_flops, estimate.bwd_flops) == (forward, backward) and backward > 0
    model.proj.weight.grad = marker
    fxflops.estimate(model, (x,), backward=True)
    assert model.proj.weight.grad is marker and torch.count_nonzero(marker) == 0


def test_profile_leaves_existing_gradients_untouched_in_value_too():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    model.weight.grad = grad = torch.ones(4, 8)
    fxflops.profile(model, (torch.randn(2, 8),), steps=1, backward=True)
    assert model.weight.grad is grad and torch.equal(grad, torch.ones(4, 8))


def test_trace_stops_the_backward_at_inputs_the_users_graph_computed():
    torch.manual_seed(0)
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(2, 8) @ weight  # an input with a grad_fn: the user's graph, outside the model
    model = ValueDependent(8)
    traced = fxflops.estimate(model, (x,), method="trace", backward=True)
    eager = fxflops.estimate(model, (x.detach().requires_grad_(),), backward=True)
    assert traced.bwd_flops == eager.bwd_flops
    assert weight.grad is None
    x.sum().backward()  # the user's graph is still whole
    assert weight.grad is not None


def test_embedding_bag_and_max_unpool_are_counted():
    bag = nn.EmbeddingBag(10, 4, mode="sum")
    estimate = backward_of(bag, torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]))
    assert estimate.by_rule["embedding_backward"].bwd_flops == 2 * 4 and not estimate.unknown

    class Unpool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pool, self.unpool = nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)

        def forward(self, x):
            return self.unpool(*self.pool(x))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fxflops.estimate(Unpool(), (torch.randn(1, 1, 4, 4),))  # the forward op is not a backward rule's


def test_json_has_no_ratio_without_a_backward():
    data = json.loads(fxflops.estimate(nn.Linear(2, 2), (torch.randn(1, 2),)).to_json())
    assert data["bwd_fwd_ratio"] is None and data["modules"][0]["bwd_fwd_ratio"] is None


# ------------------------------------------------------------------ mixture-of-experts, weight norm


class GroupedExperts(nn.Module):
    """Rows sorted by expert through torch._grouped_mm (or transformers' fallback op), or as a loop of mm."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.weight = nn.Parameter(torch.randn(4, 64, 32))

    def forward(self, x, offs):
        if self.how == "grouped_mm":
            return torch._grouped_mm(x, self.weight, offs=offs)
        if self.how == "fallback":
            return torch.ops.transformers.grouped_mm_fallback(x, self.weight, offs)
        starts = [0] + offs.tolist()[:-1]
        return torch.cat([x[a:b] @ self.weight[i] for i, (a, b) in enumerate(zip(starts, offs.tolist()))])


@pytest.mark.parametrize("how", ["grouped_mm", "fallback"])
@pytest.mark.parametrize("input_grad", [True, False])
def test_grouped_mm_backward_by_hand_and_as_the_loop_of_mm_it_stands_for(how, input_grad):
    pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback
    torch.manual_seed(0)
    x, offs = torch.randn(48, 64, requires_grad=input_grad), torch.tensor([10, 20, 40, 48], dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimate = fxflops.estimate(GroupedExperts(how), (x, offs), conventions="torch", backward=True)
    assert not estimate.unknown
    # 48 rows x 64 in x 32 out, each row through one expert; the weight gradient (64, 48) x (48, 32) ->
    # (4, 64, 32) contracts each row once too, not once per expert. transformers' fallback op always
    # runs both gradients
    rows = 48 * 64 * 32
    assert estimate.fwd_macs == rows
    assert estimate.bwd_macs == rows * (2 if input_grad or how == "fallback" else 1)
    if how == "grouped_mm":
        # FlopCounterMode sees the loop's mm (it has no formula for _grouped_mm): the same products
        loop = GroupedExperts("loop")
        loop.load_state_dict(GroupedExperts(how).state_dict())
        with FlopCounterMode(display=False) as counter:
            y = loop(x, offs)
            forward = counter.get_total_flops()
            y.backward(torch.randn_like(y))
        assert (estimate.fwd_flops, estimate.bwd_flops) == (forward, counter.get_total_flops() - forward)


def test_mixture_of_experts_training_equals_the_oracle_on_eager_experts():
    # torch._grouped_mm's backward is a _grouped_mm for the input's gradient and one with two 2-D
    # operands for the weights' (the rows split among the experts): counted as the oracle counts the
    # eager experts' plain mm on the same weights
    import copy

    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=128, vocab_size=1000, num_local_experts=4, num_experts_per_tok=2)
    model = tf.MixtralForCausalLM(config)
    inputs = {"input_ids": torch.randint(0, 1000, (2, 16)), "use_cache": False}
    estimate = estimate_like_the_oracle(model, kwargs=inputs)
    assert not estimate.unknown
    # 32 tokens x 2 experts x (gate, up, down: 3 x 64 x 128) per layer; the backward twice that
    assert estimate.by_rule["grouped_mm"].macs - estimate.by_rule["grouped_mm"].bwd_macs == 2 * (32 * 2 * 3 * 64 * 128)
    assert estimate.by_rule["grouped_mm"].bwd_macs == 2 * 2 * (32 * 2 * 3 * 64 * 128)
    eager = copy.deepcopy(model)
    eager.set_experts_implementation("eager")
    assert (estimate.fwd_flops, estimate.bwd_flops) == oracle_training_flops(eager, kwargs=inputs)


def test_weight_norm_backward_by_hand():
    torch.manual_seed(0)
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 8, 3, bias=False), dim=2)
    estimate = backward_of(conv, torch.randn(2, 4, 10))
    assert not estimate.unknown
    # v is 8 x 4 x 3: forward 3 per element (square, sum, scale); gradient 5 (grad_w . v summed,
    # then a grad_w - b v)
    assert estimate.by_rule["weight_norm"].flops == 3 * 96
    assert estimate.by_rule["weight_norm_backward"].bwd_flops == 5 * 96


def test_soft_margin_loss_masked_scatter_and_antialiased_upsampling_have_a_backward():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            y = nn.functional.interpolate(self.conv(x), scale_factor=0.5, mode="bilinear", antialias=True)
            y = y.masked_scatter(y > 0, y * 2)
            return nn.functional.soft_margin_loss(y, torch.ones_like(y))

    estimate = backward_of(Model(), torch.randn(2, 3, 10, 10))
    assert not estimate.unknown
    # y is 2 x 4 x 4 x 4: the loss 4 per element each way; the upsampling's gradient one per grad element
    assert estimate.by_rule["loss"].flops == 4 * 128
    assert estimate.by_rule["loss_backward"].bwd_flops == 4 * 128
    assert estimate.by_rule["upsample_backward"].bwd_flops == 128
