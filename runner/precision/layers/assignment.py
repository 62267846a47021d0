"""The plan for one model (`assign`): each layer's format from the last entry matching it or a
module around it, else the level's, with what it should compute in (`Expect`); the refusals
that need the model (a glob matching nothing, fp8 on a layer that cannot run it, tied weights in
two types); and `LayerPlan.compare`, what ran where against the plan. See README.md beside this
file."""

from __future__ import annotations

import difflib
import fnmatch
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from runner.errors import ConfigError
from runner.precision.layers.findings import level_half
from runner.precision.layers.rules import DTYPES, FP8, LAYERS_KEY, SHORT, LayerRule, plan_yaml
from runner.precision.properties import Properties, dtype_name

ROOT_LABEL = "(model)"  # how the model itself (qualified name "") is shown


@dataclass(frozen=True)
class Expect:
    """What a layer should compute in: `compute` (the type of its output's arithmetic; fp8 for
    torchao's float8 GEMMs), the type of its own `weights`, and whether autocast decides per op
    (`autocast`: the level's own O1 layers; fp32 is then on plan too)."""

    compute: str
    weights: str
    autocast: bool = False

    def label(self) -> str:
        if self.autocast:
            return f"{self.compute} (autocast)"
        if self.compute != FP8 and self.weights != self.compute:
            return f"{self.compute} ({SHORT[self.weights]} weights)"
        return self.compute

    @property
    def weight_dtype(self) -> torch.dtype:
        return DTYPES[self.weights]

    @property
    def input_dtype(self) -> torch.dtype:
        """The type the layer's floating inputs are cast to at its boundary (a cast level)."""
        return DTYPES[self.weights] if self.compute == FP8 else DTYPES[self.compute]


def param_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The plan's layers: modules that own parameters themselves, by qualified name ("" for the
    model itself), in module order."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if any(True for _ in m.parameters(recurse=False))
    ]


def _label(name: str) -> str:
    return name or ROOT_LABEL


def fp8_ineligible(module: nn.Module) -> Optional[str]:
    """Why torchao's float8 training cannot convert `module` (None: it can)."""
    from runner.precision.fp8 import FP8_DIVISOR

    if type(module) is not nn.Linear:
        return f"{type(module).__name__}, not an nn.Linear"
    sizes = [
        f"{label} {n}"
        for label, n in (("in_features", module.in_features), ("out_features", module.out_features))
        if n % FP8_DIVISOR
    ]
    if sizes:
        return f"{', '.join(sizes)} not a multiple of {FP8_DIVISOR}"
    return None


def level_expect(p: Properties, module: nn.Module, root: bool = False) -> tuple[Expect, str]:
    """What the level alone makes `module` compute in, and why (for the audit's `why`)."""
    half = level_half(p)
    if p.fp8_linear is not None and not root and fp8_ineligible(module) is None:
        weights = dtype_name(p.cast_model_type) if p.casts_to_half else "float32"
        return Expect(FP8, weights), f"the level: fp8_linear={p.fp8_linear}"
    if p.casts_to_half:
        cast = dtype_name(p.cast_model_type)
        if p.keep_batchnorm_fp32 and isinstance(module, _BatchNorm):
            return Expect(cast, "float32"), "the level: keep_batchnorm_fp32"
        return Expect(cast, cast), f"the level: {p.opt_level} casts the model to {cast}"
    if p.autocasts and half is not None:
        return Expect(
            dtype_name(half), "float32", autocast=True
        ), f"the level: {p.opt_level} autocast ({dtype_name(half)})"
    return Expect("float32", "float32"), f"the level: {p.opt_level} (fp32)"


def rule_expect(p: Properties, fmt: str) -> Expect:
    """What an entry's format makes a layer compute in at level `p` (its checks passed). Under
    autocast, a 16-bit entry runs its module in a local autocast of that type, which decides per
    op as the level's does (a norm may stay fp32)."""
    weights = dtype_name(p.cast_model_type) if p.casts_to_half else "float32"
    if fmt == FP8:
        return Expect(FP8, weights)
    if fmt == "float32":
        return Expect("float32", "float32")
    if p.casts_to_half:
        return Expect(fmt, fmt)
    return Expect(fmt, "float32", autocast=True)


@dataclass
class PlannedLayer:
    """One layer's plan: what the level makes of it, the entry that decides it (None: the
    level), and what it is expected to compute in."""

    name: str
    module: str  # the module's class name
    level: Expect
    level_why: str
    rule: Optional[LayerRule] = None
    expect: Expect = None  # type: ignore[assignment]  (set by assign)
    inside: str = ""  # the layer whose forward computes with this one's weights (set by assign)

    @property
    def label(self) -> str:
        return _label(self.name)

    @property
    def planned(self) -> str:
        return self.expect.label()

    @property
    def why(self) -> str:
        if self.rule is None:
            return self.level_why
        return self.rule.origin() + (f": {self.rule.why}" if self.rule.why else "")


