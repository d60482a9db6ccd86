"""Task names and workspace limits, importable without ManiSkill (the spec needs them)."""
from __future__ import annotations

from dataclasses import dataclass

TASK_NAMES = ("align", "place", "stack", "drawer")

# VAGEN's workspace limits in millimetres (x0, x1, y0, y1, z0, z1). VAGEN's drawer task uses a
# different scene (a PartNet cabinet, robot moved); the primitive drawer here has its own limits.
DEFAULT_WORKSPACES_MM = {
    "align": (-100, 150, -200, 200, 10, 200),
    "place": (-100, 150, -200, 200, 10, 200),
    "stack": (-100, 150, -150, 150, 10, 150),
    "drawer": (-120, 150, -350, 200, 10, 200),
}


@dataclass(frozen=True)
class Workspace:
    """Axis-aligned limits in metres."""
    x: tuple[float, float]
    y: tuple[float, float]
    z: tuple[float, float]

    @classmethod
    def from_mm(cls, values) -> "Workspace":
        v = [float(a) / 1000.0 for a in values]
        return cls((v[0], v[1]), (v[2], v[3]), (v[4], v[5]))

    def contains(self, p) -> bool:
        return all(lo - 1e-9 <= c <= hi + 1e-9 for c, (lo, hi) in zip(p, (self.x, self.y, self.z)))

    def clip(self, p) -> list[float]:
        return [min(max(c, lo), hi) for c, (lo, hi) in zip(p, (self.x, self.y, self.z))]

    def mm(self) -> tuple[tuple[int, int], ...]:
        return tuple((round(lo * 1000), round(hi * 1000)) for lo, hi in (self.x, self.y, self.z))


def parse_workspace_mm(text: str) -> tuple[int, ...]:
    """'x0,x1,y0,y1,z0,z1' in millimetres; raises ValueError."""
    try:
        values = tuple(int(round(float(p))) for p in text.split(","))
    except ValueError:
        raise ValueError(f"workspace must be six numbers 'x0,x1,y0,y1,z0,z1' in mm, got {text!r}") from None
    if len(values) != 6 or any(values[i] >= values[i + 1] for i in (0, 2, 4)):
        raise ValueError(f"workspace must be six numbers 'x0,x1,y0,y1,z0,z1' in mm with each min < max, got {text!r}")
    return values
