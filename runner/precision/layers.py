"""Precision per layer: formats given by module name on top of the level, enforced on the model,
and compared afterwards with what each layer actually computed in ("what ran where").

**Rules.** `precision.layers` is an ordered mapping from a module-name glob to a format
(`float32`, `bfloat16`, `float16`, `fp8`); `precision.layer_plan` names a YAML file holding the
same mapping (or `auto`: `runner.run.autoplan` measures one before training). The file's entries
come first, then `precision.layers`; **a later entry wins**. A glob is matched against the
qualified module names (`fnmatch`, case-sensitive: `*` matches dots too, so `blocks.*.attn.*`
takes every attention projection); a module it matches gives the format to itself and to every
module inside it. The unit of the plan is the *layer*: a module that owns parameters itself (a
Linear, a convolution, a norm, an attention module with its own projection weights).

**What is refused, before any work** (ConfigError naming the key): a glob that matches no module
(with the closest names), a glob that matches only modules without parameters (they compute in
their inputs' type, so the entry would do nothing), fp8 for a layer that cannot run it (torchao's
float8 training converts `nn.Linear` layers whose sizes are multiples of 16), two layers that
share a parameter (tied weights) with different weight types, and a format the level cannot run
(`rule_findings`: fp32 at every level; the level's own 16-bit type; fp8 where `fp8_linear` could
run, i.e. bf16 compute with the weights updated in fp32).

**How a plan is enforced** (`enforce`, by the engine after the model is cast):
- O2/O3 (a cast model): each layer's own parameters are cast to its weight type
  (`LayerPlan.weight_dtypes`, in `casting.cast_module_`), and where any layer deviates from the
  level, every layer and every module an entry names casts its floating inputs to its compute type
  at its boundary (a forward pre-hook), so an fp32 layer computes in fp32 and the next bf16 layer
  gets bf16 again; the model's inputs are then cast by the layers themselves (not rounded to the
  16-bit type first), its outputs still come back as fp32.
- O1 (autocast): every module an entry names runs its forward inside a local autocast of its
  format (`enabled=False` for float32, with its floating inputs cast to fp32), so containers
  (`blocks.0.attn`) keep their functional ops (attention, GELU) in that format too.
- fp8: the engine converts exactly the plan's fp8 layers with torchao (`fp8.convert(only=...)`);
  under `fp8_linear` the eligible layers an entry gives another format stay as they are.

**What ran where** (`LayerPlan.compare`): the trainer's audit (`runner.measure.audit`) records, per
layer, the dtypes of its inputs, weights, outputs and weight gradients as the first training step
ran them; a layer is off plan when its output (its compute type; fp8 by torchao's module type) or
its weights differ from what the plan or the level expects. Under autocast a layer planned in the
16-bit type is on plan in that type or in fp32 (autocast decides per op: norms and reductions stay
fp32); one planned in fp32 must compute in fp32.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from runner.config import formats
from runner.config import precision as ptable
from runner.errors import ConfigError
from runner.precision.casting import cast_tensor, map_tensors
from runner.precision.dtypes import TORCH_DTYPES
from runner.precision.properties import Context, Finding, Properties, RuleSet, dtype_name

LAYERS_KEY = "precision.layers"
PLAN_KEY = "precision.layer_plan"
AUTO = ptable.AUTO_PLAN
FP8 = formats.FP8
DTYPES = TORCH_DTYPES
SHORT = formats.SHORT_NAMES
MAX_PLAN_BYTES = 16 * 2**20  # a plan file is a mapping of names: anything larger is not one
PLAN_FILE_KEYS = ("layers", "why", "about")  # the keys of a plan file's long form
ROOT_LABEL = "(model)"  # how the model itself (qualified name "") is shown


# ---- rules: where a format comes from ------------------------------------------------------------
@dataclass(frozen=True)
class LayerRule:
    """One entry: a module-name glob and its format, from `source` (`precision.layers`, a plan
    file's path, or `auto`), with the plan's reason for it where it has one."""

    pattern: str
    format: str
    source: str = LAYERS_KEY
    why: str = ""

    @property
    def key(self) -> str:
        """The config key an error about this entry names."""
        return f"{LAYERS_KEY}.{self.pattern}" if self.source == LAYERS_KEY else PLAN_KEY

    def origin(self) -> str:
        """Where the entry comes from, as a person reads it."""
        if self.source == LAYERS_KEY:
            return f"precision.layers['{self.pattern}']"
        if self.source == AUTO:
            return f"the auto plan ('{self.pattern}')"
        return f"{self.source}: '{self.pattern}'"

    def where(self) -> str:
        """`precision.layers` or `precision.layer_plan (plan.yaml)`, for messages."""
        return LAYERS_KEY if self.source == LAYERS_KEY else f"{PLAN_KEY} ({self.source})"

    def as_list(self) -> list[str]:
        """The rule as a checkpoint keeps it (plain values)."""
        return [self.pattern, self.format, self.source, self.why]

    @classmethod
    def from_list(cls, item: Sequence[Any]) -> LayerRule:
        pattern, fmt, source, why = (str(x) for x in item)
        return cls(pattern, ptable.parse_layer_format(LAYERS_KEY, fmt), source, why)


def config_rules(properties: Properties) -> list[LayerRule]:
    """`precision.layers` as rules, in order."""
    return [LayerRule(pattern, fmt) for pattern, fmt in properties.layers]


def load_plan_file(path: str | Path) -> list[LayerRule]:
    """The rules of a plan file (untrusted input: read as plain YAML, nothing in it runs), in
    order. Refused with a ConfigError naming `precision.layer_plan` and the file: missing,
    unreadable, not YAML, not a mapping of globs to formats, an unknown key."""
    import yaml

    p = Path(path).expanduser()
    where = f"the plan file {path}"
    if not p.is_file():
        raise ConfigError(
            PLAN_KEY,
            f"{where} does not exist (or is not a file)",
            "null, auto, or the path of a YAML file (python -m runner.diagnose "
            "... --plan plan.yaml writes one)",
        )
    if p.stat().st_size > MAX_PLAN_BYTES:
        raise ConfigError(
            PLAN_KEY,
            f"{where} is {p.stat().st_size} bytes: not a plan (at most {MAX_PLAN_BYTES} bytes)",
            "a YAML mapping of globs to formats",
        )
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(PLAN_KEY, f"{where} cannot be read: {error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(
            PLAN_KEY, f"{where} is not valid YAML: {' '.join(str(error).split())}"
        ) from None
    return parse_plan(data, str(path))


def parse_plan(data: Any, source: str) -> list[LayerRule]:
    """A plan's rules from its YAML data: either the mapping itself (`head: float32`), or the
    long form `{layers: {...}, why: {glob: reason}, about: ...}` that `plan_yaml` writes (where
    `layers: {}` is a plan that keeps every layer as the level makes it)."""
    where = f"the plan file {source}"
    if isinstance(data, Mapping) and isinstance(data.get("layers"), Mapping):
        unknown = [str(k) for k in data if k not in PLAN_FILE_KEYS]
        if unknown:
            raise ConfigError(
                PLAN_KEY,
                f"{where} has unknown key(s) {', '.join(unknown)}",
                ", ".join(PLAN_FILE_KEYS),
            )
        layers, why = data["layers"], data.get("why") or {}
        if not isinstance(why, Mapping):
            raise ConfigError(
                PLAN_KEY, f"{where}: 'why' must map globs to reasons, got {type(why).__name__}"
            )
    elif isinstance(data, Mapping):
        layers, why = data, {}
    else:
        raise ConfigError(
            PLAN_KEY,
            f"{where} holds {type(data).__name__ if data is not None else 'nothing'}"
            ", not a mapping of module-name globs to formats",
            "e.g. 'head: float32' on a line of its own",
        )
    if not layers and "layers" not in data:  # (`layers: {}` says it: the level everywhere)
        raise ConfigError(PLAN_KEY, f"{where} names no layer", "at least one 'glob: format' entry")
    rules = []
    for pattern, fmt in layers.items():
        if not isinstance(pattern, str) or not pattern.strip():
            raise ConfigError(
                PLAN_KEY, f"{where}: a module-name glob must be a non-empty string, got {pattern!r}"
            )
        pattern = pattern.strip()
        try:
            fmt = ptable.parse_layer_format(PLAN_KEY, fmt)
        except ConfigError as error:
            raise ConfigError(
                PLAN_KEY, f"{where}: '{pattern}': {error.problem}", error.allowed
            ) from None
        reason = why.get(pattern, "")
        rules.append(LayerRule(pattern, fmt, source, str(reason) if reason else ""))
    return rules


def plan_yaml(rules: Sequence[LayerRule], header: Sequence[str] = ()) -> str:
    """A plan file: `header` as comments, then `layers` (glob: format) and `why` (glob: reason,
    where a rule has one). `load_plan_file` reads it back to the same rules."""
    import yaml

    body: dict[str, Any] = {"layers": {r.pattern: r.format for r in rules}}
    why = {r.pattern: r.why for r in rules if r.why}
    if why:
        body["why"] = why
    lines = [f"# {line}" if line else "#" for line in header]
    text = yaml.safe_dump(body, sort_keys=False, allow_unicode=True, width=100)
    return "\n".join(lines + [text]) if lines else text


# ---- rules about the formats and the level (before the model exists) ----------------------------
LAYER_RULES = RuleSet()


def level_half(p: Properties) -> Optional[torch.dtype]:
    """The 16-bit type the level computes in: the cast model's, O1's autocast type, or None."""
    if p.casts_to_half:
        return p.cast_model_type
    if p.autocasts:
        return p.autocast_dtype
    return None


def fp8_refusal(p: Properties) -> Optional[tuple[str, str]]:
    """Why fp8 Linear layers cannot run at this level, with the fix; None when they can: bf16
    compute (O1 bf16 autocast, or a bf16 model) with the weights updated in high precision (an
    fp32 model, or fp32 master weights): torchao's float8 training."""
    if torch.float16 in p.compute_dtypes:
        return (
            "torchao's float8 training runs the rest of the model in bfloat16 or fp32 (its "
            "scaled fp8 GEMMs output bf16), not fp16",
            "use precision=o1_bf16 or o2_bf16 (or the fp8 presets o1_fp8 / o2_fp8)",
        )
    if p.opt_level == "O0" or not p.compute_dtypes:
        return (
            "O0 computes in fp32: it is the baseline the other levels are compared with",
            "use precision=o1_bf16 or o2_bf16 with fp8 layers",
        )
    if p.casts_to_half and not p.uses_master_weights:
        return (
            "fp8 training needs the weights updated in high precision (fp32 masters, or an "
            "fp32 model), and this level keeps no masters",
            "use precision=o2_bf16 (fp32 master weights) or o1_bf16",
        )
    return None


@LAYER_RULES
def _formats_for_level(p: Properties, ctx: Any, rules: Sequence[LayerRule]) -> Iterable[Finding]:
    """Each entry's format must be one the level can run: fp32 anywhere, the level's own 16-bit
    type (one 16-bit type per run: the loss scaling and the master weights are set for it), and
    fp8 where torchao's float8 training can run."""
    half = level_half(p)
    for rule in rules:
        fmt = rule.format
        if fmt == "float32":
            continue
        if fmt == FP8:
            refusal = fp8_refusal(p)
            if refusal is not None:
                yield Finding(
                    "error",
                    rule.key,
                    f"'{rule.pattern}': fp8 under {p.opt_level}{_of_source(rule)}: {refusal[0]}",
                    refusal[1],
                )
            continue
        if half is None:
            yield Finding(
                "error",
                rule.key,
                f"'{rule.pattern}': {fmt} under {p.opt_level}{_of_source(rule)}: this "
                "level computes in fp32 everywhere (the baseline), so no layer can be "
                "16-bit",
                f"use a {fmt} level (precision=o1_bf16, o2_bf16, ...) with fp32 layers where needed"
                if fmt == "bfloat16"
                else "use an fp16 level (precision=o1, o2) with fp32 layers where needed",
            )
        elif DTYPES[fmt] != half:
            yield Finding(
                "error",
                rule.key,
                f"'{rule.pattern}': {fmt} in a {dtype_name(half)} run"
                f"{_of_source(rule)}: one 16-bit type per run (its loss scaling and "
                "master weights are set for it)",
                f"float32 or {dtype_name(half)} for this layer, or a {fmt} level",
            )


@LAYER_RULES
def _fp8_layers_device(p: Properties, ctx: Any, rules: Sequence[LayerRule]) -> Iterable[Finding]:
    """fp8 entries need what fp8_linear needs (its own rule covers a level with fp8_linear)."""
    fp8_rules = [r for r in rules if r.format == FP8]
    if not fp8_rules or p.fp8_linear is not None or fp8_refusal(p) is not None:
        return
    import importlib.util

    from runner.precision.checks import FP8_MIN_CAPABILITY

    key = fp8_rules[0].key
    if importlib.util.find_spec("torchao") is None:
        yield Finding(
            "error",
            key,
            "fp8 layers need torchao, which is not installed",
            'pip install "amp-runner[fp8]" (torchao)',
        )
    device = getattr(ctx, "device", None)
    if device is None:
        return
    if device.type == "cpu":
        yield Finding(
            "info",
            key,
            "fp8 on a CPU is emulated (torchao's emulate mode): the "
            "numerics of fp8 training, no speed-up",
            "",
        )
    elif (
        device.type == "cuda"
        and device.capability is not None
        and device.capability < FP8_MIN_CAPABILITY
    ):
        yield Finding(
            "error",
            key,
            f"fp8 layers on {device.describe()}: fp8 Tensor Cores need "
            "compute capability 8.9 (Ada) or 9.0 (Hopper) or newer",
            "give these layers bfloat16 (or float32) on this GPU",
        )


@LAYER_RULES
def _auto_at_o0(p: Properties, ctx: Any, rules: Sequence[LayerRule]) -> Iterable[Finding]:
    if p.layer_plan == AUTO and level_half(p) is None:
        yield Finding(
            "info",
            PLAN_KEY,
            f"layer_plan=auto under {p.opt_level}: the level computes "
            "in fp32 everywhere, so the plan can only keep every layer in fp32",
            "plan for a 16-bit level (precision=o2_bf16 precision.layer_plan=auto)",
        )


def _of_source(rule: LayerRule) -> str:
    return "" if rule.source == LAYERS_KEY else f" ({rule.origin()})"


def rule_findings(p: Properties, rules: Sequence[LayerRule], ctx: Any = None) -> list[Finding]:
    """Every finding about `rules` (the plan file's and `precision.layers`) at level `p` on the
    context's device (a `properties.Context`; None: unknown)."""
    ctx = ctx if ctx is not None else Context()
    return [f for rule in LAYER_RULES for f in rule(p, ctx, rules)]


# ---- the plan for one model ----------------------------------------------------------------------
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
    return LayerPlan(layers, tuple(rules), regions)


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


# ---- enforcement -------------------------------------------------------------------------------
def _cast_inputs(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook (with kwargs) body: floating inputs to `dtype`."""
    cast = functools.partial(cast_tensor, dtype=dtype)
    return map_tensors(args, cast), map_tensors(kwargs, cast)


def _autocast_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A module's forward inside a local autocast of its planned format (O1): `enabled=False`
    with the floating inputs cast to fp32 for float32, else autocast in that type. Bound to the
    module as its `forward` (a deep copy rebinds it to the copy)."""
    device_type, dtype, forward = self._amp_runner_layer
    if dtype is None:
        args, kwargs = _cast_inputs(torch.float32, self, args, kwargs)
        with torch.autocast(device_type, enabled=False):
            return forward(*args, **kwargs)
    with torch.autocast(device_type, dtype=dtype):
        return forward(*args, **kwargs)


@dataclass
class Enforcement:
    """What `enforce` installed: the input-cast hooks and the wrapped forwards; `remove()` takes
    them off again."""

    handles: list[RemovableHandle] = field(default_factory=list)
    wrapped: list[nn.Module] = field(default_factory=list)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        for module in self.wrapped:
            if "forward" in module.__dict__:
                del module.forward
            if "_amp_runner_layer" in module.__dict__:
                del module._amp_runner_layer
        self.wrapped = []


def enforce(model: nn.Module, plan: LayerPlan, p: Properties, device_type: str) -> Enforcement:
    """Make `model` (converted to fp8 and cast already) compute as `plan` says: on a cast level,
    where the plan deviates from the level, every layer and every module an entry names casts its
    inputs to its compute type; under autocast, every module an entry names runs its forward in
    a local autocast of its format. See the module docstring."""
    out = Enforcement()
    if p.casts_to_half:
        if not plan.deviates:
            return out
        # (the model itself casts its inputs only where an entry names it: its layers cast
        # their own, so an fp32 first layer sees the inputs unrounded)
        targets: dict[str, torch.dtype] = {
            layer.name: layer.expect.input_dtype for layer in plan.layers if layer.name
        }
        for name, fmt in plan.regions.items():
            targets.setdefault(name, DTYPES[fmt] if fmt != FP8 else p.cast_model_type)
        for name, dtype in targets.items():
            module = model.get_submodule(name)
            out.handles.append(
                module.register_forward_pre_hook(
                    functools.partial(_cast_inputs, dtype), with_kwargs=True
                )
            )
        return out
    if p.autocasts:
        half = level_half(p)
        for name, fmt in plan.regions.items():
            module = model.get_submodule(name)
            if module is model and fmt != "float32":
                continue  # the whole model in the level's autocast: nothing to change
            dtype = None if fmt == "float32" else (half if fmt == FP8 else DTYPES[fmt])
            module._amp_runner_layer = (device_type, dtype, module.forward)
            module.forward = _autocast_forward.__get__(module, type(module))
            out.wrapped.append(module)
    return out
