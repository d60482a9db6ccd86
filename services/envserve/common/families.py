"""The environment families: which envs one image (one kind of replica) serves, and which need a GPU.

Shared by the deployments that place replicas by family: `envserve up --containers` (one image per
family), the Ray fleet (envserve.ray) and the Kubernetes components (k8s/components/family-*).
"""
from __future__ import annotations

# Which family (image) serves an environment. Later families add their envs here.
FAMILY_OF_ENV = {"sokoban": "grid", "frozenlake": "grid", "minesweeper": "grid",
                 "scienceworld": "scienceworld", "alfworld": "alfworld",
                 "svg": "svg", "navigation": "navigation", "primitive_skill": "maniskill"}

# Families that render on a GPU where one is (SAPIEN's and AI2-THOR's Vulkan); they run on the CPU
# (lavapipe) elsewhere, slower.
GPU_FAMILIES = frozenset({"maniskill", "navigation"})


def family_envs(family: str) -> list[str]:
    """The env ids a family serves; a name that is no family is taken for one env id."""
    envs = [e for e, f in FAMILY_OF_ENV.items() if f == family]
    return envs or [family]
