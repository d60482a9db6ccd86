"""The task samplers: uniform, and learnability p(1-p) with exploration, a floor and cost."""
from collections import Counter
from types import SimpleNamespace

import pytest

from envserve.client.sampling import LearnabilitySampler, UniformSampler, make_sampler


def stat(task, episodes, successes, turns=0):
    return SimpleNamespace(task_id=task, episodes=episodes, successes=successes, turns_sum=turns)


def test_half_solved_tasks_are_drawn_most_and_solved_or_hopeless_ones_least():
    s = LearnabilitySampler(["hopeless", "half", "solved", "new"], seed=1)
    s.update([stat("hopeless", 40, 0), stat("half", 40, 20), stat("solved", 40, 40)])
    counts = Counter(s.sample(20_000))
    assert counts["half"] > 4 * counts["hopeless"] and counts["half"] > 4 * counts["solved"]
    assert counts["new"] > 4 * counts["hopeless"]           # unseen tasks are explored
    assert counts["hopeless"] > 0 and counts["solved"] > 0  # the floor: none starves


def test_the_floor_bounds_how_rarely_a_task_is_drawn():
    s = LearnabilitySampler(["a", "b"], floor=0.2)
    s.update([stat("a", 10_000, 0), stat("b", 10, 5)])
    assert s.weight("a") == pytest.approx(0.2 * 0.25)
    assert s.weight("b") == pytest.approx((6 / 12) * (6 / 12))


def test_cost_weighs_learnability_per_env_step():
    s = LearnabilitySampler(["short", "long"], cost_power=1.0)
    s.update([stat("short", 10, 5, turns=20), stat("long", 10, 5, turns=200)])
    assert s.weight("short") == pytest.approx(10 * s.weight("long"))


def test_cost_in_generated_tokens_weighs_learnability_per_token():
    s = LearnabilitySampler(["terse", "verbose"], cost_power=1.0, cost="tokens")
    s.update([SimpleNamespace(task_id="terse", episodes=10, successes=5, turns_sum=50, tokens_sum=400),
              SimpleNamespace(task_id="verbose", episodes=10, successes=5, turns_sum=50, tokens_sum=960)])
    assert s.weight("terse") == pytest.approx(2.4 * s.weight("verbose"))
    with pytest.raises(ValueError, match="cost"):
        LearnabilitySampler(["a"], cost="seconds")


def test_refresh_reads_the_source_and_the_same_seed_draws_the_same_tasks():
    source = [stat("x", 4, 2)]
    a = LearnabilitySampler(["x", "y"], seed=7, stats=lambda: source)
    b = LearnabilitySampler(["x", "y"], seed=7, stats=lambda: source)
    a.refresh()
    b.refresh()
    assert a.seen == {"x": (4, 2, 0.0)} and a.sample(50) == b.sample(50)


def test_uniform_and_bad_settings():
    assert set(UniformSampler(["a", "b", "c"]).sample(300)) == {"a", "b", "c"}
    with pytest.raises(ValueError, match="unknown task sampler"):
        make_sampler("greedy", ["a"])
    with pytest.raises(ValueError, match="at least one task"):
        make_sampler("learnability", [])
    with pytest.raises(ValueError, match="floor"):
        LearnabilitySampler(["a"], floor=0)


def test_distinct_draws_never_repeat_a_task_and_follow_the_weights():
    s = LearnabilitySampler(["hopeless", "half", "new"], seed=3)
    s.update([stat("hopeless", 100, 0), stat("half", 100, 50)])
    firsts = Counter()
    for _ in range(3000):
        drawn = s.sample_distinct(2)
        assert len(set(drawn)) == 2
        firsts[drawn[0]] += 1
    assert firsts["half"] > 3 * firsts["hopeless"] and firsts["new"] > 3 * firsts["hopeless"]
    assert sorted(s.sample_distinct(10)) == ["half", "hopeless", "new"]   # all of them when fewer


def test_the_dataset_sampler_groups_rows_by_task_and_survives_a_failed_stats_read():
    from envserve.integrations.task_sampler import TaskSampler
    rows = [{"seed": 5}, {"extra_info": {"task_id": "9"}}, {"task_id": "7", "seed": 1}]
    reads = []

    def stats():
        reads.append(1)
        if len(reads) > 1:
            raise ConnectionError("the service is restarting")
        return [stat("5", 50, 50), stat("9", 10, 5)]
    sampler = TaskSampler(rows, stats, mini_repeat_count=3, batch_size=1, repeat_count=2, seed=1)
    assert set(sampler.rows_of) == {"5", "9", "7"}
    order = list(sampler)
    assert len(order) == len(sampler) == 3 * 3 * 2 and len(reads) == 3
    assert all(order[i:i + 6] == [order[i]] * 6 for i in range(0, 18, 6))   # a group, twice, per batch
    assert sampler.sampler.seen["5"] == (50, 50, 0.0)                        # kept after failed reads
    with pytest.raises(ValueError, match="names no task"):
        TaskSampler([{"prompt": "x"}], stats)
    with pytest.raises(ValueError, match="stats="):
        TaskSampler(rows)
    assert len(list(TaskSampler(rows, kind="uniform", batch_size=3))) == 3
