"""Replay (capture/replay.py) against a capture that runs every call, over every architecture we can build.

For each Hugging Face model type reachable through transformers.models.auto (one class per type: its
causal LM, else its seq2seq LM, else its base model, else its image classifier), a tiny config (4 layers,
hidden 64, 4 heads, vocab 100, 4 experts; a default config with only the layer counts shrunk when the
tiny one does not build or run) on the meta device with zero inputs on the CPU; for every torchvision
classification model, 1x3x64x64 (1x3x224x224 where 64 does not run). Each is captured eagerly with
replay=True and replay=False (where they differ, both again: a model that keeps state between calls
is skipped when its two full captures differ; models whose forward takes use_cache: with
use_cache=False and with the default) and every node's cost row, the module call counts and the cautions compared exactly, as
tests/test_replay.py's assert_same_as_full does.

Each is captured a third time with FXFLOPS_VERIFY_REPLAY=1 (every call replay would copy runs as well and
is compared with the copy): its rows must equal the full capture's and it must warn no ReplayMismatch.
Beside them (`--hostile with`, the default), the generated hostile models of benchmarks/hostile_models.py
(issue 36: a few hundred custom models, each reading a per-layer value through one channel a replay key
could miss), each captured three times from the same outside state.

A model that fails to build or capture in both modes is skipped (with the reason); one that fails in only
one mode or differs is a finding. Each model runs in a worker process with a per-model timeout.

    nice -n 10 python benchmarks/replay_architectures.py                 # writes results/replay_architectures.md
    python benchmarks/replay_architectures.py --only llama,resnet18 --output ''   # quick look
    python benchmarks/replay_architectures.py --hostile only --output benchmarks/results/replay_hostile.md
    python benchmarks/replay_architectures.py --backward ...   # training captures: the backward's replay too
"""

from __future__ import annotations

import argparse
import inspect
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYERS = 4
TINY = dict(hidden_size=64, n_embd=64, d_model=64, embed_dim=64, dim=64, num_attention_heads=4, n_head=4,
            num_heads=4, encoder_attention_heads=4, decoder_attention_heads=4, num_key_value_heads=2,
            head_dim=16, d_kv=16, intermediate_size=128, ffn_dim=128, d_ff=128, encoder_ffn_dim=128,
            decoder_ffn_dim=128, n_inner=128, vocab_size=100, num_experts=4, num_local_experts=4,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, image_size=64, max_position_embeddings=128)
LAYER_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
               "num_decoder_layers", "num_encoder_layers", "depth")
SEQ = 12


# ---------------------------------------------------------------- the worker side


BACKWARD_ENV = "REPLAY_SWEEP_BACKWARD"  # set by --backward: every capture records the backward too (training)


def _rows(model: Any, args: tuple, kwargs: dict, replay: bool) -> tuple:
    from fxflops.api import Counting
    from fxflops.capture.replay import REPLAY_OF, node_rows

    backward = os.environ.get(BACKWARD_ENV) == "1"
    counting = Counting.prepare("deepspeed", None, None, "dense")
    captured = counting.capture(model, args, kwargs, "eager", replay=replay, backward=backward)
    copied = sum(REPLAY_OF in node.meta for node in captured.graph_module.graph.nodes)
    rows = cost_rows(counting, captured)
    if backward:  # and every node as it is (phase, the forward op a backward op differentiates, strides, inputs)
        rows += node_rows(captured.graph_module.graph)
    return rows, dict(captured.module_calls), list(captured.cautions), copied


def cost_rows(counting: Any, captured: Any) -> list[tuple]:
    """Every node's cost row, every field a count or a reader of it shows (meta_route_architectures.py too)."""
    return [(c.name, c.op, c.status, c.rule, c.module, c.module_type, c.macs, c.flops, c.bytes, c.source,
             c.input_shapes, c.output_shapes, c.attention, c.kept_pairs, c.dense_macs, c.effective_macs)
            for c in counting.count(captured)]


