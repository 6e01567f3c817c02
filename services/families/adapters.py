"""PEFT LoRA adapters as every part of loraplane reads them: the registry validates an
upload by these rules (from the safetensors header alone) and a worker's engine loads an
adapter by the same ones, so an adapter the registry accepts is one the engine serves.

An adapter's config keys are classified like a model's (`LORA_KEYS`: what PEFT 0.21's
`LoraConfig` holds); its tensors are named by the family's description: which PEFT
module names a family has (`Family.lora`) and their shapes (`ModelConfig.lora_shape`).
Accepted beyond plain LoRA, as vLLM accepts: per-module ranks and alphas
(`rank_pattern`, `alpha_pattern`), LoRA on `embed_tokens` and `lm_head`, and
`modules_to_save` naming only those two (full replacement weights, as are the
`base_layer` copies PEFT saves beside embedding LoRA). DoRA and everything else that
changes the maths is refused by name.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .config import ModelConfig
from .description import HARMLESS, IMPLEMENTED, KeyRule, Refused

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

EMBED = "embed_tokens"
LM_HEAD = "lm_head"
SAVABLE = (EMBED, LM_HEAD)
"""The only modules an adapter may replace whole (`modules_to_save`)."""

LORA_KEYS: Mapping[str, KeyRule] = {
    "peft_type": Refused(("LORA",), "only LoRA adapters are served"),
    "r": IMPLEMENTED,
    "lora_alpha": IMPLEMENTED,
    "use_rslora": IMPLEMENTED,
    "target_modules": IMPLEMENTED,
    "layers_to_transform": IMPLEMENTED,
    "rank_pattern": IMPLEMENTED,
    "alpha_pattern": IMPLEMENTED,
    "modules_to_save": IMPLEMENTED,
    "base_model_name_or_path": IMPLEMENTED,
    "use_dora": Refused((False, None), "DoRA adapters are not served"),
    "bias": Refused(("none", None), "trained biases are not served (only bias='none')"),
    "lora_bias": Refused((False, None), "a bias on lora_B is not served"),
    "layer_replication": Refused((None, []), "layer replication is not served"),
    "exclude_modules": Refused((None, [], ""), "exclude_modules is not served"),
    "trainable_token_indices": Refused((None, [], {}),
                                       "trainable tokens (sparse embedding updates) are not "
                                       "served"),
    "alora_invocation_tokens": Refused((None, []), "activated LoRA is not served"),
    "use_qalora": Refused((False, None), "QA-LoRA is not served"),
    "target_parameters": Refused((None, []), "LoRA on parameters (MoE experts) is not served"),
    "use_bdlora": Refused((None, False), "block-diagonal LoRA is not served"),
    "megatron_config": Refused((None,), "Megatron-parallel LoRA is not served"),
    "velora_config": Refused((None,), "VeLoRA is not served"),
    "monteclora_config": Refused((None,), "MonteCLoRA is not served"),
    "arrow_config": Refused((None,), "Arrow routing is not served"),
    "kasa_config": Refused((None,), "KaSA is not served"),
    "ensure_weight_tying": Refused((False, None), "weight tying across adapted embeddings "
                                                  "is not served"),
    # training-time or bookkeeping only
    "task_type": HARMLESS,
    "auto_mapping": HARMLESS,
    "peft_version": HARMLESS,
    "revision": HARMLESS,
    "inference_mode": HARMLESS,
    "lora_dropout": HARMLESS,
    "fan_in_fan_out": HARMLESS,  # PEFT resets it to False for nn.Linear projections
    "init_lora_weights": HARMLESS,
    "layers_pattern": HARMLESS,  # where layers_to_transform looks; tensors are checked
    "megatron_core": HARMLESS,
    "loftq_config": HARMLESS,  # initialisation methods: the saved A and B are what counts
    "eva_config": HARMLESS,
    "corda_config": HARMLESS,
    "lora_ga_config": HARMLESS,
    "qalora_group_size": HARMLESS,
}
"""Every key of PEFT's `LoraConfig`, classified (tests/families walks them). A key PEFT
does not know is ignored, as PEFT itself ignores it when it loads the adapter."""


class AdapterRefused(ValueError):
    """An adapter loraplane does not serve; `field` or `tensor` names the culprit."""

    def __init__(self, message: str, *, field: str | None = None,
                 tensor: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.tensor = tensor


@dataclass(frozen=True)
class LoraSpec:
    """An adapter_config.json's rules, read and checked."""

    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...] | str
    """Module names, or PEFT's regex string (full match on the module path)."""
    layers: frozenset[int] | None
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    modules_to_save: tuple[str, ...] = ()
    declared_base: str | None = None
    """`base_model_name_or_path`: the model the adapter says it was trained on."""

    def rank_of(self, path: str) -> int:
        """A module's rank: PEFT's `get_pattern_key` (the first pattern `(.*\\.)?(p)$`
        matches the module path), else `r`."""
        return _pattern(self.rank_pattern, path, self.rank)

    def alpha_of(self, path: str) -> float:
        return _pattern(self.alpha_pattern, path, self.alpha)

    def scale_of(self, path: str) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA, per module."""
        r, alpha = self.rank_of(path), self.alpha_of(path)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    @property
    def max_rank(self) -> int:
        return max([self.rank, *(r for _, r in self.rank_pattern)])

    def covers(self, module: str, path: str) -> bool:
        """PEFT's target_modules semantics: regex full-match on the path if a string
        ("all-linear": every projection), else the module name or a path suffix."""
        if isinstance(self.targets, str):
            if self.targets == "all-linear":
                return module not in SAVABLE
            return re.fullmatch(self.targets, path) is not None
        return module in self.targets or any(path.endswith("." + t) for t in self.targets)


def _pattern(patterns: Iterable[tuple[str, Any]], path: str, default: Any) -> Any:
    for key, value in patterns:
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return default


def read_lora_config(raw: bytes | Mapping[str, Any]) -> LoraSpec:
    """Parse adapter_config.json and check every base-independent rule."""
    if isinstance(raw, bytes | bytearray):
        try:
            conf = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AdapterRefused(f"{CONFIG_FILE} is not valid JSON: {exc}",
                                 field="adapter_config") from exc
    else:
        conf = raw
    if not isinstance(conf, Mapping):
        raise AdapterRefused(f"{CONFIG_FILE} must be a JSON object", field="adapter_config")
    for key, value in conf.items():
        rule = LORA_KEYS.get(key)
        if isinstance(rule, Refused) and value not in rule.allowed:
            raise AdapterRefused(f"{CONFIG_FILE}: {key}={value!r} is not supported "
                                 f"({rule.why})", field=key)
    rank = conf.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise AdapterRefused(f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}",
                             field="r")
    alpha = conf.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise AdapterRefused(f"{CONFIG_FILE}: lora_alpha must be a number", field="lora_alpha")
    targets = conf.get("target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as exc:
            raise AdapterRefused(f"{CONFIG_FILE}: target_modules regex is invalid: {exc}",
                                 field="target_modules") from exc
        declared: tuple[str, ...] | str = targets
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        declared = tuple(targets)
    else:
        raise AdapterRefused(f"{CONFIG_FILE}: target_modules must be a non-empty list or a "
                             "regex string", field="target_modules")
    layers_raw = conf.get("layers_to_transform")
    layers: frozenset[int] | None = None
    if isinstance(layers_raw, int) and not isinstance(layers_raw, bool):
        layers = frozenset({layers_raw})
    elif isinstance(layers_raw, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                              for x in layers_raw):
        layers = frozenset(layers_raw)
    elif layers_raw is not None:
        raise AdapterRefused(f"{CONFIG_FILE}: layers_to_transform must be integers",
                             field="layers_to_transform")
    patterns = []
    for key, kind in (("rank_pattern", int), ("alpha_pattern", float)):
        raw_pattern = conf.get(key) or {}
        if not isinstance(raw_pattern, Mapping):
            raise AdapterRefused(f"{CONFIG_FILE}: {key} must be an object", field=key)
        items = []
        for pattern, value in raw_pattern.items():
            ok = isinstance(value, int) and value > 0 if kind is int else \
                isinstance(value, int | float) and math.isfinite(value)
            if isinstance(value, bool) or not ok:
                raise AdapterRefused(f"{CONFIG_FILE}: {key}[{pattern!r}] must be a "
                                     f"{'positive integer' if kind is int else 'number'}",
                                     field=key)
            try:
                re.compile(pattern)
            except re.error as exc:
                raise AdapterRefused(f"{CONFIG_FILE}: {key} key {pattern!r} is not a valid "
                                     f"regex: {exc}", field=key) from exc
            items.append((pattern, kind(value)))
        patterns.append(tuple(items))
    saved = conf.get("modules_to_save") or []
    if not isinstance(saved, list) or not all(isinstance(m, str) for m in saved):
        raise AdapterRefused(f"{CONFIG_FILE}: modules_to_save must be a list of names",
                             field="modules_to_save")
    others = sorted(set(saved) - set(SAVABLE))
    if others:
        raise AdapterRefused(f"{CONFIG_FILE}: modules_to_save {others} is not supported: only "
                             f"{list(SAVABLE)} may be replaced by an adapter",
                             field="modules_to_save")
    base = conf.get("base_model_name_or_path")
    if base is not None and (not isinstance(base, str) or len(base) > 512):
        raise AdapterRefused(f"{CONFIG_FILE}: base_model_name_or_path must be a name or path "
                             "of at most 512 characters", field="base_model_name_or_path")
    return LoraSpec(rank, float(alpha), bool(conf.get("use_rslora", False)), declared,
                    layers, patterns[0], patterns[1], tuple(dict.fromkeys(saved)), base or None)


# --- tensors ---------------------------------------------------------------------------------

_PREFIX = r"^(?:base_model\.model\.)?"
_LAYER = re.compile(_PREFIX + r"model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_(A|B)"
                    r"(?:\.[\w-]+)?\.weight$")
_EMBED = re.compile(_PREFIX + r"model\.embed_tokens\.lora_embedding_(A|B)(?:\.[\w-]+)?$")
_LM_HEAD = re.compile(_PREFIX + r"lm_head\.lora_(A|B)(?:\.[\w-]+)?\.weight$")
_SAVED = re.compile(_PREFIX + r"(model\.embed_tokens|lm_head)"
                    r"(?:\.modules_to_save(?:\.[\w-]+)?|\.base_layer)?\.weight$")


@dataclass(frozen=True)
class LoraTensor:
    """What one adapter tensor is."""

    layer: int
    """Decoder layer, or -1 for embed_tokens and lm_head."""
    module: str
    """A PEFT target module of the family, or "embed_tokens" / "lm_head"."""
    which: str
    """"A" or "B" of a LoRA pair, "W" for a whole replacement weight (modules_to_save),
    "base" for the copy of the base weight PEFT saves beside embedding LoRA (loading it
    replaces the base weight, and with tied embeddings both modules)."""

    path: str
    """The module's path as PEFT matches target_modules and patterns against it
    (`model.layers.3.self_attn.q_proj`, `model.embed_tokens`, `lm_head`)."""

    @property
    def key(self) -> tuple[int, str]:
        return self.layer, self.module


def module_path(layer: int, module: str, cfg: ModelConfig) -> str:
    """A target module's path in the model, as PEFT names it."""
    if module == LM_HEAD:
        return LM_HEAD
    if layer < 0:
        return "model." + module
    return f"model.layers.{layer}.{cfg.family.lora[module].path}"


