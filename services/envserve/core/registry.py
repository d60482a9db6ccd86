"""Environment registration by name.

Environments register an import path (so listing envs imports nothing heavy). Two entry-point
groups feed the registry, so core never imports a concrete env: `envserve.registrations` names
modules that call register() when imported (envserve's own: `envserve.envs`, whose __init__
registers each built-in family where its packages are installed), and `envserve.envs` maps a name
to "module:Class" directly (the simplest form for a third-party env).

A family that wraps another library's registry registers a prefix instead of one id per env:
`register_prefix("gymnasium", "module:factory")` makes every `gymnasium:<name>` resolve to the
class that factory builds for <name> (once per process), so ids nobody listed can be served.
"""
from __future__ import annotations

import importlib
from importlib import metadata
from dataclasses import dataclass
from typing import Callable, Type, Union

from .env import Environment

ENTRY_POINT_GROUP = "envserve.envs"
REGISTRATION_GROUP = "envserve.registrations"

_PATHS: dict[str, str] = {}
_CLASSES: dict[str, Type[Environment]] = {}
_entry_points_loaded = False

PREFIX_SEPARATOR = ":"


class UnknownEnvironment(KeyError):
    """No env is registered under this id, or its prefix family cannot build one for it."""

    def __str__(self) -> str:  # KeyError would show the message quoted
        return str(self.args[0]) if self.args else ""


Factory = Union[str, Callable[[str], Type[Environment]]]


@dataclass(frozen=True)
class PrefixFamily:
    # name -> env class; raises KeyError (or ValueError) naming why it cannot serve that name.
    factory: Factory
    # () -> names it can serve here, as examples for listings and the conformance suite.
    examples: "Factory | None" = None
    description: str = ""


_PREFIXES: dict[str, PrefixFamily] = {}


def register(env_id: str, target: "str | Type[Environment]") -> None:
    """Register an env class, or its 'module:Class' path for lazy import."""
    if isinstance(target, str):
        _PATHS[env_id] = target
        _CLASSES.pop(env_id, None)
    else:
        _CLASSES[env_id] = target


def register_prefix(prefix: str, factory: Factory, examples: "Factory | None" = None,
                    description: str = "") -> None:
    """Register a family serving `prefix:<name>` for open-ended names; factory and examples may be
    'module:function' paths, imported on first use."""
    if PREFIX_SEPARATOR in prefix:
        raise ValueError(f"a prefix cannot contain {PREFIX_SEPARATOR!r}: {prefix!r}")
    _PREFIXES[prefix] = PrefixFamily(factory, examples, description)


def _resolve(target):
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        return getattr(importlib.import_module(module_name), attr)
    return target


def prefixes() -> dict[str, PrefixFamily]:
    _load_entry_points()
    return dict(_PREFIXES)


def prefix_of(env_id: str) -> str:
    """The registered prefix family env_id belongs to, or ""."""
    _load_entry_points()
    prefix, sep, _ = env_id.partition(PREFIX_SEPARATOR)
    return prefix if sep and prefix in _PREFIXES else ""


def prefix_examples(prefix: str) -> list[str]:
    """Full ids (prefix:name) that the family says it can serve here."""
    family = prefixes()[prefix]
    if family.examples is None:
        return []
    return [f"{prefix}{PREFIX_SEPARATOR}{name}" for name in _resolve(family.examples)()]


def unregister(env_id: str) -> None:
    """Forget an env registered in this process (tests that register one of their own)."""
    _PATHS.pop(env_id, None)
    _CLASSES.pop(env_id, None)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    modules = metadata.entry_points(group=REGISTRATION_GROUP)
    if not modules:
        raise RuntimeError(f"no {REGISTRATION_GROUP!r} entry points: envserve's package metadata is missing "
                           f"(install it, e.g. pip install -e ., rather than putting services/ on the path)")
    for ep in modules:
        importlib.import_module(ep.value)
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        _PATHS.setdefault(ep.name, ep.value)


def env_ids() -> list[str]:
    _load_entry_points()
    return sorted(set(_PATHS) | set(_CLASSES))


def get_env_class(env_id: str) -> Type[Environment]:
    _load_entry_points()
    if env_id in _CLASSES:
        return _CLASSES[env_id]
    if env_id not in _PATHS:
        prefix = prefix_of(env_id)
        if not prefix:
            raise UnknownEnvironment(f"unknown environment {env_id!r}; registered: {env_ids()}"
                                     + (f", and the prefixes {sorted(_PREFIXES)} (prefix:name)" if _PREFIXES else ""))
        name = env_id[len(prefix) + len(PREFIX_SEPARATOR):]
        try:
            cls = _resolve(_PREFIXES[prefix].factory)(name)
        except (KeyError, ValueError) as e:
            raise UnknownEnvironment(f"{env_id!r}: {e.args[0] if e.args else e}") from None
        _CLASSES[env_id] = cls
        return cls
    cls = _resolve(_PATHS[env_id])
    _CLASSES[env_id] = cls
    return cls


def is_known(env_id: str) -> bool:
    """Whether env_id resolves here (a prefix id is built to find out)."""
    try:
        get_env_class(env_id)
    except UnknownEnvironment:
        return False
    return True


