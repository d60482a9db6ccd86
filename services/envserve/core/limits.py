"""Operator limits on session configs: per env and key, JSON Schema keywords that replace the
built-in bounds of EnvSpec.config_bounds (core/session.py's full_spec merges them).

Callers choose config values within bounds; the replica's operator sets the bounds. A limits file
(`envserve serve --config-limits FILE`, JSON, or YAML where PyYAML is installed) maps an env id,
or "*" for the session keys every env has (core/session.py's COMMON_CONFIG_DOCS), to keys and
their keywords:

    {"sokoban": {"dim_room": {"maximum": 12}},
     "svg": {"svg_dir": {"enum": ["", "/data/icons"]}},
     "*": {"image_size": {"maximum": 512}}}

A keyword given replaces the built-in one of the same name; the others stay; null removes a
built-in one (`{"svg_dir": {"enum": null, "maxLength": 4096}}` allows any folder: for a replica whose
callers are all trusted). "default" changes the key's default too. An env's own entry wins over "*". An unknown env id, key or keyword is an error
when the file is read, as is a bound that refuses the key's default: a typo must not leave a bound
unenforced, and a default out of bounds would refuse every Open.

The limits are process-wide: the front installs them at start (install), and passes them to each
worker process, which installs them too, so both check a config against the same bounds.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

COMMON = "*"
# The keywords an operator may set. Not "type": a key's type is its env's (its default's).
KEYWORDS = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "enum", "const", "minLength", "maxLength", "pattern",
    "minItems", "maxItems", "items", "minProperties", "maxProperties", "properties",
    "additionalProperties", "propertyNames", "default",
})

Limits = dict[str, dict[str, dict[str, Any]]]

_installed: Limits = {}
_generation = 0


class LimitsError(ValueError):
    """A limits file or mapping that cannot be used; the message is one line naming the entry."""


def generation() -> int:
    """Changes at every install: what a cache of specs built with the limits keys on."""
    return _generation


def installed() -> Limits:
    """The limits of this process ({} until install)."""
    return _installed


def install(limits: "Mapping[str, Any] | None", check: bool = False, env_ids: Iterable[str] = ()) -> Limits:
    """Makes limits this process's own (None or {}: the built-in bounds only). With check, the env
    ids and keys are looked up in the registry first (check_limits, '*' checked against the envs
    of env_ids too), as a replica's front does at start; its workers, given limits the front
    checked, only install them."""
    global _installed, _generation
    parsed = parse(limits or {})
    if check:
        check_limits(parsed, env_ids)
    _installed = parsed
    _generation += 1
    return parsed


def parse(data: Any, source: str = "config limits") -> Limits:
    """The limits as {env id: {key: {keyword: value}}}, their shape checked (no registry lookup)."""
    if not isinstance(data, Mapping):
        raise LimitsError(f"{source}: must map env ids (or '*') to keys, got {type(data).__name__}")
    out: Limits = {}
    for env_id, keys in data.items():
        if not isinstance(env_id, str) or not env_id:
            raise LimitsError(f"{source}: env ids are non-empty strings, got {env_id!r}")
        if not isinstance(keys, Mapping):
            raise LimitsError(f"{source}: {env_id}: must map config keys to JSON Schema keywords")
        out[env_id] = {}
        for key, keywords in keys.items():
            where = f"{source}: {env_id}.{key}"
            if not isinstance(keywords, Mapping) or not keywords:
                raise LimitsError(f"{where}: must map JSON Schema keywords (maximum, enum...) to values")
            unknown = sorted(set(keywords) - KEYWORDS)
            if unknown:
                raise LimitsError(f"{where}: unknown keyword {unknown[0]!r}; allowed: {sorted(KEYWORDS)}")
            if "default" in keywords and keywords["default"] is None:
                raise LimitsError(f"{where}: default cannot be null")
            bad = _non_finite(keywords)
            if bad:
                raise LimitsError(f"{where}: {bad} is not a finite number")
            out[env_id][str(key)] = dict(keywords)
    return out


def _non_finite(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, Mapping):
        return next((b for b in map(_non_finite, value.values()) if b), "")
    if isinstance(value, (list, tuple)):
        return next((b for b in map(_non_finite, value) if b), "")
    return ""


def read(path: str) -> Limits:
    """A limits file: JSON, or YAML (.yaml, .yml) where PyYAML is installed. Shape checked only."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise LimitsError(f"config limits {path}: cannot read it: {e.strerror or e}") from None
    try:
        if path.endswith((".yaml", ".yml")):
            try:
                import yaml  # only for YAML files
            except ImportError:
                raise LimitsError(f"config limits {path}: YAML needs PyYAML (pip install pyyaml); "
                                  "or write the file as JSON") from None
            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text or "{}", parse_constant=_refuse_constant)
    except LimitsError:
        raise
    except Exception as e:  # noqa: BLE001 - json's and yaml's errors, one line
        raise LimitsError(f"config limits {path}: not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'}: "
                          f"{' '.join(str(e).split())}") from None
    return parse(data, f"config limits {path}")


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def load(path: str, env_ids: Iterable[str] = ()) -> Limits:
    """read(path), checked against the registry (check_limits) for the envs a replica serves."""
    limits = read(path)
    check_limits(limits, env_ids, f"config limits {path}")
    return limits


def check_limits(limits: Limits, env_ids: Iterable[str] = (), source: str = "config limits") -> None:
    """Raises LimitsError (one line) for an env id not registered here, a key its env does not
    have ('*' names only the session keys every env has), a keyword value JSON Schema refuses, or
    bounds that refuse the key's default. Envs named, and those in env_ids (a replica's), are
    built to check '*' against their defaults."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    from .registry import UnknownEnvironment, get_env_class
    from .session import COMMON_CONFIG_DOCS, spec_with_limits

    common = limits.get(COMMON, {})
    for key in common:
        if key not in COMMON_CONFIG_DOCS:
            raise LimitsError(f"{source}: *.{key}: '*' sets the session keys every env has "
                              f"({', '.join(COMMON_CONFIG_DOCS)}); put an env's own key under its id")
    for env_id in dict.fromkeys([*[e for e in limits if e != COMMON], *env_ids]):
        try:
            spec = get_env_class(env_id).spec
        except UnknownEnvironment as e:
            raise LimitsError(f"{source}: unknown env id {env_id!r} ({e})") from None
        builtin = spec_with_limits(spec, {})
        for key in limits.get(env_id, {}):
            if key not in builtin.config_defaults:
                raise LimitsError(f"{source}: {env_id}.{key}: {env_id} has no config key {key!r}; "
                                  f"its keys: {', '.join(builtin.config_defaults)}")
        full = spec_with_limits(spec, limits)
        props = full.config_schema()["properties"]
        for key in {**common, **limits.get(env_id, {})}:
            where = f"{source}: {env_id if key in limits.get(env_id, {}) else COMMON}.{key}"
            schema = {k: v for k, v in props[key].items() if k != "description"}
            try:
                Draft202012Validator.check_schema(schema)
            except SchemaError as e:
                raise LimitsError(f"{where}: {e.message}") from None
            error = next(Draft202012Validator(schema).iter_errors(schema["default"]), None)
            if error is not None:
                raise LimitsError(f"{where}: the bounds refuse {env_id}'s default: {error.message}; "
                                  f"set a default within them too")