def _attempt(model: Any, args: tuple, kwargs: dict, replay: bool) -> tuple[Any, str | None]:
    try:
        return _rows(model, args, kwargs, replay), None
    except Exception as error:  # noqa: BLE001 - any failure is a result here
        lines = str(error).splitlines() or [""]
        eager = [line.strip()[len("- eager: "):] for line in lines if line.strip().startswith("- eager: ")]
        return None, f"{type(error).__name__}: {(eager or lines)[0][:200]}"


def _first_difference(replayed: tuple, full: tuple) -> str | None:
    rows, calls, cautions, _ = replayed
    full_rows, full_calls, full_cautions, _ = full
    for index, (row, other) in enumerate(zip(rows, full_rows)):
        if row != other:
            fields = [i for i, (a, b) in enumerate(zip(row, other)) if a != b]
            return f"row {index}: fields {fields}\n  replay: {row}\n  full:   {other}"
    if len(rows) != len(full_rows):
        longer = rows if len(rows) > len(full_rows) else full_rows
        extra = longer[min(len(rows), len(full_rows))]
        return (f"{len(rows)} rows replayed vs {len(full_rows)} full; first extra row "
                f"({'replay' if longer is rows else 'full'}): {extra}")
    if calls != full_calls:
        diff = {k: (calls.get(k), full_calls.get(k)) for k in set(calls) | set(full_calls)
                if calls.get(k) != full_calls.get(k)}
        return f"module calls differ (replay, full): {dict(list(diff.items())[:5])}"
    if cautions != full_cautions:
        return f"cautions differ:\n  replay: {cautions}\n  full:   {full_cautions}"
    return None


def _verified(model: Any, args: tuple, kwargs: dict) -> tuple[Any, list[str]]:
    """A capture with FXFLOPS_VERIFY_REPLAY=1: its rows (those of a full capture), and every mismatch it warned."""
    import warnings

    from fxflops.capture.replay import VERIFY_ENV, ReplayMismatch

    if os.environ.get(BACKWARD_ENV) == "1":
        # a training capture's verification captures twice (with and without replay), which a model keeping
        # state between calls (a counter) sees differ; replay=True against replay=False, each from the same
        # state, is the same comparison
        return None, []
    os.environ[VERIFY_ENV] = "1"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ReplayMismatch)
            rows, error = _attempt(model, args, kwargs, True)
    finally:
        del os.environ[VERIFY_ENV]
    return rows if error is None else error, [str(w.message) for w in caught if w.category is ReplayMismatch]


def _verdict(replayed: Any, full: Any, verified: tuple[Any, list[str]]) -> dict:
    """Identical, or the first difference: replay against full, verification's rows against full, or a
    mismatch verification reported."""
    difference = _first_difference(replayed, full)
    if difference:
        return {"verdict": "finding", "detail": difference, "copied": replayed[3]}
    rows, mismatches = verified
    if rows is None:  # (not verified: a training capture's verification is replay against full itself)
        return {"verdict": "identical", "copied": replayed[3], "nodes": len(full[0])}
    if isinstance(rows, str) or _first_difference(rows, full) or mismatches:
        detail = rows if isinstance(rows, str) else _first_difference(rows, full) or mismatches[0]
        return {"verdict": "finding", "detail": f"verification: {detail}", "copied": replayed[3]}
    return {"verdict": "identical", "copied": replayed[3], "nodes": len(full[0])}


