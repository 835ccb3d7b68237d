"""The short route past FakeTensorMode's dispatch (capture/meta_kernels.py) against the mode's own dispatch,
over every architecture we can build (issue 23).

The models, inputs, fallbacks (tiny config, then a default config with 4 layers; 64x64 images, then 224)
and worker processes with a per-model timeout are replay_architectures.py's. Each case is captured eagerly
twice, `Counting.prepare("deepspeed", None, None, "dense").capture(model, args, kwargs, "eager")`: with the
route on, and with it off (`fxflops.capture.meta_kernels._fake_internals` answering None, which disables
MetaKernels; set in this process only, around the capture). Compared exactly:

1. every node's meta["val"] leaves as (shape, stride, storage_offset, dtype, device, requires_grad), node by
   node with the node's op and target;
2. every node's cost row (replay_architectures.cost_rows);
3. the module call counts and the cautions.

Each model also runs once in train mode with backward=True (its own job, so its timeout leaves the eval
results standing; the first case only: use_cache=False where the forward takes it; torchvision at batch 2,
so that batch norm's batch-size check passes). A case that fails in both modes is skipped with the reason;
one that fails in one mode only, or differs, is a finding, reported with its first differing node.

    nice -n 10 python benchmarks/meta_route_architectures.py --workers 1      # writes results/meta_route_architectures.md
    python benchmarks/meta_route_architectures.py --only llama,resnet18 --output ''   # quick look
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import replay_architectures as zoo  # noqa: E402
from benchmarks.replay_architectures import Tally, job_name  # noqa: E402

# ---------------------------------------------------------------- the worker side


@contextlib.contextmanager
def route(on: bool, taken: Counter[str]) -> Iterator[None]:
    """The short route on (counting into `taken` the ops it shapes, by op) or off, in this process only."""
    import fxflops.capture.eager as eager
    import fxflops.capture.meta_kernels as meta_kernels

    original_internals, original_class = meta_kernels._fake_internals, eager.MetaKernels

    class Counted(original_class):
        def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
            out = super().__call__(func, args, kwargs)
            if out is not NotImplemented:
                taken[str(func)] += 1
            return out

    if on:
        eager.MetaKernels = Counted
    else:
        meta_kernels._fake_internals = lambda: None
    try:
        yield
    finally:
        meta_kernels._fake_internals, eager.MetaKernels = original_internals, original_class


def _leaf(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype, value.device,
                value.requires_grad)
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return value
    return type(value).__name__  # a SymInt or an opaque object: its kind


def node_values(graph_module: Any) -> list[tuple]:
    """(op, target, meta["val"]'s leaves) of every node, in order."""
    from torch.utils._pytree import tree_leaves

    return [(node.op, str(node.target), [_leaf(leaf) for leaf in tree_leaves(node.meta.get("val"))])
            for node in graph_module.graph.nodes]


def outcome(model: Any, args: tuple, kwargs: dict, on: bool, backward: bool) -> tuple[dict | None, str | None]:
    """One capture: its node values, cost rows, module calls, cautions and how many ops took the route."""
    from fxflops.api import Counting

    taken: Counter[str] = Counter()
    try:
        with route(on, taken):
            counting = Counting.prepare("deepspeed", None, None, "dense")
            captured = counting.capture(model, args, kwargs, "eager", backward=backward)
            result = {"values": node_values(captured.graph_module), "rows": zoo.cost_rows(counting, captured),
                      "calls": dict(captured.module_calls), "cautions": list(captured.cautions)}
    except Exception as error:  # noqa: BLE001 - any failure is a result here
        lines = str(error).splitlines() or [""]
        eager = [line.strip()[len("- eager: "):] for line in lines if line.strip().startswith("- eager: ")]
        return None, f"{type(error).__name__}: {(eager or lines)[0][:300]}"
    result["taken"] = dict(taken)
    return result, None


def first_difference(on: dict, off: dict) -> str | None:
    """The first node whose value differs (target, both values), else the first cost row, calls, cautions."""
    for index, (a, b) in enumerate(zip(on["values"], off["values"])):
        if a != b:
            return f"node {index} ({a[0]} {a[1]} / {b[0]} {b[1]}):\n  route on:  {a[2]}\n  route off: {b[2]}"
    if len(on["values"]) != len(off["values"]):
        longer, name = (on, "on") if len(on["values"]) > len(off["values"]) else (off, "off")
        return (f"{len(on['values'])} nodes with the route on vs {len(off['values'])} off; first extra "
                f"(route {name}): {longer['values'][min(len(on['values']), len(off['values']))]}")
    for index, (a, b) in enumerate(zip(on["rows"], off["rows"])):
        if a != b:
            fields = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
            return f"cost row {index}: fields {fields}\n  route on:  {a}\n  route off: {b}"
    if len(on["rows"]) != len(off["rows"]):
        return f"{len(on['rows'])} cost rows with the route on vs {len(off['rows'])} off"
    if on["calls"] != off["calls"]:
        diff = {k: (on["calls"].get(k), off["calls"].get(k)) for k in set(on["calls"]) | set(off["calls"])
                if on["calls"].get(k) != off["calls"].get(k)}
        return f"module calls differ (on, off): {dict(list(diff.items())[:5])}"
    if on["cautions"] != off["cautions"]:
        return f"cautions differ:\n  route on:  {on['cautions']}\n  route off: {off['cautions']}"
    return None


def compare(model: Any, args: tuple, kwargs: dict, backward: bool = False) -> dict:
    """One case, route on and off: 'identical', 'skipped' (both fail) or 'finding'. As in
    replay_architectures.compare, a model whose two captures with the route off differ is skipped as
    stateful; otherwise a difference is judged on a second capture each way."""
    on, on_error = outcome(model, args, kwargs, True, backward)
    off, off_error = outcome(model, args, kwargs, False, backward)
    if on_error and off_error:
        return {"verdict": "skipped", "reason": f"capture: {off_error}",
                "same_error": on_error == off_error, "on_error": on_error}
    if not on_error and not off_error and first_difference(on, off):
        again, again_error = outcome(model, args, kwargs, False, backward)
        if again_error or first_difference(off, again):
            return {"verdict": "skipped", "reason": "stateful: two captures with the route off differ"}
        on, on_error = outcome(model, args, kwargs, True, backward)
    if on_error or off_error:
        return {"verdict": "finding", "detail": f"route on: {on_error or 'ok'}\nroute off: {off_error or 'ok'}"}
    difference = first_difference(on, off)
    if difference:
        return {"verdict": "finding", "detail": difference}
    return {"verdict": "identical", "nodes": len(on["values"]), "rows": len(on["rows"]),
            "taken": sum(on["taken"].values()), "taken_ops": on["taken"],
            "leaves": sum(len(v[2]) for v in on["values"])}


def compare_trained(model: Any, args: tuple, kwargs: dict) -> dict:
    """The train-mode case with backward=True: the first case only (use_cache=False where the forward
    takes it; the default case is marked 'not run'); an image batch of 2."""
    import torch

    if "use_cache" in inspect.signature(model.forward).parameters and "use_cache" not in kwargs:
        return {"verdict": "not run"}
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4:
        args = (torch.zeros(2, *args[0].shape[1:]),) + tuple(args[1:])
    model.train()
    try:
        return compare(model, args, kwargs, backward=True)
    finally:
        model.eval()


def _check(job: tuple) -> list[dict]:
    kind, *names = job
    judge = compare_trained if kind.endswith("-train") else compare
    if kind.startswith("hf"):
        results = zoo.check_hf(*names, compare=judge)
    else:
        results = zoo.check_torchvision(*names, compare=judge)
    results = [r for r in results if r["verdict"] != "not run"]
    if kind == "tv-train":  # compare_trained ran it at batch 2
        results = [dict(r, case=r["case"].replace("1x3x", "2x3x", 1)) for r in results]
    return results


def _worker(requests: Any, answers: Any) -> None:
    zoo.serve(requests, answers, _check)


# ---------------------------------------------------------------- the parent side


def report(results: dict, not_reached: list[tuple], seconds: float, workers: int) -> str:
    from benchmarks.common import environment

    lines = [
        "# The short route (capture/meta_kernels.py) against the mode's own dispatch, over architectures",
        "",
        "`python benchmarks/meta_route_architectures.py` (see its docstring): each case captured eagerly with",
        "the route on and off; every node's meta[\"val\"] (shape, stride, storage offset, dtype, device,",
        "requires_grad) with its target, every cost row, the module call counts and the cautions compared exactly.",
        "",
        environment(("torch", "transformers", "torchvision"))
        + f" Sweep took {seconds:.0f} s with {workers} worker process(es), at nice 10.",
        "",
    ]
    for train, title in ((False, "Eval mode, forward only"), (True, "Train mode, backward=True")):
        part = {job: answer for job, answer in results.items() if job[0].endswith("-train") == train}
        missing = [job for job in not_reached if job[0].endswith("-train") == train]
        lines += _section(title, part, missing)
    return "\n".join(lines) + "\n"


def _shaped_alike() -> list[str]:
    from fxflops.capture.meta_kernels import _SHAPED_ALIKE

    return sorted(str(op) for op in _SHAPED_ALIKE)


def _section(title: str, results: dict, not_reached: list[tuple]) -> list[str]:
    tally = Tally.of(results)
    counts, findings = tally.counts, tally.findings
    cases = len(tally.identical)
    nodes, leaves, taken = (sum(r[key] for _, r in tally.identical) for key in ("nodes", "leaves", "taken"))
    by_op: Counter[str] = Counter()
    for _, r in tally.identical:
        by_op.update(r["taken_ops"])
    unequal_errors = [(job_name(job), r) for job, answer in results.items() for r in answer
                      if r["verdict"] == "skipped" and r.get("same_error") is False]
    hf = sum(1 for j in results if j[0].startswith("hf"))
    lines = [
        f"## {title}",
        "",
        f"- models checked: {len(results)} ({hf} Hugging Face types, {len(results) - hf} torchvision); "
        f"not reached in the time budget: {len(not_reached)}",
        f"- identical in every case: {counts['identical']} models ({cases} cases, {nodes} nodes and {leaves} "
        f"value leaves compared; {taken} ops shaped by the short route in the route-on captures)",
        f"- skipped (failed in both modes): {counts['skipped']}"
        + (f" ({len(unequal_errors)} with a different error each way, listed below)" if unequal_errors else ""),
        f"- findings (differ, or fail in one mode only): {counts['finding']} models, {len(findings)} cases",
        f"- ops the short route shaped in the identical cases: {len(by_op)} distinct; of those the mode "
        f"decomposes (_SHAPED_ALIKE): " + ", ".join(f"{op} {by_op[op]}" for op in _shaped_alike()),
        "",
        f"### Findings ({title})",
        "",
    ]
    if not findings:
        lines.append("None.")
    for name, r in findings:
        lines += [f"#### {name}, {r.get('case', '-')}, {r.get('config', '-')}", "", "```", r["detail"], "```", ""]
    if unequal_errors:
        lines += ["", "Skipped with a different error each way:", ""]
        for name, r in unequal_errors:
            lines += [f"- {name}: route on `{r['on_error'][:200]}`; route off `{r['reason'][:200]}`"]
    lines += ["", f"### Identical ({title})", "", "| model | case | config | nodes | route-shaped ops |",
              "|---|---|---|---:|---:|"]
    lines += [f"| {job[1]} | {r['case']} | {r['config']} | {r['nodes']} | {r['taken']} |" for job, r in tally.identical]
    lines += ["", f"### Skipped, by reason ({title})", ""] + tally.skipped_lines()
    if not_reached:
        lines += ["", f"### Not reached ({title})", "", ", ".join(j[1] for j in not_reached)]
    return lines + [""]


def main() -> None:
    parser = zoo.sweep_parser(__doc__, "meta_route_architectures", workers=1, budget=50 * 60,
                              timeout_help="seconds per model and mode")
    parser.add_argument("--part", choices=("all", "eval", "train"), default="all")
    options = parser.parse_args()
    parts = {"all": ("", "-train"), "eval": ("",), "train": ("-train",)}[options.part]
    jobs = [(kind + suffix, *names) for suffix in parts for kind, *names in zoo.selected_jobs(options.only)]
    start = time.monotonic()
    results, not_reached = zoo.run(jobs, options.workers, options.timeout, options.budget, worker=_worker)
    zoo.publish(report(results, not_reached, time.monotonic() - start, options.workers), options.output)


if __name__ == "__main__":
    main()
