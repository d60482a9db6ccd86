"""Stage 1, config: a run's settings (TrainConfig and its sections, the methods' defaults, the checks
they share) and loading them from YAML. May import: nothing of the trainer; envserve only through envserve.client."""
from .loading import BUNDLED_CONFIGS, load_config
from .train_config import BENCH_SECTION, TrainConfig

__all__ = ["BENCH_SECTION", "BUNDLED_CONFIGS", "TrainConfig", "load_config"]