def compare(model: Any, args: tuple, kwargs: dict) -> dict:
    """One case, both modes: 'identical', 'skipped' (both fail) or 'finding'.

    A model that keeps state across calls (a module-level lru_cache of tensors, as DINOv3's patch
    coordinates) records fewer ops on a later call whatever the mode: where the two differ, both run
    again, and a model whose two full captures differ is skipped as stateful; otherwise the second
    replayed capture is compared with the second full one (both came after other captures)."""
    replayed, replay_error = _attempt(model, args, kwargs, True)
    full, full_error = _attempt(model, args, kwargs, False)
    if replay_error and full_error:
        return {"verdict": "skipped", "reason": f"capture: {full_error}"}
    if not replay_error and not full_error and _first_difference(replayed, full):
        again, again_error = _attempt(model, args, kwargs, False)
        if again_error or _first_difference(full, again):
            return {"verdict": "skipped", "reason": "stateful: two full captures differ"}
        replayed, replay_error = _attempt(model, args, kwargs, True)
    if replay_error or full_error:
        return {"verdict": "finding", "detail": f"replay: {replay_error or 'ok'}; full: {full_error or 'ok'}"}
    return _verdict(replayed, full, _verified(model, args, kwargs))


def check_hostile(name: str) -> list[dict]:
    """One generated hostile model (benchmarks/hostile_models.py): replay, full and verified captures,
    each from the same outside state."""
    from benchmarks.hostile_models import build

    model, args, reset = build(name)
    captures = []
    for replay in (True, False):
        reset()
        captures.append(_attempt(model, args, {}, replay))
    reset()
    verified = _verified(model, args, {})
    (replayed, replay_error), (full, full_error) = captures
    if replay_error and full_error:
        result = {"verdict": "skipped", "reason": f"capture: {full_error}"}
    elif replay_error or full_error:
        result = {"verdict": "finding", "detail": f"replay: {replay_error or 'ok'}; full: {full_error or 'ok'}"}
    else:
        result = _verdict(replayed, full, verified)
    result.update(case=name.split("/", 1)[1], config="hostile")
    return [result]


def _shrunk(config_class: type, tiny: bool) -> Any:
    default = config_class()
    names = {k: LAYERS for k in LAYER_NAMES if isinstance(getattr(default, k, None), int)}
    if tiny:
        names.update({k: v for k, v in TINY.items() if isinstance(getattr(default, k, None), int)
                      and not isinstance(getattr(default, k), bool)})
        for token in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            if isinstance(getattr(default, token, None), int):
                names[token] = 0
    config = config_class(**names)
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            for name in LAYER_NAMES:
                if isinstance(getattr(sub, name, None), int):
                    setattr(sub, name, LAYERS)
    return config


def _inputs(model: Any, config: Any) -> list[tuple[str, dict]]:
    """Zero inputs for the model's main input; for a model that also takes images (CLIP-like), a second
    variant with pixel_values as well."""
    import torch

    main = getattr(model, "main_input_name", "input_ids")
    parameters = inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = {}
    if main == "pixel_values":
        kwargs["pixel_values"] = _pixels(config)
    elif main in ("input_values",):
        kwargs[main] = torch.zeros(2, 4000)
    elif main == "input_features":
        bins = getattr(config, "num_mel_bins", 80)
        kwargs[main] = torch.zeros(2, bins, 3000)
    else:
        kwargs[main] = torch.zeros(2, SEQ, dtype=torch.long)
    if "decoder_input_ids" in parameters:
        kwargs["decoder_input_ids"] = torch.zeros(2, 5, dtype=torch.long)
    variants = [("", kwargs)]
    if main != "pixel_values" and "pixel_values" in parameters:
        variants.append(("+pixel_values", {**kwargs, "pixel_values": _pixels(getattr(config, "vision_config", None)
                                                                               or config)}))
    return variants


def _pixels(config: Any) -> Any:
    import torch

    size = getattr(config, "image_size", 64)
    size = size[0] if isinstance(size, (list, tuple)) else size
    size = size if isinstance(size, int) else 64
    return torch.zeros(2, getattr(config, "num_channels", 3), size, size)


def _build_hf(model_type: str, class_name: str, tiny: bool) -> tuple[Any, list[tuple[str, dict]]]:
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = _shrunk(type(CONFIG_MAPPING[model_type]()), tiny)
    cls = getattr(transformers, class_name)
    with torch.device("meta"):
        model = cls(config).eval()
    return model, _inputs(model, config)


