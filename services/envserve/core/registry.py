"""Environment registration by name.

Environments register an import path (so listing envs imports nothing heavy). Two entry-point
groups feed the registry, so core never imports a concrete env: `envserve.registrations` names
modules that call register() when imported (envserve's own: `envserve.envs`, whose __init__
registers each built-in family where its packages are installed), and `envserve.envs` maps a name
to "module:Class" directly (the simplest form for a third-party env).
"""
from __future__ import annotations

import importlib
from importlib import metadata
from typing import Type

from .env import Environment

ENTRY_POINT_GROUP = "envserve.envs"
REGISTRATION_GROUP = "envserve.registrations"

_PATHS: dict[str, str] = {}
_CLASSES: dict[str, Type[Environment]] = {}
_entry_points_loaded = False


def register(env_id: str, target: "str | Type[Environment]") -> None:
    """Register an env class, or its 'module:Class' path for lazy import."""
    if isinstance(target, str):
        _PATHS[env_id] = target
        _CLASSES.pop(env_id, None)
    else:
        _CLASSES[env_id] = target


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
        raise KeyError(f"unknown environment {env_id!r}; registered: {env_ids()}")
    module_name, _, attr = _PATHS[env_id].partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    _CLASSES[env_id] = cls
    return cls


