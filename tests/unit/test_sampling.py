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
