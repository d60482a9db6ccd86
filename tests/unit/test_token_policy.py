"""Token entries (names, quotas, grants), the readers they make, and quotas counted per token."""
from __future__ import annotations

import pytest

from envserve.rpc.auth import (Authenticator, Reader, TokenFileError, owner_of, read_token_entries, read_tokens)
from envserve.server.quotas import DEFAULT_OPENS_PER_SECOND, QuotaExceeded, Quotas


def test_token_files_keep_options_and_clients_read_the_tokens_alone(tmp_path):
    f = tmp_path / "tokens.txt"
    f.write_text("# teams\nT1   name=a   grants=judge\n\nT2\n* max_sessions=5\n")
    assert read_token_entries(str(f), "T3 name=c,T1   name=a   grants=judge") == (
        "T1 name=a grants=judge", "T2", "* max_sessions=5", "T3 name=c")
    assert read_tokens(str(f)) == ("T1", "T2")       # what a client sends: no options, no defaults


def test_policies_carry_names_quotas_and_grants():
    auth = Authenticator(("A name=alice max_sessions=3 max_in_flight=7 grants=j1 grants=j2", "B",
                          "* opens_per_second=2.5"), ("J1 name=j1", "J2 name=j2 reads=*"))
    alice = auth.policy(owner_of("A"))
    assert alice.name == "alice" and alice.quota.max_sessions == 3 and alice.quota.max_in_flight == 7
    assert alice.grants == {"j1", "j2"}
    assert auth.policy(owner_of("B")).name.startswith("token-")   # unnamed: a digest prefix, never the token
    assert auth.default_quota.opens_per_second == 2.5
    assert auth.readers_for(owner_of("A"), ["j2"]) == {"j1", "j2"}
    assert auth.readers_for(owner_of("B")) == frozenset()


@pytest.mark.parametrize("entries, state, message", [
    (("A max_sessions=0",), (), "above 0"),
    (("A max_sessions=lots",), (), "must be a number"),
    (("A colour=blue",), (), "unknown option 'colour'"),
    (("A name",), (), "not key=value"),
    (("A name=x", "B name=x"), (), "share the name"),
    (("A name=x name=y",), (), "given twice"),
    ((), ("J reads=some",), "reads takes '*'"),
    ((), ("J max_sessions=3",), "unknown option"),
    ((), ("* max_sessions=3",), "session tokens only"),
])
def test_bad_entries_name_what_is_wrong(entries, state, message):
    with pytest.raises(TokenFileError, match=message):
        Authenticator(entries, state)


def test_readers_read_what_they_were_granted():
    owner = owner_of("A")
    assert Reader(owner=owner).may_read(owner, frozenset())
    assert not Reader(owner=owner_of("B")).may_read(owner, frozenset({"judge"}))
    assert Reader(name="judge").may_read(owner, frozenset({"judge"}))
    assert not Reader(name="judge").may_read(owner, frozenset({"other"}))
    assert Reader(name="ops", reads_all=True).may_read(owner, frozenset())


def test_an_unknown_grant_is_refused_by_name():
    auth = Authenticator(("A",), ("J name=judge",))
    with pytest.raises(Exception, match="jduge"):
        auth.readers_for(owner_of("A"), ["jduge"])


class Clock:
    """A clock the test moves by hand (the token bucket reads time through it)."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_sessions_default_to_an_equal_share_and_come_back_when_closed():
    a, b = owner_of("A"), owner_of("B")
    q = Quotas(Authenticator(("A", "B")), capacity=9, max_open_per_call=4096)
    assert q.quota(a).max_sessions == 5 and q.quota(a).max_in_flight == 10    # ceil(9 / 2), twice that
    assert q.quota(a).opens_per_second == DEFAULT_OPENS_PER_SECOND
    q.admit_sessions(a, 5)
    q.opened(a, 5)
    with pytest.raises(QuotaExceeded, match="max_sessions"):
        q.admit_sessions(a, 1)
    q.admit_sessions(b, 5)          # the other token's share is untouched
    q.closed(a, 2)
    q.admit_sessions(a, 2)
    assert Quotas(Authenticator(()), 9, 4096).quota("") is None    # no tokens: no quotas


def test_opens_refill_at_their_rate():
    clock = Clock()
    a = owner_of("A")
    q = Quotas(Authenticator(("A opens_per_second=2 open_burst=4",)), 100, 4096, clock=clock)
    q.admit_sessions(a, 4)
    with pytest.raises(QuotaExceeded, match=r"retry in 0\.50 s"):
        q.admit_sessions(a, 1)
    clock.now += 0.5
    q.admit_sessions(a, 1)
    with pytest.raises(QuotaExceeded, match="at most 4 in one call"):
        q.admit_sessions(a, 5)


def test_items_in_flight_are_counted_and_given_back():
    a = owner_of("A")
    q = Quotas(Authenticator(("A max_in_flight=3",)), 100, 4096)
    q.take_items(a, 2)
    with pytest.raises(QuotaExceeded, match="max_in_flight"):
        q.take_items(a, 2)
    assert q.in_flight[a] == 2       # a refused take counts nothing
    q.give_items(a, 2)
    q.take_items(a, 3)
