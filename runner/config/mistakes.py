"""A user's mistakes in composing the config, told in one line with the nearest right spelling.

Hydra (and OmegaConf beneath it) refuse an unknown option of a group, an unknown key and a value of
the wrong type while composing, before anything runs; their own messages list every option
without a suggestion, end with the config search path, and advise `+key=value` for a typo'd key
(which then fails again, as a key no schema declares). `explain` turns such an exception into a
ConfigError (exit 2 at the CLI) that names the group or key, what was given and the closest valid
choices, closest first; a case-insensitive match is named as such. The choices come from the
exception itself (a group's options over the whole search path, a `--config-dir` included; the
keys of the node that refused the key), so they are the choices of the config actually composed.
Single runs (`runner.__main__`) and a sweep's pre-flight (`runner.sweep`) use the same text.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any, Optional

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from runner.errors import ConfigError, RunnerError

SUGGESTIONS = 4  # at most this many "did you mean" choices
SIMILAR = 0.5  # difflib's ratio (of lower-cased names) a choice needs to be suggested ...
SPREAD = 0.3  # ... and no further than this below the closest choice's

_PRIMARY = ("config", "hydra/config")  # the defaults lists a command line's overrides act on


def closest(given: str, choices: Sequence[str], limit: int = SUGGESTIONS) -> list[str]:
    """The choices spelled most like `given`, closest first (ties in the choices' order): those
    similar enough and nearly as close as the closest (`model=resnet5`: resnet50, resnet18 and
    resnext50_32x4d, not densenet161)."""
    typed = given.lower()
    ratios = [(difflib.SequenceMatcher(None, typed, c.lower()).ratio(), c) for c in choices]
    ranked = sorted(ratios, key=lambda r: -r[0])
    if not ranked:
        return []
    floor = max(SIMILAR, ranked[0][0] - SPREAD)
    return [choice for ratio, choice in ranked[:limit] if ratio >= floor]


def did_you_mean(given: str, choices: Sequence[str], prefix: str = "") -> str:
    """'; did you mean a, b or c?' (each with `prefix`), or '' when nothing is close."""
    same = [c for c in choices if c.lower() == given.lower() and c != given]
    if same:
        match = f"{prefix}{same[0]}"
        return f"; did you mean {match} (a case-insensitive match: names are case-sensitive)?"
    near = [f"{prefix}{c}" for c in closest(given, [c for c in choices if c != given])]
    if not near:
        return ""
    listed = near[0] if len(near) == 1 else f"{', '.join(near[:-1])} or {near[-1]}"
    return f"; did you mean {listed}?"


def unknown_option(group: str, given: str, options: Sequence[str], where: str = "") -> ConfigError:
    """`group=given` names no config of the group (`where`: the config whose defaults list does)."""
    within = f" (in the defaults of {where})" if where else ""
    problem = f"unknown option {given!r}{within}{did_you_mean(given, options)}"
    return ConfigError(group, problem, list(options) or "no options: the group is empty")


def unknown_key(
    section: str, key: str, keys: Sequence[str], typed: bool = True, value: str | None = None
) -> ConfigError:
    """`section.key` is not a key of its node (`keys`: the node's keys). A typed node (a schema's)
    takes no other key, so a close key is suggested, never `+key`; an untyped one (a `_target_`'s
    arguments) takes new keys with `+`."""
    full = f"{section}.{key}" if section else key
    prefix = f"{section}." if section else ""
    problem = "unknown key" + did_you_mean(key, keys, prefix)
    if typed:
        return ConfigError(full, problem, list(keys))
    if problem == "unknown key":
        problem += f"; to add it: +{full}={'VALUE' if value is None else value}"
    return ConfigError(full, problem)


_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def expected(annotation: Any) -> str:
    """A field's type in words ('an integer', 'a number or null', ...)."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        words = [expected(a) for a in arguments if a is not type(None)]
        return " or ".join(words + (["null"] if type(None) in arguments else []))
    if origin in (list, tuple, Sequence) or annotation in (list, tuple):
        return "a list ([a,b])"
    if origin in (dict, Mapping) or annotation is dict:
        return "a mapping ({key:value})"
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return "one of " + ", ".join(m.name for m in annotation)
    return _WORDS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _field_type(schema: Any, key: str) -> Optional[str]:
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        return None
    try:
        hints = typing.get_type_hints(schema)
    except Exception:  # noqa: BLE001  (an annotation that does not resolve: say less)
        return None
    return expected(hints[key]) if key in hints else None


def wrong_type(key: str, value: Optional[str], expectation: str) -> ConfigError:
    """`key=value`, and the key takes another type."""
    given = "a value" if value is None else repr(value)
    return ConfigError(key, f"got {given}, expected {expectation}")


def _override_value(full_key: str, overrides: Sequence[str]) -> Optional[str]:
    """The value that `overrides` give `full_key`, as typed (the last one wins, as in Hydra)."""
    found = None
    for text in overrides:
        key, sign, value = text.partition("=")
        if sign and key.lstrip("+~") == full_key:
            found = value
    return found


def _set_whole(full_key: str, overrides: Sequence[str]) -> Optional[tuple[str, str]]:
    """(key, value) of an override without + that set a mapping above `full_key` whole
    (`precision.layers={head: float32}`), the last one; None where none did."""
    for text in reversed(overrides):
        key, sign, value = text.partition("=")
        if sign and key[:1] not in "+~" and full_key.startswith(f"{key}.") and value[:1] == "{":
            return key, value
    return None


def _split_key(cause: Any, full_key: str, overrides: Sequence[str]) -> Optional[ConfigError]:
    """Where an override's path went through a key of a mapping of plain values
    (`+precision.layers.blocks.0=fp8`: the path splits at every dot, and `blocks` cannot be a
    mapping), the override to write: the key whole, inside braces."""
    node = getattr(cause, "parent_node", None)
    if (
        not isinstance(cause, ValidationError)
        or node is None
        or OmegaConf.get_type(node) is not dict
    ):
        return None
    mapping = full_key.rpartition(".")[0]
    for text in reversed(overrides):
        key, sign, value = text.partition("=")
        bare = key.lstrip("+~")
        if sign and mapping and bare.startswith(f"{full_key}."):
            name = bare[len(mapping) + 1 :]
            return ConfigError(
                mapping,
                f"the key {name!r} holds dots, where an override's path splits (it made "
                f"{full_key} a mapping); give the key whole inside braces: "
                f"'+{mapping}={{{name}: {value}}}'",
            )
    return None


def _first_line(error: BaseException) -> str:
    message = getattr(error, "msg", None) or str(error)
    return message.strip().splitlines()[0] if message.strip() else type(error).__name__


def is_composition_error(error: BaseException) -> bool:
    """An error Hydra or OmegaConf raise for a config that does not compose."""
    return isinstance(error, (HydraException, OmegaConfBaseException))


def explain(error: BaseException, overrides: Sequence[str] = ()) -> RunnerError:
    """One message for a composition error (`overrides`: the command line's, for the value a key
    was given): a ConfigError naming the group or key, what was given and the closest choices;
    for any other Hydra error, Hydra's own message without its config search path."""
    cause = error.__cause__
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and error.options:
        group, _, given = error.missing_cfg_file.rpartition("/")
        where = re.match(r"In '([^']+)':", str(error))
        parent = where.group(1) if where and where.group(1) not in _PRIMARY else ""
        return unknown_option(group, given, error.options, parent)
    node = getattr(cause, "parent_node", None)
    full_key = getattr(cause, "full_key", None)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and node is not None and full_key:
        section, _, key = str(full_key).rpartition(".")
        keys = [str(k) for k in node.keys() if section or k != "hydra"]
        typed = dataclasses.is_dataclass(OmegaConf.get_type(node))
        whole = None if typed else _set_whole(str(full_key), overrides)
        if whole:  # (`precision.layers={head: float32}`: a mapping's new keys need +)
            mapping, value = whole
            name = str(full_key)[len(mapping) + 1 :]
            return ConfigError(
                mapping,
                f"{name!r} is a new key of {mapping}, which an override merges in with +: "
                f"'+{mapping}={value}'",
            )
        return unknown_key(section, key, keys, typed, _override_value(str(full_key), overrides))
    through = _split_key(cause, str(full_key or ""), overrides)
    if through:  # (`+precision.layers.blocks.0=fp8`: a key with a dot, split into a path)
        return through
    if isinstance(cause, ValidationError) and full_key:
        words = _field_type(getattr(cause, "object_type", None), str(getattr(cause, "key", "")))
        value = _override_value(str(full_key), overrides)
        if value is None:
            merged = re.search(r"override \S+?=(.*)$", str(error).splitlines()[0])
            value = merged.group(1) if merged else None
        return wrong_type(str(full_key), value, words or _first_line(cause))
    in_file = _FILE_KEY.search(str(error))
    if in_file:  # a key of an option file of one's own that its schema does not have
        file, key, schema, full_key = in_file.groups()
        keys = _schema_keys(schema)
        if keys is not None:
            section = full_key.rpartition(".")[0]
            named = unknown_key(section, key, keys)
            return ConfigError(named.key, f"{named.problem} (in {file}.yaml)", named.allowed)
    if isinstance(error, OverrideParseException):
        return unreadable_override(error)
    swept = re.match(
        r"(?:Ambiguous value for argument|Sweep parameters) '([^']+)'", str(error).strip()
    )
    if swept:
        return sweep_without_m(swept.group(1))
    placed = _PLACED.search(str(error))
    if placed:  # (an option file of a group that overrides the run's groups, not global)
        file, group, package = placed.groups()
        where = package.rpartition(".")[0] or package
        return ConfigError(
            where,
            f"{file}.yaml overrides /{group} in its defaults list, but the file's keys are placed "
            f"under {where!r}, its group: a file that sets the run's groups and keys starts with "
            "the line `# @package _global_`",
        )
    appended = re.match(r"Could not override '([^']+)'\. No match in the defaults list", str(error))
    if appended:
        group = appended.group(1)
        value = _override_value(group, overrides)
        return ConfigError(
            group, f"not in the defaults list; to add it: +{group}={value or 'OPTION'}"
        )
    return RunnerError(_hydra_text(error))


# an option file that overrides the run's groups in its defaults list from its own package
_PLACED = re.compile(r"In '([^']+)': Could not override '([^'@]+)@([^']+)'\.\s+Did you mean")
_FILE_KEY = re.compile(
    r"In '([^']+)': ConfigKeyError raised while composing config:\s*Key '([^']+)' not in "
    r"'(\w+)'\s*full_key: (\S+)"
)


def _schema_keys(name: str) -> Optional[list[str]]:
    """The fields of the schema dataclass `name` (TrainerConfig, PrecisionConfig, ...)."""
    from runner.config import schema
    from runner.config.precision import precision_schema

    found = precision_schema() if name == "PrecisionConfig" else getattr(schema, name, None)
    return [f.name for f in dataclasses.fields(found)] if dataclasses.is_dataclass(found) else None


_GRAMMAR = "https://hydra.cc/docs/1.2/advanced/override_grammar/basic"
_LEXER = "LexerNoViableAltException: "


def unreadable_override(error: OverrideParseException) -> RunnerError:
    """An override Hydra's grammar cannot read, in one line: the character it stopped at and,
    where the value is a plain value (not a list, a dict or a sweep function) that reads once
    quoted, the override quoted as the shell and Hydra both take it: `data.root=ü data` ->
    "data.root='ü data'"."""
    override, lines = str(error.override), str(error).splitlines()
    what = lines[0] if lines else ""  # (Hydra's words, where no character is found)
    stop = re.match(r"mismatched input '(.+)' expecting", what)
    if what.startswith(_LEXER) and len(lines) > 1 and "^" in lines[1]:
        at = lines[1].index("^") - len(_LEXER)
        if 0 <= at < len(override):
            what = f"it cannot take {override[at]!r} there"
    elif stop is not None:
        what = f"it cannot take {stop.group(1)!r} there"
    key, equals, value = override.partition("=")
    if equals and value and value[0] not in "[{'\"" and "(" not in value:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from runner import shell

        try:
            OverridesParser.create().parse_override(f"{key}={shell.hydra_value(value)}")
        except OverrideParseException:
            pass
        else:
            return RunnerError(
                f"{override}: Hydra's override grammar cannot read this value unquoted ({what}); "
                f"quote it: {shell.override(key, value)}"
            )
    return RunnerError(f"{override}: Hydra's override grammar cannot read it ({what}); {_GRAMMAR}")


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def _hydra_text(error: BaseException) -> str:
    """Hydra's message on one line (with its OmegaConf cause's first), without the search path."""
    text = _one_line(str(error).split("\nConfig search path:")[0])
    if isinstance(error.__cause__, OmegaConfBaseException):
        text += f": {_first_line(error.__cause__)}"
    return text or type(error).__name__


# groups that may sensibly select several options at once (an experiment's own sub-groups, the
# user's own groups of a --config-dir: not the runner's); Hydra's own and the schemas are apart
_ONE_OPTION_EXCEPT = ("experiment", "hydra", "schema")


def sweep_without_m(override: str) -> ConfigError:
    """`precision=o0,o2` (or `optimizer.lr=range(...)`) without `-m`: Hydra's message listed a
    list, a quoted string and `--multirun` (with the shell's `\\'` in its example) and named no
    key. The key, what it was given, and the sweep that runs each value in turn; for a key that
    is not a group, the quoted string too (a value that holds a comma)."""
    from runner import shell

    key, _, value = override.partition("=")
    name = key.lstrip("+~")
    string = ""
    numbers = all(re.fullmatch(r"[-+]?[\d.]+(e[-+]?\d+)?", v.strip()) for v in value.split(","))
    if name not in _groups() and not re.match(r"\w+\(", value) and not numbers:
        string = f"; a value that holds a comma, quoted: {shell.override(key, value)}"
    return ConfigError(
        name,
        f"got {value}, the values of a sweep, but the command runs once (it has no -m)",
        f"one value; to run each in turn, a sweep: python -m runner -m ... "
        f"{shell.word(override)}{string}",
    )


def _groups() -> set[str]:
    """The runner's config groups that take one option (`precision`, `model`, ...)."""
    from runner.config.finder import config_dir

    return {
        p.name for p in config_dir().iterdir() if p.is_dir() and p.name not in _ONE_OPTION_EXCEPT
    }


def check_one_option(overrides: Sequence[str]) -> None:
    """A group of the runner's given a list (`precision=[o1,o2]`) is refused (a ConfigError):
    Hydra composes each option in turn, the last one winning where they set the same keys, so
    `[o1,o2]` ran O2 and named no O1 anywhere, where the user meant a sweep."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    groups = _groups()
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException:
        return  # (Hydra refuses it with its own message)
    for override in parsed:
        if override.key_or_group not in groups or override.is_delete():
            continue
        value = override.value()
        if isinstance(value, list):
            options = [str(v) for v in value]
            raise ConfigError(
                override.key_or_group,
                f"got a list [{', '.join(options)}]: Hydra would merge these options, the "
                "last one winning, and run one",
                f"one option; to run each in turn, a sweep: "
                f"-m {override.key_or_group}={','.join(options)}",
            )
