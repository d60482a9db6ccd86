"""A fleet of replicas as Ray actors, placed by Ray's resources, registered in a Ray directory and
sized by their live sessions.

    import ray
    from envserve.ray import Fleet, FleetConfig
    ray.init()                                   # or inside a trainer's driver that already did
    fleet = Fleet(FleetConfig(families=["grid"], replicas_per_node=1, max_replicas=8))
    fleet.start()                                # one replica per node, each `envserve serve`
    client = RoutedClient("ray://")              # any process of the cluster finds the replicas
    fleet.autoscale_once()                       # or fleet.run_autoscaler() on a thread
    fleet.shutdown()

Placement: each replica asks for `replica_cpus` CPUs, and a GPU for the GPU families where the
cluster has GPUs, spread over the nodes; Ray restarts a replica whose process or node died on a node
with room (its sessions are rebuilt by their clients through the directory). Scaling: each family
aims at `target_load` live sessions per unit of capacity, within [min_replicas, max_replicas];
growing is at once, shrinking waits until the load has been low for `scale_down_after_seconds` and
drains one replica at a time (its sessions move to the others). Each target is also sent to Ray's
autoscaler (`request_resources`), which adds nodes where a cluster autoscaler runs.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence
from urllib.parse import urlsplit

from envserve.directory import open_directory
from envserve.directory.ray_directory import connect
from envserve.common.families import GPU_FAMILIES, family_envs

from .replica import ReplicaActor

log = logging.getLogger("envserve.ray")


@dataclass
class FleetConfig:
    families: Sequence[str] = ("grid",)    # family names (envserve.common.families) or env ids
    replicas_per_node: int = 1             # at start, per node that can host the family
    replicas: int = 0                      # at start, per family, instead (0: replicas_per_node x nodes)
    min_replicas: int = 0                  # per family; 0: the start count
    max_replicas: int = 0                  # per family; 0: the start count (a fixed size)
    replica_cpus: float = 1.0
    replica_gpus: float | None = None      # None: 1 for GPU families where the cluster has GPUs, else 0
    serve_args: Sequence[str] = ()         # more `envserve serve` arguments (--workers, --max-sessions ...)
    directory_url: str = "ray://"
    target_load: float = 0.5               # live sessions / capacity each family is sized for
    scale_down_after_seconds: float = 60.0
    drain_timeout_seconds: float = 120.0   # a shrinking replica's time to move its sessions and exit
    start_timeout_seconds: float = 300.0     # a replica's start, on a busy node too
    max_restarts: int = -1                 # Ray's restarts of a replica actor (-1: always)
    request_resources: bool = True         # tell Ray's autoscaler the fleet's size

    def __post_init__(self) -> None:
        if not 0 < self.target_load <= 1:
            raise ValueError(f"target_load must be in (0, 1], got {self.target_load}")
        if self.replicas_per_node < 1 or self.replicas < 0 or self.min_replicas < 0 or self.max_replicas < 0:
            raise ValueError("replica counts must be >= 0 (replicas_per_node >= 1)")
        if self.max_replicas and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        if not self.families:
            raise ValueError("a fleet needs at least one family")


@dataclass
class _Family:
    name: str
    envs: list[str]
    cpus: float
    gpus: float
    min_replicas: int = 0
    max_replicas: int = 0
    actors: list = field(default_factory=list)
    low_since: float | None = None

    @property
    def prefix(self) -> str:
        return f"ray-{self.name}-"


class Fleet:
    """Driver-side control of the fleet. The replica actors are owned by the process that started
    them (a trainer's driver, `envserve ray up`): they end with it."""

    def __init__(self, config: FleetConfig | None = None, address: str = ""):
        config = config or FleetConfig()
        connect(address)
        url = urlsplit(config.directory_url)
        if url.scheme != "ray" or url.netloc:
            # Replicas join the cluster from inside; a Ray Client address is for callers outside.
            config = dataclasses.replace(config, directory_url=f"ray://?{url.query}" if url.query else "ray://")
        self.config = config
        self.directory = open_directory(self.config.directory_url)
        self._lock = threading.RLock()
        self._families: dict[str, _Family] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- placement ---------------------------------------------------------------------------
    def _family(self, name: str) -> _Family:
        import ray
        gpus = self.config.replica_gpus
        if gpus is None:
            gpus = 1.0 if name in GPU_FAMILIES and ray.cluster_resources().get("GPU", 0) > 0 else 0.0
        return _Family(name, family_envs(name), self.config.replica_cpus, gpus)

    def _hosts(self, fam: _Family) -> int:
        """Nodes that can hold one of the family's replicas."""
        import ray
        return sum(1 for n in ray.nodes() if n.get("Alive")
                   and n["Resources"].get("CPU", 0) >= fam.cpus and n["Resources"].get("GPU", 0) >= fam.gpus)

    def _new_actor(self, fam: _Family):
        import ray
        cls = ray.remote(ReplicaActor)
        return cls.options(num_cpus=fam.cpus, num_gpus=fam.gpus, max_restarts=self.config.max_restarts,
                           max_task_retries=-1, scheduling_strategy="SPREAD",
                           ).remote(fam.name, fam.envs, self.config.directory_url, list(self.config.serve_args),
                                    self.config.start_timeout_seconds)

    def start(self) -> list[dict]:
        """Starts replicas_per_node replicas of each family on each node that can hold one, and
        waits until they serve. Returns their info (replica id, address, node)."""
        import ray
        with self._lock:
            for name in self.config.families:
                if name in self._families:
                    continue
                fam = self._family(name)
                count = self.config.replicas or max(1, self.config.replicas_per_node * max(1, self._hosts(fam)))
                fam.min_replicas = self.config.min_replicas or count
                fam.max_replicas = max(self.config.max_replicas or count, fam.min_replicas)
                count = min(max(count, fam.min_replicas), fam.max_replicas)
                fam.actors = [self._new_actor(fam) for _ in range(count)]
                self._families[name] = fam
            everyone = [a for f in self._families.values() for a in f.actors]
        infos = ray.get([a.info.remote() for a in everyone])
        self._request_resources()
        return infos

    # -- what runs -------------------------------------------------------------------------------
    def replicas(self, family: str | None = None, timeout: float = 30.0) -> list[dict]:
        """Each replica actor's info (replica id, address, family, node, pid), as it is now: an
        actor Ray restarted reports its new replica."""
        import ray
        with self._lock:
            actors = [a for name, f in self._families.items() if family in (None, name) for a in f.actors]
        return ray.get([a.info.remote() for a in actors], timeout=timeout)

    def size(self, family: str) -> int:
        with self._lock:
            return len(self._families[family].actors)

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {name: len(f.actors) for name, f in self._families.items()}

    def _serving(self, family: str) -> list:
        prefix = self._families[family].prefix
        return [r for r in self.directory.replicas() if r.replica_id.startswith(prefix) and not r.draining]

    def load(self, family: str) -> tuple[int, int]:
        """(live sessions, capacity) of the family's serving replicas, as the directory lists them."""
        listed = self._serving(family)
        return sum(r.live_sessions for r in listed), sum(r.capacity for r in listed)

    # -- sizing ------------------------------------------------------------------------------------
    def scale(self, family: str, count: int) -> int:
        """Grows or shrinks a family to `count` replicas (within its bounds). Shrinking drains the
        least loaded replicas one at a time: each moves its live sessions to the others before it
        exits. Returns the new size."""
        import ray
        with self._lock:
            fam = self._families[family]
            count = min(max(count, fam.min_replicas), fam.max_replicas)
            added = [self._new_actor(fam) for _ in range(count - len(fam.actors))]
            fam.actors.extend(added)
        if added:
            ray.get([a.info.remote() for a in added])
            log.info("fleet: %s grown to %d replicas", family, count)
        while self.size(family) > count:
            self._drain_one(fam)
        self._request_resources()
        return self.size(family)

    def _drain_one(self, fam: _Family) -> None:
        import ray
        with self._lock:
            pairs = list(zip(fam.actors, ray.get([a.info.remote() for a in fam.actors])))
        live = {r.replica_id: r.live_sessions for r in self.directory.replicas()}
        actor, info = min(pairs, key=lambda p: live.get(p[1]["replica_id"], 0))
        with self._lock:
            fam.actors.remove(actor)
        try:
            ray.get(actor.drain.remote(self.config.drain_timeout_seconds),
                    timeout=self.config.drain_timeout_seconds + 30)
        except Exception as e:  # its node went meanwhile: nothing left to drain
            log.warning("fleet: drain of %s failed: %s", info["replica_id"], e)
        ray.kill(actor, no_restart=True)
        log.info("fleet: %s drained (%s)", info["replica_id"], fam.name)

    def target(self, family: str) -> int:
        """The size the family's live sessions ask for, within its bounds: enough replicas of the
        listed ones' mean capacity for the live sessions to fill target_load of it."""
        fam = self._families[family]
        listed = self._serving(family)
        if not listed:
            return len(fam.actors)
        live = sum(r.live_sessions for r in listed)
        per_replica = sum(r.capacity for r in listed) / len(listed)
        need = math.ceil(live / (per_replica * self.config.target_load)) if per_replica > 0 else len(fam.actors)
        return min(max(need, fam.min_replicas), fam.max_replicas)

    def autoscale_once(self) -> dict[str, int]:
        """One look at each family's load: grow at once where it asks for more replicas, shrink
        where it has asked for fewer for scale_down_after_seconds. Returns the sizes."""
        for name, fam in list(self._families.items()):
            want, have = self.target(name), self.size(name)
            if want > have:
                fam.low_since = None
                self.scale(name, want)
            elif want < have:
                now = time.monotonic()
                fam.low_since = fam.low_since if fam.low_since is not None else now
                if now - fam.low_since >= self.config.scale_down_after_seconds:
                    self.scale(name, want)
                    fam.low_since = None
            else:
                fam.low_since = None
        return self.sizes()

    def run_autoscaler(self, interval: float = 5.0) -> threading.Thread:
        """autoscale_once every interval seconds on a thread, until shutdown()."""
        def loop():
            while not self._stop.wait(interval):
                try:
                    self.autoscale_once()
                except Exception:
                    log.exception("fleet: autoscaling failed (retried next period)")
        self._thread = threading.Thread(target=loop, name="envserve-fleet-autoscaler", daemon=True)
        self._thread.start()
        return self._thread

    def _request_resources(self) -> None:
        if not self.config.request_resources:
            return
        try:
            from ray.autoscaler.sdk import request_resources
            bundles = []
            for fam in self._families.values():
                bundle = {"CPU": fam.cpus, **({"GPU": fam.gpus} if fam.gpus else {})}
                bundles += [bundle] * len(fam.actors)
            request_resources(bundles=bundles)
        except Exception as e:  # no autoscaler API on this cluster: the fleet still runs
            log.debug("request_resources: %s", e)

    def shutdown(self, drain: bool = True) -> None:
        """Stops the autoscaler and every replica: drained (their sessions end, they deregister)
        or killed."""
        import ray
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            actors = [a for f in self._families.values() for a in f.actors]
            for f in self._families.values():
                f.actors = []
        if drain and actors:
            try:
                ray.get([a.drain.remote(5.0) for a in actors], timeout=60)
            except Exception as e:
                log.warning("fleet: drain at shutdown: %s", e)
        for a in actors:
            ray.kill(a, no_restart=True)
        self.directory.close()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()

