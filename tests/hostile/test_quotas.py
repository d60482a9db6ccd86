"""Quotas per token on a real replica: one token cannot take another's share of sessions, items in
flight or opens, and each refusal names the quota that refused it."""
from __future__ import annotations

import grpc
import pytest

from envserve.client import EnvClient, ReplicaFullError
from envserve.v1 import envserve_pb2 as pb
from serverproc import ServerProcess

GREEDY, MODEST, CAPPED, SLOW = "greedy-token", "modest-token", "capped-token", "slow-token"


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("quota-tokens") / "tokens.txt"
    # A replica of 40 sessions and four teams: a token with no quota of its own gets an equal share
    # (10); one entry narrows its items in flight, another its opens.
    tokens.write_text(f"{GREEDY} name=greedy\n{MODEST} name=modest\n"
                      f"{CAPPED} name=capped max_sessions=6 max_in_flight=3\n"
                      f"{SLOW} name=slow opens_per_second=0.01 open_burst=2\n")
    with ServerProcess(["frozenlake"], workers=1, metrics=False,
                       extra=["--token-file", str(tokens), "--max-sessions", "40"]) as server:
        yield server


def test_one_token_cannot_take_the_replicas_capacity(shared):
    with EnvClient(shared.address, token=GREEDY) as greedy, EnvClient(shared.address, token=MODEST) as modest:
        mine = greedy.open("frozenlake", 10)
        with pytest.raises(ReplicaFullError) as e:
            greedy.open("frozenlake", 1)
        assert "max_sessions" in e.value.message and "greedy" in e.value.message
        # The other token's share is still there, whole.
        theirs = modest.open("frozenlake", 10)
        assert len(theirs) == 10
        # Closing gives the share back.
        greedy.close_sessions(mine[:4])
        mine = mine[4:] + greedy.open("frozenlake", 4)
        greedy.close_sessions(mine)
        modest.close_sessions(theirs)


def test_items_in_flight_are_bounded_per_token(shared):
    with EnvClient(shared.address, token=CAPPED) as capped, EnvClient(shared.address, token=MODEST) as modest:
        ids = capped.open("frozenlake", 4)
        with pytest.raises(ReplicaFullError) as e:
            capped.reset(ids, seeds=[1, 2, 3, 4])
        assert "max_in_flight" in e.value.message
        assert all(r.status.code == 0 for r in capped.reset(ids[:3], seeds=[1, 2, 3]))
        # Over a stream, the items of one request are taken in together: the one past the quota
        # fails alone, naming it.
        results = list(capped.env.Interact(iter([pb.InteractRequest(items=[
            pb.InteractItem(tag=i, reset=pb.ResetItem(session_id=sid, seed=i)) for i, sid in enumerate(ids)])]),
            metadata=capped.metadata))
        by_tag = {r.tag: r.result.status for resp in results for r in resp.results}
        assert [by_tag[i].code for i in range(3)] == [0, 0, 0]
        assert by_tag[3].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "max_in_flight" in by_tag[3].message
        other = modest.open("frozenlake", 4)
        assert all(r.status.code == 0 for r in modest.reset(other, seeds=[1, 2, 3, 4]))
        capped.close_sessions(ids)
        modest.close_sessions(other)


def test_opens_per_second_are_bounded_per_token(shared):
    with EnvClient(shared.address, token=SLOW) as slow:
        first = slow.open("frozenlake", 2)          # the burst
        with pytest.raises(ReplicaFullError) as e:
            slow.open("frozenlake", 1)
        assert "opens_per_second" in e.value.message and "retry in" in e.value.message
        with pytest.raises(ReplicaFullError) as e:
            slow.open("frozenlake", 3)               # more than a burst can ever hold
        assert "at most 2 in one call" in e.value.message
        slow.close_sessions(first)
