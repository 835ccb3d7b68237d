"""Reading a rule file (or the presets table beside them): its bytes within the size limit, and its TOML.

tomllib is imported only when some TOML is parsed: the shipped files' parse is read back instead
(`fxflops.rules.parsed`), so a count with the shipped rules alone never imports it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from fxflops.rules.formula import clip

MAX_FILE_BYTES = 256 * 1024  # a rule file (the shipped ones are under 25 KiB; one at the limit loads in ~0.3 s); read no further


class RuleFileError(ValueError):
    """A rule file that cannot be used: names the file, the rule and the problem."""


_NOT_FILES = {stat.S_ISDIR: "a folder", stat.S_ISFIFO: "a named pipe (FIFO)", stat.S_ISCHR: "a character device",
              stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}


def read_rule_bytes(path: Path, limit: int = MAX_FILE_BYTES) -> bytes:
    """A rule file's bytes, at most one more than the size `limit`; a RuleFileError for what is no file."""
    try:
        # checked before opening: opening a FIFO waits for a writer, and /dev/zero never ends
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _NOT_FILES.items() if test(mode)), "a special file")
            raise RuleFileError(f"rule file {path} is {kind}, not a file: give a .toml file, or a folder of them")
        with open(path, "rb") as handle:
            return handle.read(limit + 1)  # never more: a huge file is refused, not read
    except FileNotFoundError:
        raise RuleFileError(f"rule file {path} does not exist") from None
    except OSError as error:
        raise RuleFileError(f"rule file {path} cannot be read: {error.strerror or error}") from None


def parse_rule_toml(path: Path, raw: bytes) -> dict[str, Any]:
    """The TOML data of a rule file's bytes (`path` names it in errors), within the size limit."""
    if len(raw) > MAX_FILE_BYTES:
        raise RuleFileError(
            f"{path}: larger than {MAX_FILE_BYTES // 1024} KiB, the limit for a rule file "
            "(split it, or check it is the file you meant)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RuleFileError(
            f"{path}: not UTF-8 text (byte {raw[error.start]:#04x} at offset {error.start}); TOML files are UTF-8"
        ) from None
    import tomllib  # (~2 ms to import: only when a file is parsed)

    try:
        return tomllib.loads(text)
    except RecursionError:
        raise RuleFileError(f"{path}: not valid TOML: arrays or tables nested too deeply") from None
    except ValueError as error:  # TOMLDecodeError, or an integer too long to convert
        raise RuleFileError(f"{path}: not valid TOML: {clip(str(error))}") from None
