"""diffusers' model classes at small configs (tests/diffusers_zoo.py): which need a real run, before and after
issue 39's input values, and whether each count equals FlopCounterMode (issue 39).

Per model, in a worker process (one per tree) with a timeout each: `estimate(model, kwargs=inputs, conventions="torch")` with the
default method="auto" (eager on fake tensors, then export, symbolic, and trace: one real run), the method
that succeeded and the failures before it; then FlopCounterMode on one real run (MATH SDPA, MHA fast path off;
flex_attention callers with the oracle's flex formulas). "Before" is the same estimate with fxflops from another
tree (`--before PATH`: a checkout or `git archive` of a commit, e.g. 57335de^, the parent of input_values),
the oracle skipped there.

    nice -n 10 python benchmarks/diffusers_zoo.py --before /tmp/before     # writes results/diffusers_zoo.md
    python benchmarks/diffusers_zoo.py --only MochiTransformer3DModel --output ''
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# after PYTHONPATH: a worker's fxflops is the tree it was given (--before), not this checkout's
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import ROOT, environment  # noqa: E402


def _one(name: str, oracle: bool) -> dict:
    """The record of one model (run in a worker process)."""
    import warnings

    warnings.simplefilter("ignore")
    import fxflops
    from tests import diffusers_zoo as zoo

    record: dict = {"name": name}
    model = zoo.build(name)
    started = time.process_time()
    try:
        result = fxflops.estimate(model, kwargs=zoo.inputs(name), conventions="torch")
        record.update(method=result.method, flops=result.total_flops,
                      attempts=[f"{method}: {why.splitlines()[0][:160]}" for method, why in result.attempts],
                      cautions=list(result.cautions))
    except Exception as error:  # noqa: BLE001 - a failure is a row of the table
        record["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    record["estimate_s"] = round(time.process_time() - started, 2)
    if oracle:
        from tests.test_diffusers_zoo import NO_ORACLE, _oracle

        started = time.process_time()
        try:
            record["oracle"] = _oracle(name, model) if name not in NO_ORACLE else None
            record["oracle_note"] = NO_ORACLE.get(name)
        except Exception as error:  # noqa: BLE001
            record["oracle_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        record["oracle_s"] = round(time.process_time() - started, 2)
    return record


def _run(tree: str, names: list[str], oracle: bool, timeout: int) -> dict[str, dict]:
    """The models in one worker process with fxflops from `tree` (its tests/ from this checkout), a timeout each."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, ROOT])}
    command = [sys.executable, __file__, "--worker", ",".join(names), "--timeout", str(timeout)] + \
        ([] if oracle else ["--no-oracle"])
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            found[record["name"]] = record
    for name in names:
        found.setdefault(name, {"name": name, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]})
    return found


def _worker(names: list[str], oracle: bool, timeout: int) -> None:
    """Each model's record as a JSON line; one that runs past `timeout` seconds is recorded as such."""
    import signal

    def expired(*_: object) -> None:
        raise TimeoutError(f"over {timeout} s")

    signal.signal(signal.SIGALRM, expired)
    for name in names:
        signal.alarm(timeout)
        try:
            record = _one(name, oracle)
        except Exception as error:  # noqa: BLE001 - a failure is a row of the table
            record = {"name": name, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        finally:
            signal.alarm(0)
        print(json.dumps(record), flush=True)
        print(name, record.get("method"), record.get("flops"), record.get("oracle"), file=sys.stderr, flush=True)


def _table(after: dict[str, dict], before: dict[str, dict]) -> str:
    from tests import diffusers_zoo as zoo

    real = lambda record: record.get("method") == "trace"  # noqa: E731
    rows = ["| model | before: method (why) | after: method | FLOPs after | FlopCounterMode | equal |",
            "|---|---|---|---|---|---|"]
    for name in zoo.ENTRIES:
        now, then = after.get(name, {}), before.get(name, {})
        why = "; ".join(then.get("attempts", []))[:200].replace("|", "/")
        then_text = then.get("method") or then.get("error", "—")[:80]
        oracle = now.get("oracle")
        equal = "—" if oracle is None else ("yes" if oracle == now.get("flops") else "**no**")
        rows.append(f"| {name} | {then_text}{' (' + why + ')' if real(then) else ''} | "
                    f"{now.get('method') or now.get('error', '—')[:80]} | {now.get('flops', '—')} | "
                    f"{oracle if oracle is not None else now.get('oracle_error') or now.get('oracle_note') or '—'} | "
                    f"{equal} |")
    counted = [record for record in after.values() if record.get("oracle") is not None]
    summary = (f"{len(zoo.ENTRIES)} models. Real run needed (method trace): before {sum(map(real, before.values()))}, "
               f"after {sum(map(real, after.values()))}. Equal to FlopCounterMode: "
               f"{sum(r['oracle'] == r.get('flops') for r in counted)} of {len(counted)} with an oracle.")
    return summary + "\n\n" + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--no-oracle", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--before", help="a tree with the fxflops to compare with (its fxflops/ and rules/)")
    parser.add_argument("--only", help="comma-separated model class names")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per model")
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results", "diffusers_zoo.md"))
    options = parser.parse_args()
    if options.worker:
        _worker(options.worker.split(","), not options.no_oracle, options.timeout)
        return
    from tests import diffusers_zoo as zoo

    names = options.only.split(",") if options.only else list(zoo.ENTRIES)
    after = _run(ROOT, names, True, options.timeout)
    before = _run(options.before, names, False, options.timeout) if options.before else {}
    text = (f"# diffusers zoo: real runs before and after input values (issue 39)\n\n{environment(('torch', 'diffusers'))}"
            f"\nBefore: {options.before or '(not run)'}.\n\n{_table(after, before)}\n")
    print(text)
    if options.output:
        with open(options.output, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
