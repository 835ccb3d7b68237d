"""Command line: `fxflops MODEL [options]` prints the estimate; `fxflops examples` lists built-ins.

Errors print one line (`fxflops: error: ...`) and exit non-zero: 2 for a MODEL or option that
cannot be used, 1 when the model cannot be estimated. `--debug` shows the traceback instead.

The parser is `parser`, running a command `commands`, its output `output`; this module turns what
goes wrong into that one line and the exit status.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence

from fxflops.capture.diagnosis import CaptureError
from fxflops.cli.commands import run
from fxflops.cli.output import say
from fxflops.cli.options import ModelSpecError
from fxflops.cli.parser import EXIT_USAGE, build_parser

EXIT_FAILED = 1


def _one_line(error: BaseException) -> str:
    if isinstance(error, CaptureError):
        return error.summary() + " (--debug shows every attempt)"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    first = lines[0] if lines else type(error).__name__
    used = 1
    while first.endswith(":") and used < len(lines):  # the detail follows on the next line
        first, used = f"{first} {lines[used]}", used + 1
    return first + (" (--debug shows the details)" if used < len(lines) else "")


@contextlib.contextmanager
def _library_logging_quiet() -> Iterator[None]:
    """Errors only from the libraries that build models (transformers logs its config on load), for the
    duration of the command; --debug leaves them as they are."""
    loggers = [logging.getLogger(name) for name in ("transformers", "torch")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # `fxflops plan MODEL ...`: the plan search has options of its own
        from fxflops.cli.plan import main as plan_main

        return _guarded(lambda: plan_main(argv[1:]), "--debug" in argv)
    args = build_parser().parse_args(argv)
    return _guarded(lambda: run(args), args.debug)


def _guarded(command: Callable[[], int], debug: bool) -> int:
    """Run a command with library warnings quiet and any error as one line (--debug: as raised)."""
    if debug:
        return command()
    try:
        with warnings.catch_warnings(), _library_logging_quiet():
            # The report lists unknown ops itself; library chatter would bury it.
            warnings.simplefilter("ignore")
            return command()
    except ModelSpecError as error:
        say(f"error: {error}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # a one-line message; --debug gives the traceback
        say(f"error: {_one_line(error)}")
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
