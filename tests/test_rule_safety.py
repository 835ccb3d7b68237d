"""A hostile or mistaken rule file fails fast, with one line naming the file, the rule and the field.

Each hostile case of issue 9 must fail before its expensive operation (a 30 MiB integer, a 10 GB
string, a 10 MB file parsed): the bounds are checked before it, never after. What proves it here is the
memory the failing call allocates, a deterministic measure (tracemalloc: Python's own allocations),
not its time; how fast it fails is measured in benchmarks/.
"""

from __future__ import annotations

import contextlib
import tracemalloc
import warnings

import pytest
import torch
from torch import nn

import fxflops
from fxflops.rules.formula import Formula, FormulaError
from fxflops.rules.formula_bounds import MAX_INT_BITS, MAX_LENGTH
from fxflops.rules import MAX_FILE_BYTES, default_rules_dir, load_rule_dir, load_table
from fxflops.rules.presets import PRESETS_FILE

# a failing estimate() of this small model allocates under 1 MiB of Python objects; the expensive
# operations the guards stop allocate far more (the 9**64**4 integer alone 30 MiB)
MEMORY_BOUND = 8 * 2**20
# a watchdog, not a speed check: a refused FIFO returns at once, a blocked open() never would
BLOCKED_AFTER = 30.0


@contextlib.contextmanager
def within_memory_bound():
    """Fails when the block allocated more than MEMORY_BOUND bytes at its peak."""
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    start = tracemalloc.get_traced_memory()[0]
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1] - start
        if not tracing:
            tracemalloc.stop()
    assert peak < MEMORY_BOUND, f"allocated {peak / 2**20:.1f} MiB before failing"


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU())


@pytest.fixture(scope="module", autouse=True)
def warm_up():
    # the first estimate() of a process imports the capture machinery: not what is timed here
    fxflops.estimate(model(), input_shape=(2, 8))


def rule_text(macs: str = "numel(out) * weight.shape[1]", flops: str = "2 * macs", extra: str = "",
              ops: str = "['aten.linear']") -> str:
    return f"[[rule]]\nname = 'mine'\nops = {ops}\nmacs = \"{macs}\"\nflops = \"{flops}\"\n{extra}"


def fails(tmp_path, content: str | bytes, error: type[Exception], **options) -> str:
    """estimate() with the rule file raises `error` before anything expensive; its one-line message names the file."""
    path = tmp_path / "hostile.toml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with within_memory_bound(), pytest.raises(error) as caught:
        fxflops.estimate(model(), input_shape=(2, 8), rules=[path], **options)
    message = str(caught.value)
    assert str(path) in message and "\n" not in message
    return message


# --- failing on an op call: file, rule, field, op and module ----------------------------------------


@pytest.mark.parametrize(
    "macs, extra, field, problem",
    [
        ("((((9**64)**64)**64)**64)", "", "macs", f"(at most {MAX_INT_BITS})"),  # was 17-30 s, then a raw ValueError
        ("'a' * 10**10", "", "macs", f"(at most {MAX_LENGTH})"),  # was a 10 GB allocation
        ("-5", "", "macs", "-5, a negative count"),  # was accepted
        ("'12'", "", "macs", "'12' (a str), not a count"),  # was FLOPs '1212'
        ("1e308 * 10", "", "macs", "float overflow"),  # was a raw error
        ("numel(out) / 3", "", "macs", "use // or int()"),  # 32 / 3 is no count
        ("numel(out)", "when = '1 // 0 == 0'\n", "when", "ZeroDivisionError"),  # was a raw error naming nothing
        ("weight.shape[1] * 1e300 ** 2", "", "macs", "OverflowError"),
    ],
)
def test_a_formula_failing_on_a_call_names_file_rule_field_op_and_module(tmp_path, macs, extra, field, problem):
    message = fails(tmp_path, rule_text(macs=macs, extra=extra), fxflops.RuleEvaluationError)
    assert f"rule 'mine': '{field}' failed on aten.linear.default in module '0'" in message
    assert problem in message


