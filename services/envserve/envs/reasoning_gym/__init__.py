"""reasoning-gym's procedural datasets, served as `reasoning_gym:<dataset>`; see env.py."""
from .env import ReasoningGymEnv, examples, make_env_class

__all__ = ["ReasoningGymEnv", "examples", "make_env_class"]
