"""The `fxflops` command's entry point, importing nothing heavy itself: Ctrl-C while torch is still
loading exits 130 quietly, as it does later, instead of printing the import's traceback."""

from __future__ import annotations

EXIT_INTERRUPTED = 130


def main() -> int:
    try:
        from fxflops.cli.main import main as run

        return run()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
