"""Which tunable settings the user gave in a file: trainer.tune never changes what a user wrote,
even where it wrote the default's value (`channels_last: false`), so the composed config alone
cannot tell (a value other than the default is seen there; the command line's keys are named in
the overrides).

The files read are those the run's composition picked that the user chose: the option a
`GROUP=NAME` override picks (an experiment file, a trainer option of the user's), the primary
config a `--config-name` names in a `--config-dir`, and the group options that primary config's
defaults list picks. Each is read as YAML (never run), at the package its `# @package` header
gives (`_global_`: the keys as written; none or `_group_`: under the group's path).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

_PACKAGE = re.compile(r"^\s*#\s*@package\s+(\S+)")
_ABSENT = object()
_OPTION = re.compile(r"^[A-Za-z_][\w/]*$")  # a group's path (`trainer`, `model/parts`)


def file_keys(keys: Iterable[str], overrides: Sequence[str]) -> set[str]:
    """Of `keys`, those set by a config file the user chose through `overrides` or as the
    primary config, whatever their values."""
    keys = list(keys)
    folders = search_folders()
    found: set[str] = set()
    chosen = [
        (group, _option_file(folders, group, option)) for group, option in _group_choices(overrides)
    ]
    primary = _primary_file(folders)
    if primary is not None:
        chosen.append((None, primary))
    for group, path in chosen:
        tree = _load(path)
        found |= _keys_in_tree(path, tree, group, keys)
        for inner, option in _defaults_choices(tree):  # (one level of defaults lists)
            found |= _keys_in(_option_file(folders, inner, option), inner, keys)
    return found


def search_folders() -> list[Path]:
    """The runner's config tree, then the folders Hydra searched (--config-dir)."""
    from runner.config.finder import config_dir

    folders = [config_dir()]
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            for source in HydraConfig.get().runtime.config_sources:
                if source.schema == "file" and Path(source.path) not in folders:
                    folders.append(Path(source.path))
    except (ImportError, ValueError, AttributeError):
        pass
    return folders


def _group_choices(overrides: Sequence[str]) -> list[tuple[str, str]]:
    """(group, option) for each `GROUP=NAME` / `+GROUP=NAME` override (not `a.b=value`)."""
    out = []
    for override in overrides:
        if "=" not in override or override.startswith("~"):
            continue
        key, value = (part.strip() for part in override.lstrip("+").split("=", 1))
        if _OPTION.match(key) and "." not in key and value and "," not in value:
            out.append((key, value))
    return out


def _primary_file(folders: Sequence[Path]) -> Optional[Path]:
    """The primary config's file where the user named one of their own (--config-name)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None
        name = HydraConfig.get().job.config_name
    except (ImportError, ValueError, AttributeError):
        return None
    if not name or name == "config":
        return None
    for folder in folders[1:]:  # (the runner's own tree holds only its own `config`)
        path = folder / f"{name.removesuffix('.yaml')}.yaml"
        if path.is_file():
            return path
    return None


def _defaults_choices(tree: Optional[DictConfig]) -> list[tuple[str, str]]:
    """(group, option) for each `- GROUP: NAME` (or `- override GROUP: NAME`) entry of a
    defaults list."""
    if tree is None or "defaults" not in tree:
        return []
    out = []
    for entry in tree.defaults or []:
        if isinstance(entry, DictConfig):
            for key, value in entry.items():
                group = str(key).removeprefix("override ").strip().lstrip("/")
                if isinstance(value, str) and _OPTION.match(group):
                    out.append((group, value))
    return out


def _option_file(folders: Sequence[Path], group: str, option: str) -> Optional[Path]:
    for folder in reversed(folders):  # (a user's folder before the runner's own)
        path = folder / group / f"{option}.yaml"
        if path.is_file():
            return path
    return None


def _load(path: Optional[Path]) -> Optional[DictConfig]:
    if path is None:
        return None
    try:
        tree = OmegaConf.load(path)
    except Exception:  # (a malformed file: Hydra's composition has said so already)
        return None
    return tree if isinstance(tree, DictConfig) else None


def _keys_in(path: Optional[Path], group: Optional[str], keys: Sequence[str]) -> set[str]:
    """Of `keys`, those the file at `path` sets, read at its package."""
    return _keys_in_tree(path, _load(path), group, keys)


def _keys_in_tree(
    path: Optional[Path], tree: Optional[DictConfig], group: Optional[str], keys: Sequence[str]
) -> set[str]:
    """_keys_in, the file at `path` already loaded as `tree`."""
    if tree is None:
        return set()
    package = group.replace("/", ".") if group else ""
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            match = _PACKAGE.match(line)
            if match:
                named = match.group(1)
                package = "" if named == "_global_" else package if named == "_group_" else named
                break
            if line.strip() and not line.lstrip().startswith("#"):
                break
    found = set()
    for key in keys:
        if package:
            if not key.startswith(package + "."):
                continue
            key_in_file = key[len(package) + 1 :]
        else:
            key_in_file = key
        if OmegaConf.select(tree, key_in_file, default=_ABSENT) is not _ABSENT:
            found.add(key)  # (set, whatever the value: null too)
    return found
