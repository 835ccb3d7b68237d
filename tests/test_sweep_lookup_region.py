"""The region of sizes past a position table, as a sweep states it in a caution: sympy.simplify's answer,
worked out without simplify where each side is decided or linear in one size (simplify's first call in a
process imports sympy.physics, a fifth of a GPT-2 sweep's capture)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import sympy

from fxflops.sweeps.piece import _either

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
seq, batch = (sympy.Symbol(name, integer=True, positive=True) for name in ("seq", "batch"))
RELATIONS = (sympy.Gt, sympy.Lt, sympy.Ge, sympy.Le)


@pytest.mark.parametrize("relation", RELATIONS)
def test_a_linear_side_is_what_simplify_gives(relation):
    for slope, shift, bound in itertools.product((1, 2, 3, -1, -2), (-5, 0, 7), (0, 1, 1023, 1024)):
        past = relation(slope * seq + shift, bound)
        for other in (sympy.Lt(sympy.Integer(0), 0), sympy.Lt(sympy.Integer(3), 4)):  # decided: false, true
            assert _either(past, other) == sympy.simplify(sympy.Or(past, other)), (past, other)


def test_anything_else_is_simplify_itself():
    for a, b in [(sympy.Gt(seq - 1, 1023), sympy.Lt(seq - 3, 0)),  # two undecided sides
                 (sympy.Gt(batch * seq - 1, 1023), sympy.false), (sympy.Gt(sympy.floor(seq / 2), 3), sympy.false),
                 (sympy.Gt(seq + batch, 9), sympy.false)]:
        assert _either(a, b) == sympy.simplify(sympy.Or(a, b))


def test_a_gpt2_sweep_past_its_positions_imports_no_sympy_physics():
    code = """
import json, sys, torch
from fxflops.cli.examples import gpt2_small
from fxflops.sweeps import sweep
model = gpt2_small(vocab_size=100, n_positions=64, d_model=32, n_layer=1, n_head=2)
swept = sweep(model, torch.zeros(1, 16, dtype=torch.long), dims={"seq": 1})
print(json.dumps({"physics": "sympy.physics" in sys.modules, "cautions": swept.at(seq=65).cautions}))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert not found["physics"]
    assert len(found["cautions"]) == 1 and "seq > 64" in found["cautions"][0]  # rows 0..seq-1 of 64: past at 65