def test_a_preset_formula_is_named_as_the_preset_field(tmp_path):
    text = rule_text(extra="presets.torch = { flops = '-1' }\n")
    message = fails(tmp_path, text, fxflops.RuleEvaluationError, conventions="torch")
    assert "rule 'mine': 'presets.torch.flops' failed on aten.linear.default" in message
    assert "negative count" in message


def test_an_integral_float_counts_as_its_int(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(rule_text(macs="numel(out) * weight.shape[1] * 1.0"))
    result = fxflops.estimate(model(), input_shape=(2, 8), rules=[path])
    assert result.modules["0"].macs == 2 * 16 * 8 and type(result.modules["0"].macs) is int


# --- failing at load: file, rule, field ---------------------------------------------------------------


@pytest.mark.parametrize(
    "content, problem",
    [
        # was 32 s and 1.8 GB, parsed twice per call
        (rule_text() + "#" + "x" * 10_000_000 + "\n", f"larger than {MAX_FILE_BYTES // 1024} KiB"),
        (rule_text().encode() + b"# \xff\xfe\n", "not UTF-8 text (byte 0xff at offset"),
        ("x = " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
        ("rule = 3\n", "'rule' must be an array of tables"),
    ],
    ids=["10 MB", "not UTF-8", "nested TOML", "rule = 3"],
)
def test_a_file_that_cannot_be_read_names_the_file(tmp_path, content, problem):
    assert problem in fails(tmp_path, content, fxflops.RuleFileError)


@pytest.mark.parametrize(
    "text, field, problem",
    [
        (rule_text(macs="+".join(["1"] * 3000)), "macs", "too long (at most 2000)"),  # was a raw RecursionError
        (rule_text(macs="+".join(["1"] * 200)), "macs", "nested more than 100 deep"),
        (rule_text(macs="len([" + ",".join(["-0"] * 600) + "])"), "macs", "more than 1000 syntax nodes"),
        (rule_text(macs=str(2**300)), "macs", "constant an integer of 301 bits"),
        (rule_text(macs="1j"), "macs", "complex constant is not allowed"),
        (rule_text(extra="presets.torch = { flop = '0' }\n"), "presets.torch",  # was ignored
         "unknown keys ['flop'] (allowed: flops, macs); did you mean 'flops' for 'flop'?"),
        (rule_text(extra="presets.torch = '2 * macs'\n"), "presets.torch", "must be a table of formulas"),
        (rule_text(extra="presets.mlperf = { flops = '0' }\n"), None,
         "unknown preset 'mlperf' (known: deepspeed, torch, fvcore, ptflops, ptflops-aten)"),
        (rule_text(macs="numel(outt) * weight.shape[1]"), "macs",
         "name 'outt' is not given by aten.linear; its names are args, bias, input, kwargs, out, weight, within; did you mean 'out'?"),
        (rule_text(flops="2 * weigth.shape[0]"), "flops", "did you mean 'weight'?"),
        (rule_text(macs="2 * macs"), "macs", "'macs' is defined only inside 'flops'"),
        (rule_text(extra="when = 'transposed'\n"), "when", "name 'transposed' is not given by aten.linear"),
        (rule_text(extra="flop = '0'\n"), None, "unknown keys ['flop']"),
    ],
    ids=["3000 +", "depth", "nodes", "big constant", "complex", "preset key", "preset type", "preset name",
         "name typo", "name typo in flops", "macs in macs", "when name", "rule key"],
)
def test_a_bad_rule_names_file_rule_field_and_problem_at_load(tmp_path, text, field, problem):
    message = fails(tmp_path, text, fxflops.RuleFileError)
    assert "rule 'mine'" in message
    if field is not None:
        assert f"'{field}'" in message
    assert problem in message


def test_a_name_must_be_given_by_every_op_of_the_rule(tmp_path):
    # aten.mm's operands are self and mat2, aten.bmm's too; aten.addmm's self, mat1 and mat2
    text = rule_text(macs="numel(out) * mat2.shape[-2] + numel(mat1)", ops="['aten.addmm', 'aten.mm', 'aten.bmm']")
    message = fails(tmp_path, text, fxflops.RuleFileError)
    assert "name 'mat1' is not given by aten.mm (nor by 1 more of its ops)" in message


def test_names_of_functions_methods_and_modules(tmp_path):
    path = tmp_path / "mine.toml"
    # a function's and a method's parameters are checked; a module's attributes cannot be known before
    # an instance exists, so a module rule's names are not
    path.write_text(
        rule_text(ops="['torch.nn.functional.linear', 'Tensor.matmul']", macs="numel(input) * 0")
        + rule_text(ops="['torch.nn.Linear']", macs="in_features * out_features").replace("'mine'", "'module'")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxflops.rules.load_rule_file(path)
    path.write_text(rule_text(ops="['torch.nn.functional.linear', 'Tensor.matmul']", macs="numel(weight) * 0"))
    with pytest.raises(fxflops.RuleFileError, match="name 'weight' is not given by Tensor.matmul"):
        fxflops.rules.load_rule_file(path)


# --- op spellings that name nothing: a warning --------------------------------------------------------


@pytest.mark.parametrize(
    "op, guess",
    [
        ("aten.lineer", "aten.linear"),  # never matched, and nothing said so
        ("aten.linear.defualt", None),
        ("torch.nn.Lineer", "torch.nn.Linear"),
        ("torch.nn.functional.lineer", "torch.nn.functional.linear"),
        ("Tensor.matmull", "Tensor.matmul"),
    ],
)
def test_an_op_spelling_that_names_nothing_warns_with_a_guess(tmp_path, op, guess):
    path = tmp_path / "mine.toml"
    path.write_text(rule_text(ops=f"['{op}']", macs="0"))
    with within_memory_bound(), pytest.warns(fxflops.RuleFileWarning) as caught:
        fxflops.estimate(model(), input_shape=(2, 8), rules=[path])
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"{path}: rule 'mine': op '{op}'" in message and "never matches it" in message
    if guess:
        assert f"did you mean '{guess}'?" in message


def test_spellings_of_packages_not_imported_are_left_to_match_time(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(rule_text(ops="['transformers.models.nope.NopeBlock', 'mylib.Block', 'prims.nope']", macs="0"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxflops.rules.load_rule_file(path)


def test_shipped_rules_pass_the_checks_user_files_get():
    # at run time the shipped files skip the op and name checks (a start-up cost): they are checked here
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        entries = load_rule_dir(default_rules_dir(), check_ops=True, skip=PRESETS_FILE)
        load_table()
    assert len(entries) > 100


# --- Python callables: their results are checked too ----------------------------------------------


def returns_none(call):
    return None


def returns_negative(call):
    return -1, 0


def returns_float(call):
    return 1.5, 3


def returns_str(call):
    return 4, "8"


def returns_one(call):
    return (4,)


def raises(call):
    return 1 // 0


@pytest.mark.parametrize(
    "function, problem",
    [
        (returns_none, "failed on aten.linear.default in module '0': it returned None, not a (macs, flops) pair"),
        (returns_negative, "'macs' failed on aten.linear.default in module '0': it returned -1, a negative count"),
        (returns_float, "'macs' failed on aten.linear.default in module '0': it returned 1.5 (a float), not a count"),
        (returns_str, "'flops' failed on aten.linear.default in module '0': it returned '8' (a str), not a count"),
        (returns_one, "it returned (4,), not a (macs, flops) pair"),
        (raises, "failed on aten.linear.default in module '0': ZeroDivisionError: integer division or modulo by zero"),
    ],
)
def test_a_callable_rule_is_named_by_its_qualified_name(function, problem):
    with within_memory_bound(), pytest.raises(fxflops.RuleEvaluationError) as caught:
        fxflops.estimate(model(), input_shape=(2, 8), rules={"aten.linear": function})
    message = str(caught.value)
    assert f"Python rule {__name__}.{function.__name__}" in message
    assert problem in message
    if function is raises:
        assert isinstance(caught.value.__cause__, ZeroDivisionError)  # the user's traceback is kept


# --- each user file read once per call -------------------------------------------------------------


def test_a_user_rule_file_is_read_once_per_call(tmp_path, monkeypatch):
    path = tmp_path / "mine.toml"
    path.write_text(rule_text())
    reads = []
    original = fxflops.rules.files._read_toml
    monkeypatch.setattr(fxflops.rules.files, "_read_toml", lambda p: reads.append(p) or original(p))
    result = fxflops.estimate(model(), input_shape=(2, 8), rules=iter([path]))  # an iterator is read once too
    assert reads == [path]
    assert result.by_rule["mine"].count == 1


# --- the bounds keep symbolic sizes symbolic --------------------------------------------------------


def test_bounds_leave_symbolic_sizes_alone():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    batch, seq = env.create_unbacked_symint(), env.create_unbacked_symint()
    names = {"batch": batch, "seq": seq}
    assert isinstance(Formula("(batch * seq) ** 64 * 2 ** 64").evaluate(names), torch.SymInt)
    # a product that is symbolic from its first factor is not bounded: its size is not an int's
    assert isinstance(Formula("prod((batch, seq) + (2 ** 60,) * 5)").evaluate(names), torch.SymInt)
    with pytest.raises(FormulaError, match="symbolic number of times"):
        Formula("'a' * batch").evaluate(names)


def test_a_callable_for_an_op_spelling_that_names_nothing_warns():
    with pytest.warns(fxflops.RuleFileWarning, match=rf"Python rule {__name__}\.returns_none: op 'aten\.lineer' "
                                                     r"\(did you mean 'aten\.linear'\?\) names nothing"):
        fxflops.estimate(model(), input_shape=(2, 8), rules={"aten.lineer": returns_none})


def _load_or_release(target, fifo=None) -> str:
    """load_table([target])'s RuleFileError message; the call must return, not block (a FIFO opened for
    reading waits for a writer forever: if it blocks, a writer is opened so the thread ends)."""
    import os
    import threading

    from fxflops.rules import RuleFileError

    found: list[str] = []

    def load() -> None:
        try:
            load_table([target])
        except RuleFileError as error:
            found.append(str(error))

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(BLOCKED_AFTER)
    if thread.is_alive() and fifo is not None:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # let the blocked open() return
        thread.join(BLOCKED_AFTER)
        pytest.fail(f"loading {target} blocked")
    assert found, f"{target} was loaded"
    return found[0]


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no named pipes here")
def test_a_fifo_or_device_as_rule_file_is_refused_before_opening(tmp_path):
    import os

    fifo = tmp_path / "rules.toml"
    os.mkfifo(fifo)
    message = _load_or_release(fifo, fifo)
    assert message == f"rule file {fifo} is a named pipe (FIFO), not a file: give a .toml file, or a folder of them"
    assert "named pipe (FIFO)" in _load_or_release(tmp_path, fifo)  # a folder holding one
    if os.path.exists("/dev/zero"):
        assert "/dev/zero is a character device, not a file" in _load_or_release("/dev/zero")
    from fxflops.rules import RuleFileError, load_rule_file

    with pytest.raises(RuleFileError, match=r"is a folder, not a file"):
        load_rule_file(tmp_path)


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no named pipes here")
def test_cli_refuses_a_fifo_rule_path(tmp_path):
    import os

    from tests.test_cli import fxflops as run_cli

    fifo = tmp_path / "r.toml"
    os.mkfifo(fifo)
    result = run_cli("lenet5", "--rules", str(fifo))  # before: blocked until killed
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"fxflops: error: rule file {fifo} is a named pipe (FIFO), not a file: give a .toml " \
        "file, or a folder of them\n"


def test_the_shipped_tables_formulas_are_parsed_only_when_used():
    # what a process pays at its first estimate: the formulas of the ops its model runs, not all ~400
    entries = load_rule_dir(default_rules_dir(), check_ops=False, skip=PRESETS_FILE)
    formulas = [f for entry in entries if isinstance(entry, fxflops.rules.Rule) for f in (entry.macs, entry.flops, entry.when) if f]
    assert formulas and all(formula._parsed is None for formula in formulas)
    checked = load_rule_dir(default_rules_dir(), check_ops=True, skip=PRESETS_FILE)
    assert all(entry.macs._parsed is not None for entry in checked if isinstance(entry, fxflops.rules.Rule))
