"""Where replicas and their sessions live: a Redis directory in production, in-memory by default.

Replicas heartbeat their address, environments, capacity and load with a TTL of two heartbeat
periods, so a dead replica drops out within two periods. A session id is `<replica_id>/<token>`:
the id itself maps a session to its replica, so opening sessions costs no directory write and the
mapping cannot drift from the truth.
"""
from .base import Directory, DirectoryUnavailable, ReplicaInfo, open_directory, replica_of

__all__ = ["Directory", "DirectoryUnavailable", "ReplicaInfo", "open_directory", "replica_of"]
