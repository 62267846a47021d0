"""Commands printed for pasting (runner.shell): each word comes back from a real bash as it was,
and an override's value comes back from Hydra's own override parser as the string it was."""

from __future__ import annotations

import subprocess

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from runner import shell
from runner.tracking.store import ui_hint

AWKWARD = [
    "plain/path-1.2_x",
    "/tmp/my runs/ü",
    "it's",
    'say "hi"',
    "$HOME and `date` and !1",
    "/data/${oc.env:HOME}/${x}",
    "a\\b",
    "a\\",
    "a\\'b",
    "a,b",
    "x[1]",
    "a=b",
    "tab\there",
    "null",
    "true",
    "1e-3",
    "10",
    "-5",
    "nan",
    "2026-11-29/05-43-00",
    "",
]


def bash_words(command: str) -> list[str]:
    """The words bash makes of `command` (after `printf`), as it would pass them on."""
    out = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, check=True
    ).stdout
    return out.decode().split("\0")[:-1]


def test_every_word_comes_back_from_bash_as_it_was():
    assert bash_words(shell.join(AWKWARD)) == AWKWARD
    assert shell.join(["python", "-m", "runner", "precision=o0,o1"]) == (
        "python -m runner precision=o0,o1"  # (plain words stay as they are)
    )
    # a Hydra value quoted by the user is shown as typed
    assert shell.word("data.root='ü data/my set'") == "\"data.root='ü data/my set'\""


@pytest.mark.parametrize("value", [v for v in AWKWARD if v])
def test_an_override_sets_the_string_it_was_given(value):
    (word,) = bash_words(shell.override("hydra.sweep.dir", value))
    parsed = OverridesParser.create().parse_override(word)
    assert parsed.key_or_group == "hydra.sweep.dir"
    # (a string: "10" is not read back as the number 10; `${` is no interpolation)
    config = OmegaConf.create({"value": parsed.value()})
    assert isinstance(config.value, str) and config.value == value


def test_the_mlflow_ui_command_names_the_store_whatever_its_path():
    uri = "sqlite:////tmp/my runs/store ü/mlflow.db"
    command = ui_hint(uri, "1").splitlines()[0].removeprefix("See the runs with:  ")
    assert bash_words(command) == ["mlflow", "ui", "--backend-store-uri", uri]


def test_a_sweeps_overrides_come_back_from_its_tag():
    """A sweep parent's `sweep.overrides` tag gives back the overrides it was written from, one
    with a space in its value included (what `resume=auto` compares); a tag written before its
    words were quoted (joined with spaces) still reads as the same overrides."""
    from runner.sweep.resume import _tagged_overrides, overrides_tag

    overrides = ["precision=o0,o2", "data.root='/data/my set'", "+mlflow.tags.note='a, b'"]
    tag = overrides_tag(overrides)
    assert _tagged_overrides(tag, overrides) == set(overrides)
    assert _tagged_overrides(tag, overrides[:1]) == set(overrides)  # (what it says, not `now`)
    assert _tagged_overrides(" ".join(overrides), overrides) == set(overrides)
    assert _tagged_overrides("resume=auto precision=o0", ["precision=o0"]) == {"precision=o0"}