def classify_tensor(name: str, spec: LoraSpec, cfg: ModelConfig) -> LoraTensor:
    """Name a tensor's role by the family's description, or refuse it by name."""
    fam = cfg.family
    if "lora_magnitude_vector" in name:
        raise AdapterRefused(f"tensor {name}: DoRA magnitude vectors are not supported",
                             tensor=name)
    m = _LAYER.match(name)
    if m is not None:
        layer, parent, module, which = int(m[1]), m[2], m[3], m[4]
        target = fam.lora.get(module)
        if target is None or target.path != f"{parent}.{module}":
            raise AdapterRefused(f"tensor {name} targets {parent}.{module}, which "
                                 f"{fam.title} models lack (their projections: "
                                 f"{list(fam.lora)})", tensor=name)
        if not 0 <= layer < cfg.num_hidden_layers:
            raise AdapterRefused(f"tensor {name} targets layer {layer}; the base model has "
                                 f"{cfg.num_hidden_layers}", tensor=name)
        t = LoraTensor(layer, module, which, module_path(layer, module, cfg))
        if not spec.covers(module, t.path):
            raise AdapterRefused(f"tensor {name} is not covered by target_modules "
                                 f"{_shown(spec.targets)}", tensor=name)
        if spec.layers is not None and layer not in spec.layers:
            raise AdapterRefused(f"tensor {name} is outside layers_to_transform "
                                 f"{sorted(spec.layers)}", tensor=name)
        return t
    for pattern, module in ((_EMBED, EMBED), (_LM_HEAD, LM_HEAD)):
        m = pattern.match(name)
        if m is not None:
            t = LoraTensor(-1, module, m[1], module_path(-1, module, cfg))
            if not spec.covers(module, t.path):
                raise AdapterRefused(f"tensor {name} is not covered by target_modules "
                                     f"{_shown(spec.targets)}", tensor=name)
            return t
    m = _SAVED.match(name)
    if m is not None:
        module = EMBED if m[1].endswith(EMBED) else LM_HEAD
        if ".base_layer." not in name and module not in spec.modules_to_save:
            raise AdapterRefused(f"tensor {name} replaces {module}, which modules_to_save "
                                 "does not name", tensor=name)
        path = module_path(-1, module, cfg)
        if ".base_layer." in name and not spec.covers(module, path):
            raise AdapterRefused(f"tensor {name} is a saved base layer of {module}, which "
                                 "target_modules does not adapt", tensor=name)
        return LoraTensor(-1, module, "base" if ".base_layer." in name else "W", path)
    raise AdapterRefused(f"tensor {name} is not a LoRA weight of a decoder-layer projection, "
                         "embed_tokens or lm_head, nor a module the adapter may save",
                         tensor=name)


