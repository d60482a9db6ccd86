"""Loading a run's config: a YAML file, or a bundled one by name."""
from __future__ import annotations

from pathlib import Path

from .train_config import TrainConfig

# The configs shipped with the package (envserve_trainer/configs), loadable by file name.
BUNDLED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def load_config(path: str) -> TrainConfig:
    """The TrainConfig of a YAML file, or of a bundled config given by name (e.g. frozenlake_grpo.yaml);
    a missing or invalid file exits with a message naming it."""
    p = Path(path)
    if not p.exists() and (BUNDLED_CONFIGS / path).exists():
        p = BUNDLED_CONFIGS / path    # a bundled config by name, e.g. frozenlake_grpo.yaml
    if not p.exists():
        raise SystemExit(f"envserve-train: no config file {path!r} (bundled: "
                         f"{', '.join(sorted(x.name for x in BUNDLED_CONFIGS.glob('*.yaml')))})")
    try:
        return TrainConfig.load(p)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"envserve-train: {p}: {e}") from None
