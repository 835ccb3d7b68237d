"""What a user's first estimate() imports in a fresh process: what it uses, nothing heavier (issue 37).

networkx (~0.25 s to import) is for Estimate.tree, built on first read; tabulate and the report
modules are for printing; the sweep package (sympy formulas) is for sweeps; tomllib parses a rule file
that is not the shipped parse's (rules/_parsed.json). A count needs none of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the child's modules after one estimate() of a small model, before anything else could import more
_FIRST_CALL = """
import json, sys, torch, fxflops
net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10))
est = fxflops.estimate(net, input_shape=(2, 3, 8, 8))
before_tree = sorted(sys.modules)
edges = sorted(est.tree.edges)
print(json.dumps({"modules": before_tree, "macs": est.total_macs, "edges": edges,
                  "tree_imports_networkx": "networkx" in sys.modules}))
"""

HEAVY = ("networkx", "tabulate", "tomllib", "fxflops.sweeps", "fxflops.report", "fxflops.integrations", "fxflops.explain",
         "fxflops.compare", "fxflops.cli",
         # the direct kernels of a capture with named sizes (a sweep's): a plain capture calls none of them
         "fxflops.capture.symbolic_kernels", "fxflops.capture.symbolic_elementwise", "fxflops.capture.symbolic_layers",
         # a parallel job's records and what counts a pipelining stage or schedule: a graph without collectives,
         # a model that is no stage, needs none of them
         "fxflops.results.parallel", "fxflops.parallel.stage", "fxflops.parallel.schedule",
         # DTensor's debug module (its tools, estimators and FlopCounterMode: ~80 ms) where a capture clears
         # DTensor's sharding decisions
         "torch.distributed.tensor.debug", "torch.distributed._tools")


def _child(code: str) -> dict:
    """The JSON a fresh Python process running `code` (this checkout first on its path) prints last."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_first_estimate_imports_nothing_it_does_not_use():
    found = _child(_FIRST_CALL)
    loaded = [name for name in found["modules"] if name.split(".")[0] in HEAVY or name.startswith(HEAVY)]
    tops = sorted({name.split(".")[0] if not name.startswith("fxflops") else name for name in loaded})
    assert loaded == [], f"estimate() of a small model imported {len(loaded)} modules it does not use: {tops[:10]}"
    # by hand: conv 8*6*6 outputs x 3*3*3 per output x batch 2, linear 2 x 288 x 10
    assert found["macs"] == 2 * 8 * 6 * 6 * 27 + 2 * 288 * 10
    # the tree is still there, made on first read
    assert found["edges"] == [["", "0"], ["", "1"], ["", "2"], ["", "3"]]
    assert found["tree_imports_networkx"]


# the child's garbage collections while `from fxflops import estimate` imports the package's modules
_IMPORT_COLLECTIONS = """
import gc, json, torch, fxflops
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
from fxflops import estimate
print(json.dumps({"collections": collections, "enabled": gc.isenabled(), "api": "fxflops.api" in __import__("sys").modules}))
"""


def test_first_use_imports_with_the_collector_paused_and_leaves_it_on():
    # ~75 modules' objects triggered collections, and one of torch's whole heap cost a first call 0.2-0.3 s
    found = _child(_IMPORT_COLLECTIONS)
    # unpaused: 13 collections (one of them of the older generation); paused, at most the one the first
    # allocation after it makes of the import's young objects, as the collector is switched back on
    assert found["collections"] in ([], [0]), found
    assert found["enabled"] and found["api"]


def test_a_first_estimate_beside_dtensor_does_not_import_its_debug_module():
    # torchvision and transformers load DTensor; a capture then clears DTensor's sharding decisions (a later
    # fake world must not reuse an earlier one's meshes) without importing torch's debug module to do it
    code = "import torch.distributed.tensor\n" + _FIRST_CALL
    found = _child(code)
    loaded = [name for name in found["modules"]
              if name.startswith(("torch.distributed.tensor.debug", "torch.distributed._tools"))]
    assert loaded == []
    assert found["macs"] == 2 * 8 * 6 * 6 * 27 + 2 * 288 * 10