def _shown(targets: tuple[str, ...] | str) -> str:
    return repr(targets) if isinstance(targets, str) else str(list(targets))


def tensor_shape(t: LoraTensor, spec: LoraSpec, cfg: ModelConfig) -> tuple[int, ...]:
    """The shape `t` must have: LoRA A [r, in] and B [out, r] (PEFT's embedding LoRA:
    A [r, vocab], B [hidden, r]); a replacement weight is the module's own [vocab, hidden]."""
    v, h = cfg.vocab_size, cfg.hidden_size
    if t.which in ("W", "base"):
        return (v, h)
    r = spec.rank_of(t.path)
    fin, fout = {EMBED: (v, h), LM_HEAD: (h, v)}.get(t.module) or cfg.lora_shape(t.module)
    return (r, fin) if t.which == "A" else (fout, r)


def check_targets(spec: LoraSpec, cfg: ModelConfig) -> None:
    """Refuse declared target modules the family does not have, naming them."""
    if isinstance(spec.targets, str):
        return
    fam = cfg.family
    unknown = [t for t in spec.targets
               if t.rsplit(".", 1)[-1] not in fam.lora and t.rsplit(".", 1)[-1] not in SAVABLE]
    if unknown:
        raise AdapterRefused(f"{CONFIG_FILE}: target_modules {sorted(unknown)} are not "
                             f"projections of {fam.title} models ({list(fam.lora)}, or "
                             f"{list(SAVABLE)})", field="target_modules")