def check_hf(model_type: str, class_name: str, compare: Callable[..., dict] = compare) -> list[dict]:
    """Both modes of one Hugging Face class, with use_cache=False and the default where it takes one
    (`compare(model, args, kwargs)` judges one case: meta_route_architectures.py passes its own)."""
    failures = []
    for tiny in (True, False):
        try:
            model, variants = _build_hf(model_type, class_name, tiny)
        except Exception as error:  # noqa: BLE001
            failures.append(f"build: {type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}")
            continue
        for extra, kwargs in variants:
            cases = [("default", kwargs)]
            if "use_cache" in inspect.signature(model.forward).parameters:
                cases = [("use_cache=False", {**kwargs, "use_cache": False}), ("default", kwargs)]
            results = []
            for label, case in cases:
                result = compare(model, (), case)
                result.update(case=label + extra, config="tiny" if tiny else "default config, 4 layers")
                results.append(result)
                if result["verdict"] == "skipped":  # the next inputs or config, then
                    break
            if results[0]["verdict"] == "skipped":
                failures.append(results[0]["reason"])
                continue
            return results
    return [{"verdict": "skipped", "reason": failures[-1], "case": "-", "config": "-"}]


def check_torchvision(name: str, compare: Callable[..., dict] = compare) -> list[dict]:
    import torch
    import torchvision

    try:
        try:
            with torch.device("meta"):
                model = torchvision.models.get_model(name).eval()
        except NotImplementedError:  # RegNet computes its widths with tensor ops: only the weights on meta
            from accelerate import init_empty_weights

            with init_empty_weights():
                model = torchvision.models.get_model(name).eval()
    except Exception as error:  # noqa: BLE001
        return [{"verdict": "skipped", "reason": f"build: {type(error).__name__}", "case": "-", "config": "-"}]
    result = {}
    for size in (64, 224):
        result = compare(model, (torch.zeros(1, 3, size, size),), {})
        result.update(case=f"1x3x{size}x{size}", config="default")
        if result["verdict"] != "skipped":
            break
    return [result]


