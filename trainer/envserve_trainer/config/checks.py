"""The checks the trainer's settings dataclasses share (algo_config, config, process.config,
evaluation), so that one rule has one wording: a value in [0, 1], a positive value, one of a set of
choices, and building a dataclass from a YAML/JSON mapping that refuses unknown keys and wrong types.

`name` is what the message calls the setting, with its owner where the caller wants one
("ProgRMConfig.jaccard_threshold", "model.dtype").
"""
from __future__ import annotations

from typing import Any, Mapping, TypeVar

_C = TypeVar("_C")


def from_mapping(cls: type[_C], data: Mapping[str, Any] | None) -> _C:
    """Defaults plus `data`; ValueError on an unknown key or a value of the wrong type."""
    # Imported here: evaluation (pure functions of trajectory records) uses the checks below and
    # should not load the gRPC client with them.
    from envserve.client.settings import typed_fields
    return cls(**typed_fields(cls, data, cls.__name__))


class FromMapping:
    """A settings dataclass whose `from_mapping` is `from_mapping` above."""

    @classmethod
    def from_mapping(cls: type[_C], data: Mapping[str, Any] | None) -> _C:
        return from_mapping(cls, data)


def unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")


def one_of(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