def expected_pairs(spec: LoraSpec, cfg: ModelConfig,
                   present: Iterable[tuple[int, str]]) -> list[tuple[int, str]]:
    """Every (layer, module) the config says is adapted, so its A and B must be there: the
    declared projections on every transformed layer (a regex declares those present),
    embed_tokens and lm_head where declared."""
    fam = cfg.family
    present = set(present)
    layers = sorted(spec.layers) if spec.layers is not None else range(cfg.num_hidden_layers)
    if isinstance(spec.targets, str):
        modules = sorted({m for _, m in present if m in fam.lora},
                         key=list(fam.lora).index)
        extra = [(-1, m) for m in SAVABLE if (-1, m) in present]
    else:
        check_targets(spec, cfg)
        named = {t: t.rsplit(".", 1)[-1] for t in spec.targets}
        modules = [m for m in fam.lora if m in named.values()]
        extra = [(-1, m) for m in SAVABLE if m in named.values()]
    return [(layer, m) for m in modules for layer in layers] + extra


def tensor_name(layer: int, module: str, which: str, cfg: ModelConfig) -> str:
    """The name PEFT gives a LoRA tensor (for messages about a missing one)."""
    if module == EMBED:
        return f"base_model.model.model.embed_tokens.lora_embedding_{which}"
    if module == LM_HEAD:
        return f"base_model.model.lm_head.lora_{which}.weight"
    path = cfg.family.lora[module].path
    return f"base_model.model.model.layers.{layer}.{path}.lora_{which}.weight"
