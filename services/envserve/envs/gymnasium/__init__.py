"""Any environment in gymnasium's registry, served as `gymnasium:<id>`; see env.py."""
from .env import GymnasiumEnv, examples, make_env_class

__all__ = ["GymnasiumEnv", "examples", "make_env_class"]
