"""Environments another server serves over ORS, as `ors:<base url>#<env name>`; see env.py."""
from .env import OrsEnv, make_env_class

__all__ = ["OrsEnv", "make_env_class"]
