"""Typed settings from plain mappings (a YAML section, a JSON file, a gRPC Struct).

Shared by every frozen settings dataclass of the parts built on the client (the judge's, the LLM
judge's, the trainer's), so it lives here, where they all already depend: a key must
be a field, and a value must have its default's type. Booleans are not numbers (bool is an int
subclass, so a typo'd flag would otherwise pass as one), strings stay strings, an integer field takes
only whole numbers, and a float field takes any number.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping


def typed_fields(cls, values: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """`values` checked against the fields of dataclass `cls`, ready for `cls(**...)`."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in (values or {}).items():
        if key not in fields:
            raise ValueError(f"unknown {what} key {key!r} (unknown keys are refused); known: {sorted(fields)}")
        default = fields[key].default
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"{what} {key!r} must be a bool, got {value!r}")
        elif isinstance(default, str):
            if not isinstance(value, str):
                raise ValueError(f"{what} {key!r} must be a string, got {value!r}")
        elif isinstance(default, (int, float)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{what} {key!r} must be a number, got {value!r}")
            if isinstance(default, int):
                if int(value) != value:
                    raise ValueError(f"{what} {key!r} must be an integer, got {value!r}")
                value = int(value)
            else:
                value = float(value)
        kwargs[key] = value
    return kwargs