@dataclass
class LayerPlan:
    """The plan for one model: every layer with what it is expected to compute in, and the
    modules the entries matched with the format each runs under (`regions`)."""

    layers: list[PlannedLayer]
    rules: tuple[LayerRule, ...] = ()
    regions: dict[str, str] = field(default_factory=dict)  # matched module name -> format
    strict: bool = False  # an off-plan layer stops the run (precision.strict)

    def __iter__(self):
        return iter(self.layers)

    def get(self, name: str) -> Optional[PlannedLayer]:
        return next((layer for layer in self.layers if layer.name == name), None)

    @property
    def deviates(self) -> bool:
        """Whether an entry makes any layer compute other than the level would."""
        return any(layer.rule is not None and layer.expect != layer.level for layer in self.layers)

    def formats(self) -> dict[str, str]:
        """{layer: planned format} (what a checkpoint keeps, and what the digest covers)."""
        return {layer.label: layer.planned for layer in self.layers}

    def digest(self) -> str:
        """A short hash of every layer's planned format: runs with the same plan share it."""
        text = "\n".join(f"{k}\t{v}" for k, v in self.formats().items())
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def fp8_layers(self) -> list[str]:
        return [layer.name for layer in self.layers if layer.expect.compute == FP8]

    def counts(self) -> dict[str, int]:
        """How many layers are planned in each format (fp32, bf16, fp16, fp8)."""
        out = {short: 0 for short in SHORT.values()}
        for layer in self.layers:
            out[SHORT[layer.expect.compute]] += 1
        return out

    def weight_dtypes(self, model: nn.Module) -> dict[int, torch.dtype]:
        """{id(module): the type of its own parameters} for every layer an entry decides."""
        out = {}
        for layer in self.layers:
            if layer.rule is not None:
                out[id(model.get_submodule(layer.name))] = layer.expect.weight_dtype
        return out

    def table(self) -> str:
        """Layer | module | planned | why: printed by a dry run and logged with the run."""
        return text_table(
            ("layer", "module", "planned", "why"),
            [(layer.label, layer.module, layer.planned, layer.why) for layer in self.layers],
        )

    def yaml(self, header: Sequence[str] = ()) -> str:
        """The layers an entry decides, by their exact names, as a plan file a later run can take
        as `precision.layer_plan` (the others follow the level): the artifact
        `layers/layer_plan.yaml`."""
        rules = [
            LayerRule(exact_glob(layer.name), layer.rule.format, why=layer.why)
            for layer in self.layers
            if layer.rule is not None and layer.name
        ]
        return plan_yaml(rules, [*header, "layers not listed here compute as the level makes them"])

    # ---- what ran where ---------------------------------------------------------------------
    def compare(self, observations: Iterable[Any]) -> list[dict[str, Any]]:
        """One row per layer (the `layers_ran.csv` fields): planned and observed formats, the
        dtypes seen, whether it ran off plan and why it was planned so. `observations` are the
        audit's (`runner.measure.audit.Observation`: layer, called, fp8, inputs, weights,
        outputs, grads, computed)."""
        seen = {o.layer: o for o in observations}
        called = [name for name, o in seen.items() if o.called]
        rows = []
        for layer in self.layers:
            obs = seen.get(layer.name)
            # a module whose own layers ran (an encoder that owns a position table): its output
            # is theirs, so its own weights are what it is judged by
            outer = any(_within(n, layer.name) and n != layer.name for n in called)
            off, note = _off_plan(layer, obs, weights_only=outer or not layer.name)
            observed = obs.computed if obs is not None else "not observed"
            if (outer or not layer.name) and obs is not None and obs.called:
                # its own weights' type: what its output says is its inner layers' (or, for the
                # model itself, the output cast's)
                observed = obs.weights[0] if obs.weights else "none"
                note = note or "judged by its own weights (its output is its inner layers')"
            rows.append(
                {
                    "layer": layer.label,
                    "module": layer.module,
                    "planned": layer.planned,
                    "observed": observed,
                    "inputs": _dtypes(obs.inputs) if obs is not None else "",
                    "weights": _dtypes(obs.weights) if obs is not None else "",
                    "outputs": _dtypes(obs.outputs) if obs is not None else "",
                    "grads": _dtypes(obs.grads) if obs is not None else "",
                    "off_plan": off,
                    "note": note,
                    "why": layer.why,
                }
            )
        return rows


