"""Every example of README.md and the manual (docs/) runs, and shows what the text says it shows; the
manual builds with `mkdocs build --strict`. See tests/docs_examples.py for how examples are marked."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.docs_examples import Example, console_commands, examples, output_matches

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TIMEOUT = 600


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _run_python(page: Path, blocks: list[Example], folder: Path) -> None:
    """The page's python and pycon blocks, in order, in one fresh interpreter (one session per page)."""
    driver = textwrap.dedent("""
        import doctest, json, sys, warnings
        warnings.simplefilter("ignore")
        blocks = json.load(open(sys.argv[1]))

        def blank_lines_kept(body):
            # a printed report has blank lines, which end a doctest's output: mark those inside one
            lines = body.split("\\n")
            kept = []
            for i, line in enumerate(lines):
                later = [rest for rest in lines[i + 1:] if rest.strip()]
                inside = line.strip() == "" and later and not later[0].lstrip().startswith(">>>")
                kept.append("<BLANKLINE>" if inside else line)
            return "\\n".join(kept)

        namespace = {"__name__": "__main__"}
        for where, language, body in blocks:
            if language == "python":
                exec(compile(body, where, "exec"), namespace)
                continue
            test = doctest.DocTestParser().get_doctest(blank_lines_kept(body), namespace, where, where, 0)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            runner.run(test, clear_globs=False)
            namespace.update(test.globs)  # DocTest runs in a copy: later blocks see what this one made
            if runner.failures:
                sys.exit(f"{where}: {runner.failures} doctest lines printed something else (see above)")
    """)
    (folder / "driver.py").write_text(driver)
    (folder / "blocks.json").write_text(json.dumps([[b.where, b.language, b.body] for b in blocks]))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "driver.py", "blocks.json"], cwd=folder, capture_output=True, text=True,
                          timeout=TIMEOUT, env=env)
    assert done.returncode == 0, f"{_page_id(page)}: an example failed\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _run_console(example: Example, folder: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": "100"}
    for command, expected in console_commands(example.body):
        shell = command
        if shell.startswith("fxflops "):
            shell = f"{sys.executable} -m fxflops.cli {shell[len('fxflops '):]}"
        elif shell.startswith("python "):
            shell = f"{sys.executable} {shell[len('python '):]}"
        done = subprocess.run(["bash", "-c", shell], cwd=folder, capture_output=True, text=True, timeout=TIMEOUT,
                              env=env, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, f"{example.where}: `{command}` failed\n{done.stderr[-3000:]}"
        assert output_matches(expected, done.stdout), (
            f"{example.where}: `{command}` printed something else than the page shows:\n{done.stdout[-4000:]}")


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_examples_run_and_show_what_they_print(page: Path, tmp_path: Path) -> None:
    found = [example for example in examples(page) if example.skip is None]
    for example in found:
        if example.language == "toml":
            first, _, rest = example.body.partition("\n")
            assert first.startswith("# file: "), f"{example.where}: a toml example names its file on its first line"
            (tmp_path / first[len("# file: "):].strip()).write_text(example.body)
    python = [example for example in found if example.language in ("python", "pycon")]
    if python:
        _run_python(page, python, tmp_path)
    for example in found:
        if example.language == "console":
            _run_console(example, tmp_path)


def test_skipped_examples_say_why() -> None:
    for page in PAGES:
        for example in examples(page):
            assert example.skip is None or len(example.skip) > 10, f"{example.where}: say why it does not run"


def test_quick_start_commands_are_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    start = readme.index("## Quick start")
    block = readme[start:].split("```", 2)[1]
    commands = [line for line in block.splitlines()[1:] if line.strip()]
    test_command = next(line for line in commands if "pytest" in line)
    install, _, run = test_command.partition(" && ")
    assert install.replace("pip install", "python -m pip install --quiet") in ci or install in ci
    assert "python -m pytest" in run and "python -m pytest" in ci


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="the docs extra is not installed (pip install '.[docs]'); CI installs it")
def test_manual_builds_strict(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
