"""Commands the runner prints for a user to paste into a POSIX shell (`mlflow ui
--backend-store-uri ...`, `python -m runner.replay ...`, "the same command with resume=auto
hydra.sweep.dir=..."), and the command a run records as typed (its `command` tag): every word
quoted where the shell would split or change it (a space, a quote, `$`, a bracket), so that a path
such as `/data/my runs/ü` pastes back as one word; a plain word stays as it is.

An override's value is quoted for Hydra's override grammar first where Hydra would not read it
unquoted (a space, a letter outside ASCII, `=`, a bracket: Hydra's "LexerNoViableAltException"),
then the whole override for the shell: "hydra.sweep.dir='multirun/ü 1'".

`say` prints a command's own output (a report's table, the pre-flight's) to a reader that may
have gone: `python -m runner.report | head` reads what it wants and closes the pipe.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Iterable

_HYDRA_PLAIN = re.compile(r"[A-Za-z0-9_./:+@%-]+")  # (a value Hydra reads unquoted, as it is)
# (a plain value Hydra reads as another type: null, a boolean, a number)
_HYDRA_TYPED = re.compile(
    r"(?i)null|true|false|[-+]?(inf|nan|[0-9.][0-9_]*(\.[0-9_]*)?(e[-+]?[0-9_]+)?)"
)
_DOUBLE_QUOTE_SAFE = re.compile(r'[^"$`\\!]*')  # (nothing a shell expands inside "...")


def word(text: str) -> str:
    """`text` as one word of a POSIX shell: as it is where nothing in it is special, in double
    quotes where it holds single quotes only (a quoted Hydra value), else in single quotes."""
    quoted = shlex.quote(text)
    if quoted == text:
        return text
    if "'" in text and _DOUBLE_QUOTE_SAFE.fullmatch(text):
        return f'"{text}"'
    return quoted


def join(words: Iterable[str]) -> str:
    """A command line of `words`, each quoted as `word` quotes it."""
    return " ".join(word(w) for w in words)


def hydra_value(value: str) -> str:
    """`value`, a string, as Hydra's override grammar reads it back: as it is where Hydra reads
    it unquoted as that string, else in single quotes (a quote escaped, and the backslashes
    before one or at the end: Hydra's only escapes). A `${` is escaped for OmegaConf, which
    would take it for an interpolation when the config is read."""
    if _HYDRA_PLAIN.fullmatch(value) and not _HYDRA_TYPED.fullmatch(value):
        return value
    escaped = re.sub(r"(\\*)'", lambda m: m[1] * 2 + "\\'", value.replace("${", "\\${"))
    return "'" + re.sub(r"(\\+)$", lambda m: m[1] * 2, escaped) + "'"


def override(key: str, value: str) -> str:
    """`key=value` as one shell word that sets the string `value` (a path) through Hydra's
    grammar."""
    return word(f"{key}={hydra_value(value)}")


def say(text: str = "", end: str = "\n") -> None:
    """Print `text` to stdout. Where its reader has gone (`| head` read what it wanted), stdout is
    pointed at /dev/null and the caller goes on: what it writes and logs after is written and
    logged, and no BrokenPipeError traceback ends it (nor one at the exit's flush)."""
    try:
        print(text, end=end, flush=True)
    except BrokenPipeError:
        reader_gone()


def reader_gone() -> None:
    """Point stdout at /dev/null, its reader gone (a BrokenPipeError met): nothing written to it
    from now on, the exit's flush included, fails."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
