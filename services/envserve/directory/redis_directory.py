"""Redis directory. Keys (under a prefix, default `envserve`):
  {p}:replica:{id}  the ReplicaInfo JSON, expiring ttl after the last heartbeat
  {p}:replicas      a sorted set of replica ids scored by expiry time, the index to read them by
  {p}:moved:{session id}  the id a draining replica moved that session to, expiring after a lease
  {p}:stats:{scope}       a stats scope's per-task sums: fields n:|s:|r:|t:|k:{task id} (episodes,
                          successes, return, turns, reported tokens) and _ttl; {p}:stats-seen:{scope} scores each
                          task by when it was last recorded. Both expire a TTL after the last write;
                          stale and surplus tasks are pruned at each write.
The per-replica key's TTL is the truth; the index is pruned as entries expire. Nothing else is
stored that heartbeats do not rewrite, so a restarted (empty) Redis is whole again after one period
(a move record lost with it leaves its client to rebuild the session from its own history).
"""
from __future__ import annotations

import time
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis

from .base import Directory, DirectoryUnavailable, ReplicaInfo, TaskOutcomes


class RedisDirectory(Directory):
    def __init__(self, client: "redis.Redis", prefix: str = "envserve"):
        self.client = client
        self.prefix = prefix

    @classmethod
    def from_url(cls, url: str) -> "RedisDirectory":
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        prefix = query.pop("prefix", ["envserve"])[0]
        rest = "&".join(f"{k}={v[0]}" for k, v in query.items())
        clean = urlunsplit((parts.scheme, parts.netloc, parts.path, rest, ""))
        client = redis.Redis.from_url(clean, socket_timeout=2.0, socket_connect_timeout=2.0,
                                      health_check_interval=10)
        return cls(client, prefix)

    def _key(self, replica_id: str) -> str:
        return f"{self.prefix}:replica:{replica_id}"

    @property
    def _index(self) -> str:
        return f"{self.prefix}:replicas"

    def heartbeat(self, info: ReplicaInfo, ttl_seconds: float) -> None:
        info.heartbeat_unix = time.time()
        ttl_ms = max(1, int(ttl_seconds * 1000))
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.set(self._key(info.replica_id), info.to_json(), px=ttl_ms)
            pipe.zadd(self._index, {info.replica_id: info.heartbeat_unix + ttl_seconds})
            pipe.execute()
        except redis.RedisError as e:
            raise DirectoryUnavailable(f"redis: {e}") from e

    def deregister(self, replica_id: str) -> None:
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(self._key(replica_id))
            pipe.zrem(self._index, replica_id)
            pipe.execute()
        except redis.RedisError as e:
            raise DirectoryUnavailable(f"redis: {e}") from e

    def replicas(self, env_id: str | None = None) -> list[ReplicaInfo]:
        try:
            # Scores are expiry times from the writers' clocks; the key TTLs decide who is alive.
            self.client.zremrangebyscore(self._index, "-inf", time.time() - 3600)
            ids = [i.decode() for i in self.client.zrange(self._index, 0, -1)]
            if not ids:
                return []
            values = self.client.mget([self._key(i) for i in ids])
        except redis.RedisError as e:
            raise DirectoryUnavailable(f"redis: {e}") from e
        gone = [i for i, v in zip(ids, values) if v is None]
        if gone:
            try:
                self.client.zrem(self._index, *gone)
            except redis.RedisError:
                pass
        found = [ReplicaInfo.from_json(v) for v in values if v is not None]
        return [r for r in found if env_id is None or env_id in r.envs]

    def get(self, replica_id: str) -> ReplicaInfo | None:
        try:
            v = self.client.get(self._key(replica_id))
        except redis.RedisError as e:
            raise DirectoryUnavailable(f"redis: {e}") from e
        return ReplicaInfo.from_json(v) if v is not None else None

    def record_moves(self, moves: dict[str, str], ttl_seconds: float) -> None:
        ttl_ms = max(1, int(ttl_seconds * 1000))
        try:
            pipe = self.client.pipeline(transaction=False)
            for old, new in moves.items():
                pipe.set(f"{self.prefix}:moved:{old}", new, px=ttl_ms)
            pipe.execute()
        except redis.RedisError as e:
            raise DirectoryUnavailable(f"redis: {e}") from e

    def moved_to(self, session_id: str) -> str | None:
        try:
            v = self.client.get(f"{self.prefix}:moved:{session_id}")
        except redis.RedisError as e:
            raise DirectoryUnavailable(f"redis: {e}") from e
        return v.decode() if v is not None else None

    def record_outcomes(self, scope: str, outcomes: dict[str, TaskOutcomes], ttl_seconds: float,
                        max_tasks: int) -> None:
        sums, seen = f"{self.prefix}:stats:{scope}", f"{self.prefix}:stats-seen:{scope}"
        ttl_ms = max(1, int(ttl_seconds * 1000))
        try:
            pipe = self.client.pipeline(transaction=True)
            for task_id, o in outcomes.items():
                pipe.hincrby(sums, f"n:{task_id}", o.episodes)
                pipe.hincrby(sums, f"s:{task_id}", o.successes)
                pipe.hincrbyfloat(sums, f"r:{task_id}", o.return_sum)
                pipe.hincrby(sums, f"t:{task_id}", o.turns_sum)
                pipe.hincrby(sums, f"k:{task_id}", o.tokens_sum)
                pipe.zadd(seen, {task_id: o.last_unix}, gt=True)
            pipe.hset(sums, "_ttl", ttl_seconds)
            pipe.pexpire(sums, ttl_ms)
            pipe.pexpire(seen, ttl_ms)
            pipe.zrangebyscore(seen, "-inf", f"({time.time() - ttl_seconds}")
            pipe.zcard(seen)
            *_, stale, count = pipe.execute()
            drop = [t.decode() for t in stale]
            if count - len(drop) > max_tasks:
                oldest = self.client.zrange(seen, 0, count - max_tasks - 1)
                drop = sorted(set(drop) | {t.decode() for t in oldest})
            if drop:
                pipe = self.client.pipeline(transaction=True)
                pipe.hdel(sums, *[f"{k}:{t}" for t in drop for k in "nsrtk"])
                pipe.zrem(seen, *drop)
                pipe.execute()
        except redis.RedisError as e:
            raise DirectoryUnavailable(f"redis: {e}") from e

    def task_stats(self, scope: str) -> dict[str, TaskOutcomes]:
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.hgetall(f"{self.prefix}:stats:{scope}")
            pipe.zrange(f"{self.prefix}:stats-seen:{scope}", 0, -1, withscores=True)
            fields, seen = pipe.execute()
        except redis.RedisError as e:
            raise DirectoryUnavailable(f"redis: {e}") from e
        values = {k.decode(): v for k, v in fields.items()}
        oldest = time.time() - float(values.get("_ttl", 0))
        out = {}
        for task, last in seen:
            t = task.decode()
            if last >= oldest and f"n:{t}" in values:
                out[t] = TaskOutcomes(int(values[f"n:{t}"]), int(values.get(f"s:{t}", 0)),
                                      float(values.get(f"r:{t}", 0)), int(values.get(f"t:{t}", 0)), last,
                                      int(values.get(f"k:{t}", 0)))
        return out

    def close(self) -> None:
        self.client.close()
