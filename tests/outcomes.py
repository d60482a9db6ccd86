"""Finished episodes for the outcome statistics' tests, and waiting for the replicas to count them."""
import time

LEFT = "<answer>Left</answer>"


def finish_episodes(client, env_id: str, seeds, per_seed: int = 1) -> None:
    """Episodes of one turn each (max_turns 1, the answer "Left"), on the given seeds."""
    sids = client.open(env_id, per_seed, {"max_turns": 1})
    for seed in seeds:
        for sid in sids:
            client.reset_one(sid, seed=seed)
            client.step_one(sid, LEFT)
    client.close_sessions(sids)


def stats_when(client, env_id: str, episodes: int, scope=None, timeout: float = 60) -> dict:
    """The scope's stats once they count `episodes` (replicas flush every 2 s)."""
    deadline = time.monotonic() + timeout
    while True:
        found = {t.task_id: t for t in client.task_stats(env_id, scope)}
        if sum(t.episodes for t in found.values()) >= episodes or time.monotonic() > deadline:
            return found
        time.sleep(0.25)