def serve(requests: Any, answers: Any, check: Callable[[tuple], list[dict]]) -> None:
    """A worker's loop: answer each job from `requests` with `check(job)`, a crash as a finding."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    while True:
        job = requests.get()
        if job is None:
            return
        try:
            results = check(job)
        except Exception:  # noqa: BLE001
            results = [{"verdict": "finding", "detail": "worker crash: " + traceback.format_exc(limit=3)[-600:],
                        "case": "-", "config": "-"}]
        answers.put((job, results))


def _check(job: tuple) -> list[dict]:
    kind, *names = job
    if kind == "hostile":
        return check_hostile(*names)
    return check_hf(*names) if kind == "hf" else check_torchvision(*names)


def _worker(requests: Any, answers: Any) -> None:
    serve(requests, answers, _check)


# ---------------------------------------------------------------- the parent side


def hf_jobs() -> list[tuple]:
    from transformers.models.auto import modeling_auto as auto

    order = ["MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
             "MODEL_MAPPING_NAMES", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"]
    chosen: dict[str, str] = {}
    for mapping in order:
        for model_type, names in getattr(auto, mapping).items():
            name = names[0] if isinstance(names, (list, tuple)) else names
            chosen.setdefault(model_type, name)
    return [("hf", t, c) for t, c in sorted(chosen.items())]


def tv_jobs() -> list[tuple]:
    import torchvision

    return [("tv", name) for name in sorted(torchvision.models.list_models(module=torchvision.models))]


def run(jobs: list[tuple], workers: int, timeout: float, budget: float,
        worker: Callable[[Any, Any], None] = _worker) -> tuple[dict, list[tuple]]:
    context = mp.get_context("spawn")
    answers = context.Queue()
    results: dict[tuple, list[dict]] = {}
    pending = list(jobs)
    slots: list[dict] = []
    start = time.monotonic()

    def spawn() -> dict:
        requests = context.Queue()
        process = context.Process(target=worker, args=(requests, answers), daemon=True)
        process.start()
        return {"process": process, "requests": requests, "job": None, "since": 0.0}

    slots = [spawn() for _ in range(workers)]
    while True:
        for i, slot in enumerate(slots):
            if slot["job"] is None and pending and time.monotonic() - start < budget:
                slot["job"] = pending.pop(0)
                slot["since"] = time.monotonic()
                slot["requests"].put(slot["job"])
        if all(slot["job"] is None for slot in slots):
            break
        try:
            job, answer = answers.get(timeout=1.0)
            results[job] = answer
            for slot in slots:
                if slot["job"] == job:
                    slot["job"] = None
            print(f"{time.monotonic() - start:6.0f}s {job[1:]}: "
                  + "; ".join(f"{r['verdict']}" for r in answer), flush=True)
        except Exception:  # noqa: BLE001 - queue.Empty
            pass
        for i, slot in enumerate(slots):
            if slot["job"] is not None and (time.monotonic() - slot["since"] > timeout
                                            or not slot["process"].is_alive()):
                dead = not slot["process"].is_alive()
                results[slot["job"]] = [{"verdict": "skipped", "case": "-", "config": "-",
                                         "reason": "worker died" if dead else f"timeout ({timeout:.0f} s)"}]
                print(f"  {slot['job'][1:]}: {'died' if dead else 'timeout'}", flush=True)
                slot["process"].kill()
                slots[i] = spawn()
    for slot in slots:
        slot["requests"].put(None)
    return results, pending


def job_name(job: tuple) -> str:
    if job[0] == "hostile":
        return f"hostile {job[1]}"
    return f"{job[1]} ({job[2]})" if job[0].startswith("hf") else f"torchvision {job[1]}"


@dataclass
class Tally:
    """A sweep's answers sorted by verdict: a model is a finding if any case is, else identical if any case is."""

    counts: Counter[str] = field(default_factory=Counter)
    identical: list[tuple[tuple, dict]] = field(default_factory=list)
    findings: list[tuple[str, dict]] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    skipped_models: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def of(cls, results: dict) -> Tally:
        tally = cls()
        for job, answer in sorted(results.items()):
            verdicts = {r["verdict"] for r in answer}
            verdict = "finding" if "finding" in verdicts else "identical" if "identical" in verdicts else "skipped"
            tally.counts[verdict] += 1
            tally.identical += [(job, r) for r in answer if r["verdict"] == "identical"]
            tally.findings += [(job_name(job), r) for r in answer if r["verdict"] == "finding"]
            if verdict == "skipped":
                tally.add_skip(job[1], answer[0]["reason"])
        return tally

    def add_skip(self, model: str, reason: str) -> None:
        parts = reason.split(": ")
        short = ": ".join(parts[:3] if parts[0] == "capture" else parts[:2])
        self.examples.setdefault(short, reason)
        self.reasons[short] += 1
        self.skipped_models.setdefault(short, []).append(model)

    def skipped_lines(self) -> list[str]:
        return [f"- {n}: `{reason[:120]}` (say `{self.examples[reason][:200]}`): "
                f"{', '.join(sorted(self.skipped_models[reason]))}" for reason, n in self.reasons.most_common()]


