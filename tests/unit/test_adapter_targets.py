"""Where a framework adapter's sessions live when it is given no address (integrations/_common.py):
ENVSERVE_ADDRESS, else `ray://` in a process of a Ray cluster, else a clear error. The Ray case
itself, on a real Ray with a fleet: tests/integrations/test_skyrl.py and test_verl.py."""
from __future__ import annotations

import pytest

from envserve.integrations._common import Endpoint, in_ray_cluster, resolve_target


def test_a_given_target_wins_over_the_variable(monkeypatch):
    monkeypatch.setenv("ENVSERVE_ADDRESS", "elsewhere:1")
    assert resolve_target("a:1") == "a:1"
    assert resolve_target(["a:1", " b:2 "]) == ("a:1", "b:2")
    assert resolve_target("redis://r:6379/0") == "redis://r:6379/0"


@pytest.mark.parametrize("given", [None, "", "  "])
def test_no_target_is_the_variable(monkeypatch, given):
    monkeypatch.setenv("ENVSERVE_ADDRESS", " a:1,b:2 ")
    assert resolve_target(given) == "a:1,b:2"
    assert Endpoint(given).address == "a:1,b:2"


def test_no_target_outside_ray_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("ENVSERVE_ADDRESS", "")                    # empty: none
    assert not in_ray_cluster()
    with pytest.raises(ValueError, match=r"^the tool \(its `address`\) needs an address: .*ENVSERVE_ADDRESS is not "
                                         r"set and this process is not in a Ray cluster"):
        resolve_target(None, "the tool (its `address`)")
    with pytest.raises(ValueError, match="needs an address"):
        Endpoint(None)
    with pytest.raises(ValueError, match="no replica address"):   # an empty list is a mistake, not "none"
        resolve_target([])
