"""core.tasks: a split's tasks listed a page at a time, building none and describing only the page."""
import pytest

from envserve.core.env import Environment, EnvSpec, Split, TaskDescription
from envserve.core.tasks import TaskListError, list_tasks, parse_page_token

SPEC = EnvSpec("counted", "d", "p", "a", 5, 1, config_defaults={"size": 4, "other": 1},
               splits=(Split("train", "", 0, 10**6), Split("test", "", 10**7, 5)), difficulty_keys=("size",))


class Counted(Environment):
    """Counts describe_task calls; never built."""
    spec = SPEC
    described: list = []

    def __init__(self, config):
        raise AssertionError("listing tasks built an environment")

    @classmethod
    def describe_task(cls, spec, seed):
        cls.described.append(seed)
        return TaskDescription(f"task {seed}", "kind", {"size": seed % 3})


def test_a_page_near_the_end_of_a_million_seeds_describes_only_its_tasks():
    Counted.described.clear()
    tasks, total, nxt = list_tasks(Counted, SPEC, "train", 10**6 - 2, 1000)
    assert total == 10**6 and nxt is None
    assert [t.task_id for t in tasks] == ["999998", "999999"] and Counted.described == [999998, 999999]
    assert tasks[0].description == "task 999998" and tasks[0].parameters == {"size": 2}


def test_pages_follow_each_other_and_seeds_carry_the_split_offset():
    tasks, total, nxt = list_tasks(Counted, SPEC, "test", 0, 3)
    assert (total, nxt, [t.seed for t in tasks]) == (5, 3, [10**7, 10**7 + 1, 10**7 + 2])
    rest, _, last = list_tasks(Counted, SPEC, "test", nxt, 3)
    assert [t.seed for t in rest] == [10**7 + 3, 10**7 + 4] and last is None
    assert {t.split for t in tasks + rest} == {"test"}


def test_the_default_description_shows_the_difficulty_keys_defaults():
    class Plain(Environment):
        spec = SPEC
    (task,), _, _ = list_tasks(Plain, SPEC, "", 0, 1)
    assert task.parameters == {"size": 4} and task.split == "train" and task.description == ""


@pytest.mark.parametrize("token", ["x", "-1", "1e3", "1" * 30, str(6)])
def test_a_token_the_listing_did_not_give_is_refused(token):
    with pytest.raises(TaskListError):
        parse_page_token(token, 5)


def test_an_unknown_split_is_refused_naming_the_known_ones():
    with pytest.raises(TaskListError, match="train"):
        list_tasks(Counted, SPEC, "nope", 0, 1)
