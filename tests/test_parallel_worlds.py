"""Several fake worlds in one Python process give what each gives in a fresh process.

torch keeps state across process groups: DTensor caches its sharding decisions per DeviceMesh, and
DeviceMesh objects compare equal when their layout and dimension names do, whatever process group they
hold. A what-if plan builds and destroys its own fake world per rank role, and a user may build several in
one process (rank 0 of 8, then rank 5): a result must not depend on what ran before. Each scenario is
estimated once in a fresh interpreter (the reference) and in one process after others, in varied orders
(different plans, the same plan twice, pipeline and expert-parallel roles that capture other ranks, tp
then tp+dp then tp again, the user's own fake groups of other ranks and sizes): every role's FLOPs per
module and every collective (kind, module, phase, group name, description and size, dtype, bytes) equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fxflops
from tests.moe_models import MoEModel
from tests.parallel_models import Llama, UpDownMLP

ROOT = Path(__file__).resolve().parent.parent


def _tokens() -> torch.Tensor:
    return torch.zeros(2, 8, dtype=torch.long)


def _llama() -> Llama:
    with torch.device("meta"):
        return Llama(64, 32, 2, 4, 64)


def _moe() -> MoEModel:
    with torch.device("meta"):
        return MoEModel(32, 16, 32, 4, 2, 2, "list")


def _plan(model: Callable[[], torch.nn.Module], routing: Any = None, **plan: Any) -> Callable[[], Any]:
    def run() -> Any:
        return fxflops.estimate(model(), (_tokens(),), conventions="torch", backward=True, parallel=plan,
                                routing=routing)
    return run


def _fake(world: int, rank: int, shape: tuple[int, ...], names: tuple[str, ...]) -> Callable[[], Any]:
    """The user's own fake group: torch's tensor-parallel MLP over the mesh's last dimension, as `rank`."""
    def run() -> Any:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            with torch.device("meta"):
                model = UpDownMLP(32, 64)
            parallelize_module(model, mesh[names[-1]], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            x = torch.randn(2, 8, 32, device="meta", requires_grad=True)
            return fxflops.estimate(model, (x,), conventions="torch", backward=True)
        finally:
            dist.destroy_process_group()
    return run


SCENARIOS: dict[str, Callable[[], Any]] = {
    "tp2": _plan(_llama, tp=2),
    "tp2_dp2": _plan(_llama, tp=2, dp=2),
    "dp2_tp4": _plan(_llama, dp=2, tp=4),  # the mesh of fake_8_*: (2, 4), ("dp", "tp")
    "pp2_tp2": _plan(_llama, pp=2, tp=2, microbatches=2),
    "tp2_ep2_worst": _plan(_moe, routing="worst", tp=2, ep=2, dp=2),  # two roles: ranks 0 and 2 captured
    "fake_8_rank0": _fake(8, 0, (2, 4), ("dp", "tp")),
    "fake_8_rank5": _fake(8, 5, (2, 4), ("dp", "tp")),
    "fake_4_rank3": _fake(4, 3, (4,), ("tp",)),
}
# one process, in this order: the user's rank 5 then a plan on an equal mesh as rank 0; tp, tp+dp, tp again;
# a pipeline; the two expert-parallel roles, twice; the user's rank 0 after rank 5, another size, rank 5 again
ORDER = ("fake_8_rank5", "dp2_tp4", "tp2", "tp2_dp2", "tp2", "pp2_tp2", "tp2_ep2_worst", "tp2_ep2_worst",
         "fake_8_rank0", "fake_4_rank3", "fake_8_rank5")


def signature(est: Any) -> list[Any]:
    """Per rank role: its name and ranks, FLOPs (and params, calls) per module, every collective's record."""
    roles = est.ranks or [None]
    found = []
    for role in roles:
        one = est if role is None else role.estimate
        modules = {name: [stats.flops, stats.bwd_flops, stats.self_flops, stats.params, stats.calls]
                   for name, stats in sorted(one.modules.items())}
        collectives = [[c.op, c.target, c.module, c.phase, c.group, c.group_desc, c.group_size, c.dtype, c.bytes,
                        c.wire_bytes, c.per_step, c.peer, c.stage, c.micro_batch] for c in one.collectives]
        found.append({"role": None if role is None else [role.name, list(role.ranks)],
                      "flops": [one.fwd_flops, one.bwd_flops], "modules": modules, "collectives": collectives})
    return found


def run(name: str) -> list[Any]:
    """The scenario's signature, as JSON would give it back (lists, not tuples)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return json.loads(json.dumps(signature(SCENARIOS[name]())))


def _fresh(names: list[str]) -> dict[str, Any]:
    """Each scenario's signature, each the first estimate of a fresh interpreter (two at a time)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    code = "import json, sys; from tests.test_parallel_worlds import run; print(json.dumps(run(sys.argv[1])))"
    found: dict[str, Any] = {}
    for start in range(0, len(names), 2):
        running = {name: subprocess.Popen([sys.executable, "-c", code, name], cwd=ROOT, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                   for name in names[start:start + 2]}
        for name, process in running.items():
            out, err = process.communicate(timeout=600)
            assert process.returncode == 0, err[-3000:]
            found[name] = json.loads(out.strip().splitlines()[-1])
    return found


def test_fake_worlds_one_after_another_in_one_process_give_what_fresh_processes_give():
    fresh = _fresh(sorted(set(ORDER)))
    for step, name in enumerate(ORDER):
        assert run(name) == fresh[name], f"{name} (step {step} of {ORDER}) differs from a fresh process"
    assert not dist.is_initialized()


def test_every_rank_role_of_one_plan_names_its_own_tensor_parallel_group():
    """tp=2, ep=2 under worst routing: the ranks of ep index 1 (2 and 3) are captured after rank 0, in a
    fake world of their own; their tensor-parallel all-reduces (the shared expert's w2 forward, w1 backward:
    T rows x h float32 each) go over their own tp group of 2 (wire: 2(n-1)/n of the buffer). Before, DTensor's
    cached sharding decisions handed them rank 0's mesh: a group this rank never joined (size 1, no wire)."""
    est = SCENARIOS["tp2_ep2_worst"]()
    assert [role.ranks for role in est.ranks] == [(0, 1), (2, 3)]
    rows = 2 * 8 * 16 * 4  # T = 2 x 8 tokens of h = 16, float32
    for role in est.ranks:
        reduced = [(c.module, c.phase, c.group_desc, c.group_size, c.bytes, c.wire_bytes)
                   for c in role.estimate.collectives if c.op == "all_reduce"]
        shared = [found for found in reduced if ".shared_expert." in found[0]]
        assert sorted(shared) == sorted((f"layers.{i}.moe.shared_expert.{linear}", phase, "mesh_tp", 2, rows, rows)
                                        for i in range(2) for linear, phase in (("w1", "backward"), ("w2", "forward")))
        # the listed experts this rank holds, split tensor-parallel too, over the same group
        assert {(desc, size) for _, _, desc, size, _, _ in reduced} == {("mesh_tp", 2)}
        assert all(wire == payload for *_, payload, wire in reduced)
