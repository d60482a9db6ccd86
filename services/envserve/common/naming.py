"""How ground truth names the objects of a kind: what the envs write into their state and relations
and what the judge reads back, so both sides take it from here."""
from __future__ import annotations


def indexed_names(kind: str, count: int) -> list[str]:
    """'target' for one object, 'target0', 'target1', ... for several."""
    return [kind] if count == 1 else [f"{kind}{i}" for i in range(count)]
