from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    env_ids: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    workers: int = 0  # 0: one per CPU
    max_sessions: int = 10_000
    max_open_per_call: int = 4096
    lease_seconds: float = 300.0
    reap_interval_seconds: float = 0.0  # 0: a tenth of the lease, at most 5 s
    metrics_port: int = -1  # -1: no metrics endpoint; 0: a free port
    metrics_host: str = "127.0.0.1"
    drain_timeout_seconds: float = 60.0
    # Lost sessions answer 'session lost' for this long, then 'unknown session'.
    lost_memory_seconds: float = 3600.0
    max_message_bytes: int = 64 * 1024 * 1024
    replica_id: str = ""

    def resolved_workers(self) -> int:
        return self.workers if self.workers > 0 else (os.cpu_count() or 1)

    def resolved_replica_id(self, port: int) -> str:
        return self.replica_id or f"{socket.gethostname()}-{port}"

    def reap_interval(self) -> float:
        return self.reap_interval_seconds or min(5.0, max(0.05, self.lease_seconds / 10))
