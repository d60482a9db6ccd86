"""envserve on a Ray cluster: a fleet of replicas as Ray actors (fleet.py, replica.py), found
through the `ray://` directory (envserve.directory.ray_directory). Needs `ray` (extra "ray")."""
from .fleet import Fleet, FleetConfig

__all__ = ["Fleet", "FleetConfig"]
