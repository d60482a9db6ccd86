"""Prometheus metrics of one replica, on their own registry so several replicas can share a process."""
from __future__ import annotations

import bisect
import threading

from prometheus_client import Counter, Gauge
from prometheus_client.core import HistogramMetricFamily

from envserve.rpc.metrics import MetricsEndpoint

STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class StepLatency:
    """A labelled histogram cheap enough to observe once per batch item on the hot path
    (prometheus_client's Histogram takes a lock and walks every bucket per observation)."""

    def __init__(self, name: str, doc: str, buckets=STEP_BUCKETS):
        self.name, self.doc, self.bounds = name, doc, list(buckets)
        self._data: dict[str, list] = {}  # env -> [bucket counts..., +Inf count, sum]
        self._lock = threading.Lock()  # only against the scrape thread

    def observe(self, env: str, seconds: float) -> None:
        row = self._data.get(env)
        if row is None:
            with self._lock:
                row = self._data.setdefault(env, [0] * (len(self.bounds) + 1) + [0.0])
        row[bisect.bisect_left(self.bounds, seconds)] += 1
        row[-1] += seconds

    def collect(self):
        family = HistogramMetricFamily(self.name, self.doc, labels=["env"])
        with self._lock:
            rows = {env: list(row) for env, row in self._data.items()}
        for env, row in rows.items():
            cumulative, total = [], 0
            for bound, count in zip([*map(str, self.bounds), "+Inf"], row[:-1]):
                total += count
                cumulative.append((bound, total))
            family.add_metric([env], cumulative, row[-1])
        yield family


class Metrics(MetricsEndpoint):
    def __init__(self) -> None:
        super().__init__()
        self.step_seconds = StepLatency("envserve_step_seconds", "Time a worker spends on one reset or step item")
        self.registry.register(self.step_seconds)
        self.live_sessions = Gauge("envserve_live_sessions", "Open sessions", ["env"], registry=self.registry)
        # Per replica, unlabelled: what a HorizontalPodAutoscaler averages over pods.
        self.replica_live_sessions = Gauge("envserve_replica_live_sessions", "Open sessions on this replica",
                                           registry=self.registry)
        self.replica_capacity = Gauge("envserve_replica_capacity", "Sessions this replica accepts at most",
                                      registry=self.registry)
        self.worker_restarts = Counter("envserve_worker_restarts_total", "Workers respawned after dying",
                                       registry=self.registry)
        self.errors = Counter("envserve_errors_total", "Failed items and calls by status code", ["code"],
                              registry=self.registry)
        self.sessions_lost = Counter("envserve_sessions_lost_total", "Sessions lost with their worker",
                                     registry=self.registry)
        self.sessions_moved = Counter("envserve_sessions_moved_total",
                                      "Sessions a drain moved to other replicas", registry=self.registry)
        self.sessions_reaped = Counter("envserve_sessions_reaped_total", "Sessions closed when their lease expired",
                                       registry=self.registry)
        # What the orphan sweep saw: equal to the live sessions unless a worker holds sessions the
        # front lost track of (which the sweep then closes).
        self.worker_sessions = Gauge("envserve_worker_sessions", "Sessions each worker holds, at the last sweep",
                                     ["worker"], registry=self.registry)
        self.orphans_closed = Counter("envserve_orphan_sessions_closed_total",
                                      "Sessions a worker held without a record in the front, closed by the sweep",
                                      registry=self.registry)

    def observe_step(self, env: str, seconds: float) -> None:
        self.step_seconds.observe(env, seconds)