def exact_glob(name: str) -> str:
    """A module name as a glob that matches exactly it ([*], [?], [[] for fnmatch's specials)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def text_table(heads: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligned columns under `heads`; the last column is not padded."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(heads[:-1])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    lines = [fmt.format(*heads), fmt.format(*("-" * w for w in widths), "-" * 3)]
    return "\n".join(lines + [fmt.format(*row) for row in rows])


def _dtypes(names: Sequence[str]) -> str:
    return " ".join(dict.fromkeys(names)) if names else "-"


def _off_plan(layer: PlannedLayer, obs: Any, weights_only: bool = False) -> tuple[bool, str]:
    """Whether the observed layer ran off plan, and what differed (`weights_only`: its output is
    its inner layers', judged by themselves)."""
    expect = layer.expect
    if obs is None:
        return False, "not observed"
    if not obs.called:
        if layer.inside:  # (its parent's forward computed with its weights, in the same plan)
            wrong = sorted({w for w in obs.weights if w != expect.weights})
            if wrong:
                return True, f"weights in {', '.join(wrong)}, planned {expect.weights}"
            return False, f"computed inside {_label(layer.inside)}'s forward, with its weights"
        if layer.rule is not None and expect != layer.level:
            return True, (
                f"its forward never ran (its parent uses its weights directly), so the "
                f"entry's {expect.compute} did not apply to its computation"
            )
        return False, "its forward did not run in this step (its parent may use its weights)"
    problems = []
    if weights_only:  # (the model's own outputs come back as fp32: the IO cast)
        pass
    elif expect.compute == FP8:
        if not obs.fp8:
            problems.append(f"computed in {obs.computed}, not torchao's fp8")
    elif obs.fp8:
        problems.append("converted to torchao's fp8")
    else:
        allowed = {expect.compute, "float32"} if expect.autocast else {expect.compute}
        if obs.outputs and obs.computed not in allowed:
            problems.append(f"computed in {obs.computed}, planned {expect.compute}")
    if expect.compute != FP8:  # (a Float8Linear's weight follows the model's type)
        wrong = sorted({w for w in obs.weights if w != expect.weights})
        if wrong:
            problems.append(f"weights in {', '.join(wrong)}, planned {expect.weights}")
    return bool(problems), "; ".join(problems)


def _closest(pattern: str, names: Sequence[str], model: nn.Module) -> str:
    """The module names closest to a glob that matched none (difflib, on the pattern without its
    wildcards too), else the model's top-level modules."""
    named = [n for n in names if n]
    plain = pattern.replace("*", "").replace("?", "").strip(".")
    close = list(
        dict.fromkeys(
            difflib.get_close_matches(pattern, named, n=5, cutoff=0.5)
            + difflib.get_close_matches(plain, named, n=5, cutoff=0.5)
            + [n for n in named if plain and n.rsplit(".", 1)[-1] in plain.split(".")][:5]
        )
    )[:5]
    if close:
        return "closest module names: " + ", ".join(close)
    top = [n for n, _ in model.named_children()]
    return f"{type(model).__name__}'s top-level modules: {', '.join(top[:12]) or '(none)'}"


def _within(name: str, region: str) -> bool:
    return region == "" or name == region or name.startswith(region + ".")


def _enclosing(name: str) -> set[str]:
    """The qualified names of a module and of every module around it ("" the model)."""
    parts = name.split(".") if name else []
    return {"", *(".".join(parts[:i]) for i in range(1, len(parts) + 1))}


def assign(model: nn.Module, rules: Sequence[LayerRule], p: Properties) -> LayerPlan:
    """The plan for `model` (as built, before fp8 conversion and the cast): each layer's format
    from the last entry that matches it or a module around it, else the level's. Raises
    ConfigError naming the entry's key for a glob that matches no module, or only modules
    without parameters, for fp8 on a layer that cannot run it, and for tied weights planned in
    two types. Rules about formats and levels are `rule_findings`' (checked before)."""
    names = [n for n, _ in model.named_modules()]
    layers = [
        PlannedLayer(name, type(m).__name__, *level_expect(p, m, root=(m is model)))
        for name, m in param_layers(model)
    ]
    # each module's enclosing modules, itself included: a rule that matches any of them decides it
    around = {n: _enclosing(n) for n in names}
    matches: list[set[str]] = []
    for rule in rules:
        matched = {n for n in names if fnmatch.fnmatchcase(n, rule.pattern)}
        if not matched:
            raise ConfigError(
                rule.key,
                f"'{rule.pattern}' ({rule.where()}) matches no module of "
                f"{type(model).__name__}; {_closest(rule.pattern, names, model)}",
                "a glob over the qualified module names (model.named_modules()), "
                "e.g. head, blocks.*.attn.*, *norm*",
            )
        covered = [layer for layer in layers if not matched.isdisjoint(around[layer.name])]
        if not covered:
            listed = [n for n in names if n in matched]
            shown = ", ".join(listed[:5]) + (
                f" and {len(listed) - 5} more" if len(listed) > 5 else ""
            )
            raise ConfigError(
                rule.key,
                f"'{rule.pattern}' ({rule.where()}) matches only modules "
                f"without parameters ({shown}): they compute in the type of their "
                "inputs, so the entry would change nothing",
                "a glob naming layers with weights, or a module around them",
            )
        for layer in covered:  # (a later entry wins)
            layer.rule = rule
        matches.append(matched)
    # the modules the entries name run in the format of the last entry that matches them or a
    # module around them
    regions: dict[str, str] = {}
    for n in names:
        if any(n in matched for matched in matches):
            owner = next(
                rule
                for rule, matched in zip(reversed(rules), reversed(matches))
                if not matched.isdisjoint(around[n])
            )
            regions[n] = owner.format
    for layer in layers:
        layer.expect = layer.level if layer.rule is None else rule_expect(p, layer.rule.format)
        if layer.rule is not None and layer.rule.format == FP8:
            why = (
                fp8_ineligible(model.get_submodule(layer.name))
                if layer.name
                else "the model itself"
            )
            if why is not None:
                raise ConfigError(
                    layer.rule.key,
                    f"'{layer.rule.pattern}' ({layer.rule.where()}) "
                    f"gives fp8 to {layer.label}, which cannot run in fp8: {why}",
                    "fp8 for nn.Linear layers whose sizes are multiples of 16; "
                    "give this layer another format with a later, more specific "
                    "entry",
                )
    _check_tied(model, layers)
    _mark_inner(model, layers)
    return LayerPlan(layers, tuple(rules), regions)


# modules whose forward computes with a child layer's weights without calling the child
# (torch's attention reads `out_proj.weight` in F.multi_head_attention_forward)
USES_CHILD_WEIGHTS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def _mark_inner(model: nn.Module, layers: Sequence[PlannedLayer]) -> None:
    """A layer whose parent computes with its weights without calling it (`out_proj` of an
    nn.MultiheadAttention) runs in its parent's format whatever an entry says: mark it (`inside`:
    the audit judges it by its weights) and refuse a plan that gives the two different formats (a
    cast level would stop at the first step on two weight types in one matmul; under autocast
    the entry would do nothing)."""
    by_name = {layer.name: layer for layer in layers}
    for name, parent in model.named_modules():
        if not isinstance(parent, USES_CHILD_WEIGHTS):
            continue
        outer = by_name.get(name)
        for child, _ in parent.named_children():
            inner = by_name.get(f"{name}.{child}" if name else child)
            if inner is None or outer is None:
                continue
            inner.inside = outer.name
            if inner.expect == outer.expect:
                continue
            culprit = inner if inner.rule is not None else outer
            rule = culprit.rule
            whole = (  # the entry's own glob for the attention, where it names the child
                rule.pattern.removesuffix(f".{child}")
                if rule is not None and rule.pattern.endswith(f".{child}")
                else exact_glob(outer.name)
            )
            raise ConfigError(
                rule.key if rule is not None else LAYERS_KEY,
                (f"'{rule.pattern}' ({rule.where()}) plans " if rule is not None else "")
                + f"{inner.label} as {inner.expect.label()} and {outer.label} as "
                f"{outer.expect.label()}, but {type(parent).__name__} computes with {child}'s "
                f"weights in its own forward ({child}'s forward never runs): they cannot differ",
                f"one format for {outer.label} and all in it: an entry '{whole}'",
            )


def _check_tied(model: nn.Module, layers: Sequence[PlannedLayer]) -> None:
    """A parameter shared by two layers (tied weights) has one type: refuse a plan that gives the
    two layers different weight types."""
    owner: dict[int, tuple[PlannedLayer, str]] = {}
    for layer in layers:
        module = model.get_submodule(layer.name)
        for pname, param in module.named_parameters(recurse=False):
            seen = owner.get(id(param))
            if seen is None:
                owner[id(param)] = (layer, pname)
            elif seen[0].expect.weights != layer.expect.weights:
                other = seen[0]
                culprit = layer if layer.rule is not None else other
                raise ConfigError(
                    culprit.rule.key if culprit.rule is not None else LAYERS_KEY,
                    f"{other.label}.{seen[1]} and {layer.label}.{pname} are one parameter (tied "
                    f"weights), but the plan gives {other.label} {other.expect.weights} weights "
                    f"and {layer.label} {layer.expect.weights} ones",
                    "the same format for both layers",
                )
