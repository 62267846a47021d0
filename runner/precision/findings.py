"""What the precision rules say: a `Finding`, the `Resolution` that gathers them with the
properties, the `Context` a rule may look at, and `RuleSet`, the ordered list of rules.

The rules themselves live in `runner.precision.level_rules` (the combination of properties) and
`runner.precision.checks` (the machine, the model) and `runner.precision.optimizer_rules` (the
optimizer and its state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from runner.precision.recipe import Properties


@dataclass
class Finding:
    """One remark about a resolved configuration; `hint` says what to change."""

    level: Literal["info", "warning", "error"]
    property: str
    message: str
    hint: str = ""

    @property
    def key(self) -> str:
        """The config key to change: `precision.<property>`, or the property itself when it
        already names another group's key (`optimizer.eps`) or a whole group (`model`)."""
        if "." in self.property or self.property in _OTHER_GROUPS:
            return self.property
        return f"precision.{self.property}"

    def __str__(self) -> str:
        text = f"[{self.level}] {self.key}: {self.message}"
        return f"{text} ({self.hint})" if self.hint else text

    def describe(self) -> str:
        """The message with its hint, as a sentence of its own ("... implementation. Hint: use
        ..."), the way the findings table and a refused run say it."""
        if not self.hint:
            return self.message
        stop = "" if self.message.rstrip().endswith((".", "!", "?")) else "."
        return f"{self.message.rstrip()}{stop} Hint: {self.hint}"


_OTHER_GROUPS = ("model", "data", "optimizer", "scheduler", "trainer")


@dataclass
class Resolution:
    """What `resolve` returns: the properties to run with and every finding about them."""

    properties: Properties
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    @property
    def infos(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "info"]

    def summary(self) -> str:
        """Counts, e.g. "0 error, 2 warning, 1 info" (the `precision.findings` MLflow tag)."""
        return f"{len(self.errors)} error, {len(self.warnings)} warning, {len(self.infos)} info"

    def compact(self) -> str:
        """One line per run: "warning precision.cast_model_type; info model" (empty: none)."""
        return "; ".join(f"{f.level} {f.key}" for f in self.findings)

    def findings_table(self) -> str:
        """The findings as printed before training, by dry runs, and attached to the run."""
        if not self.findings:
            return "No findings: the precision properties are consistent."
        w = max(len("property"), *(len(f.key) for f in self.findings))
        lines = [f"{'level':<8} {'property':<{w}}  message"]
        for f in self.findings:
            lines.append(f"{f.level:<8} {f.key:<{w}}  {f.describe()}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Context:
    """What a rule may look at besides the properties; None where the caller does not know."""

    device: Any = None  # runner.precision.checks.DeviceInfo
    optimizer: Optional[Mapping[str, Any]] = None  # the optimizer config: name, eps, ...
    compiled: Optional[bool] = None  # whether the forward runs through torch.compile


# A rule looks at resolved properties and the context and yields findings.
Rule = Callable[[Properties, Context], Iterable[Finding]]


class RuleSet(list):
    """An ordered list of rules; decorating a function with the set appends it."""

    def __call__(self, fn: Rule) -> Rule:
        self.append(fn)
        return fn


def strict_finding(finding: Finding) -> Finding:
    """`finding` as `precision.strict=true` sees it: a warning becomes an error."""
    if finding.level != "warning":
        return finding
    hint = finding.hint + ("; " if finding.hint else "") + "an error because precision.strict=true"
    return Finding("error", finding.property, finding.message, hint)