def report(results: dict, not_reached: list[tuple], seconds: float) -> str:
    from benchmarks.common import environment

    tally = Tally.of(results)
    counts, findings = tally.counts, tally.findings
    cases, copied = len(tally.identical), sum(r["copied"] for _, r in tally.identical)
    lines = [
        "# Replay against a full capture, over architectures",
        "",
        "`python benchmarks/replay_architectures.py` (see its docstring): each model captured eagerly with",
        "`replay=True` and `replay=False`, every node's cost row, module call count and caution compared, and",
        "a third time with `FXFLOPS_VERIFY_REPLAY=1` (its rows must be the full capture's, with no ReplayMismatch).",
        "",
        environment(("torch", "transformers", "torchvision")) + f" Sweep took {seconds:.0f} s.",
        "",
        f"- models checked: {len(results)} ({sum(1 for j in results if j[0] == 'hf')} Hugging Face types, "
        f"{sum(1 for j in results if j[0] == 'tv')} torchvision, {sum(1 for j in results if j[0] == 'hostile')} "
        f"generated hostile models); not reached in the time budget: {len(not_reached)}",
        f"- identical in every case: {counts['identical']} models ({cases} cases, {copied} nodes replayed in all)",
        f"- skipped (failed in both modes): {counts['skipped']}",
        f"- findings (differ, or fail in one mode only): {counts['finding']} models, {len(findings)} cases",
        "",
        "## Findings",
        "",
    ]
    kinds = Counter("rows differ" if r["detail"].startswith("row") or "rows replayed" in r["detail"]
                    else r["detail"].split(" (")[0].split(":")[0] for _, r in findings)
    lines += [f"- {n} cases: {kind}" for kind, n in kinds.most_common()] + [""]
    if not findings:
        lines.append("None.")
    for name, r in findings:
        lines += [f"### {name}, {r['case']}, {r['config']}", "", "```", r["detail"], "```", ""]
    lines += ["", "## Identical", "", "| model | case | config | nodes | replayed |", "|---|---|---|---:|---:|"]
    lines += [f"| {job[1]} | {r['case']} | {r['config']} | {r['nodes']} | {r['copied']} |" for job, r in tally.identical]
    lines += ["", "## Skipped, by reason", ""] + tally.skipped_lines()
    if not_reached:
        lines += ["", "## Not reached", "", ", ".join(j[1] for j in not_reached)]
    return "\n".join(lines) + "\n"


def sweep_parser(doc: str, name: str, workers: int, budget: float, timeout_help: str) -> argparse.ArgumentParser:
    """The options an architecture sweep takes; its report goes to benchmarks/results/<name>.md."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model types / torchvision names")
    parser.add_argument("--workers", type=int, default=workers)
    parser.add_argument("--timeout", type=float, default=90.0, help=timeout_help)
    parser.add_argument("--budget", type=float, default=budget, help="seconds before no new model starts")
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results", f"{name}.md"))
    return parser


def selected_jobs(only: str) -> list[tuple]:
    """Every torchvision and Hugging Face job, or those `only` names (comma-separated)."""
    jobs = hf_jobs() + tv_jobs()
    wanted = set(only.split(",")) if only else None
    return [job for job in jobs if wanted is None or job[1] in wanted]


def publish(text: str, output: str) -> None:
    if output:
        with open(output, "w") as f:
            f.write(text)
    print(text)


def hostile_jobs(only: str = "") -> list[tuple]:
    """The generated hostile models (benchmarks/hostile_models.py), or those whose channel `only` names."""
    from benchmarks.hostile_models import cases

    wanted = set(only.split(",")) if only else None
    return [("hostile", name) for name in cases() if wanted is None or name.split("/")[0] in wanted]


def main() -> None:
    parser = sweep_parser(__doc__, "replay_architectures", workers=2, budget=22 * 60, timeout_help="seconds per model")
    parser.add_argument("--hostile", choices=("with", "only", "none"), default="with",
                        help="the generated hostile models: beside the architectures (default), alone, or not")
    parser.add_argument("--backward", action="store_true",
                        help="training captures (backward=True): replay of the blocks' backward checked too")
    options = parser.parse_args()
    if options.backward:
        os.environ[BACKWARD_ENV] = "1"  # (the workers inherit it)
    start = time.monotonic()
    jobs = [] if options.hostile == "only" else selected_jobs(options.only)
    if options.hostile != "none":
        jobs = hostile_jobs(options.only if options.hostile == "only" else "") + jobs
    results, not_reached = run(jobs, options.workers, options.timeout, options.budget)
    publish(report(results, not_reached, time.monotonic() - start), options.output)


if __name__ == "__main__":
    main()
