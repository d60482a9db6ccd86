"""Environments written as OpenEnv `Environment` classes, served unchanged as `openenv:<module>:<Class>`; see env.py."""
from .env import OpenEnvEnv, make_env_class

__all__ = ["OpenEnvEnv", "make_env_class"]
