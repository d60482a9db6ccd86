"""Bearer tokens bound to sessions, the state service's own token, and TLS, on real servers."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from envserve.client import (AsyncEnvClient, EnvClient, EnvServeError, PermissionDeniedError,
                             UnauthenticatedError, UnavailableError, check)
from pki import make_pki
from serverproc import ServerProcess

ALICE, BOB, JUDGE = "alice-token-1", "bob-token-2", "judge-token-3"
DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]


OPS = "ops-token-4"  # a state token the operator lets read every session


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.txt"
    tokens.write_text(f"# session tokens\n{ALICE} name=alice\n{BOB} name=bob\n")
    with ServerProcess(["sokoban"], workers=2, metrics=False, extra=["--token-file", str(tokens)],
                       env_vars={"ENVSERVE_STATE_TOKENS": f"{JUDGE} name=judge,{OPS} name=ops reads=*"}) as s:
        yield s


def test_missing_and_wrong_tokens_are_unauthenticated(secured):
    for token in (None, "not-a-token"):
        with EnvClient(secured.address, token=token) as c:
            with pytest.raises(UnauthenticatedError):
                c.open("sokoban", 1)
            with pytest.raises(UnauthenticatedError):
                c.list_envs()
            with pytest.raises(UnauthenticatedError):
                c.list_tasks("sokoban")
            with pytest.raises(UnauthenticatedError):
                c.step([("x/y", "<answer>Up</answer>")])


def test_a_session_belongs_to_the_token_that_opened_it(secured):
    with EnvClient(secured.address, token=ALICE) as alice, EnvClient(secured.address, token=BOB) as bob:
        mine = alice.open("sokoban", 2)
        check(alice.reset(mine, 1)[0])
        theirs = bob.open("sokoban", 1)
        bob.reset(theirs, 2)
        # A mixed batch: Bob's own session steps, Alice's are refused item by item.
        results = bob.step([(mine[0], "<answer>Up</answer>"), (theirs[0], "<answer>Up</answer>"),
                            (mine[1], "<answer>Up</answer>")])
        assert [r.status.code for r in results] == [DENIED, 0, DENIED]
        assert "another token" in results[0].status.message
        with pytest.raises(PermissionDeniedError):
            check(bob.reset([mine[0]])[0])
        with pytest.raises(PermissionDeniedError):
            bob.fork(mine[0], 1)
        assert bob.close_sessions([mine[0]])[0].code == DENIED
        # Nothing Bob did touched Alice's session: it is at turn 0 and still open.
        assert check(alice.step_one(mine[0], "<answer>Up</answer>")).turn == 1
        assert alice.close_sessions(mine)[0].code == 0


def test_streaming_refuses_foreign_sessions(secured):
    async def run():
        async with AsyncEnvClient(secured.address, token=ALICE) as alice, \
                AsyncEnvClient(secured.address, token=BOB) as bob:
            sid = (await alice.open("sokoban", 1))[0]
            await alice.reset([sid], 4)
            async with bob.stream() as s:
                s.send_step(sid, "<answer>Up</answer>")
                (tag, result), = await s.recv()
            return result
    assert asyncio.run(run()).status.code == DENIED


def test_a_sync_clients_lane_carries_its_token(secured):
    """A step alone in its process goes on the replica's lane (an Interact stream of its own): the
    token travels on it, so the owner's step is answered and another token's is refused."""
    from envserve.client import StreamingClient
    with StreamingClient(secured.address, token=ALICE) as alice, StreamingClient(secured.address, token=BOB) as bob:
        sid = alice.open("sokoban", 1)[0]
        check(alice.reset([sid], [3])[0])
        assert check(alice.step([(sid, "<answer>Up</answer>")])[0]).turn == 1
        assert len(alice._lanes) == 1
        bob.list_envs()
        refused = bob.step([(sid, "<answer>Up</answer>")])[0]
        assert refused.status.code == DENIED and len(bob._lanes) == 1
        assert check(alice.step([(sid, "<answer>Up</answer>")])[0]).turn == 2
        alice.close_sessions([sid])


def test_state_service_needs_its_own_token(secured):
    with EnvClient(secured.address, token=ALICE, state_readers=["judge"]) as alice, \
            EnvClient(secured.address, token=JUDGE) as judge_on_env:
        sid = alice.open("sokoban", 1)[0]
        alice.reset_one(sid, 5)
        # The policy's token cannot read the ground truth, even of its own session.
        with pytest.raises(PermissionDeniedError, match="state token"):
            alice.get_state(sid)
        # The judge's token reads the truth of a session that grants it, but cannot act.
        with pytest.raises(PermissionDeniedError):
            judge_on_env.open("sokoban", 1)
        state = judge_on_env.get_state(sid)
        assert state.session_id == sid and state.anchor
    with EnvClient(secured.address, token=ALICE, state_token=JUDGE) as both:
        assert both.get_state(sid).turn == 0
    with EnvClient(secured.address) as nobody:
        with pytest.raises(UnauthenticatedError):
            nobody.get_state(sid)


def test_a_judge_reads_only_the_sessions_that_grant_it(secured):
    with EnvClient(secured.address, token=BOB) as bob, EnvClient(secured.address, token=JUDGE) as judge, \
            EnvClient(secured.address, token=OPS) as ops:
        private = bob.open("sokoban", 1)[0]
        bob.reset_one(private, 2)
        with pytest.raises(PermissionDeniedError, match="grants"):
            judge.get_state(private)
        # A state token the operator lets read everything (reads=*) does.
        assert ops.get_state(private).session_id == private
        # A grant names a state token the replica has; a typo is the caller's mistake.
        with EnvClient(secured.address, token=BOB, state_readers=["jduge"]) as typo:
            with pytest.raises(EnvServeError) as e:
                typo.open("sokoban", 1)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "jduge" in e.value.message
        # A fork keeps its parent's grants, and has no more.
        with EnvClient(secured.address, token=BOB, state_readers=["judge"]) as granting:
            shared = granting.open("sokoban", 1)[0]
            granting.reset_one(shared, 2)
            copy = granting.fork(shared, 1)[0]
        assert judge.get_state(copy).session_id == copy
        assert judge.get_state(shared).session_id == shared
        copy_of_private = bob.fork(private, 1)[0]
        with pytest.raises(PermissionDeniedError):
            judge.get_state(copy_of_private)
        bob.close_sessions([private, shared, copy, copy_of_private])


def test_a_token_entry_grants_a_judge_every_session_of_its_token(tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{ALICE} name=alice grants=judge\n{BOB} name=bob\n")
    state = tmp_path / "state.txt"
    state.write_text(f"{JUDGE} name=judge\n")
    with ServerProcess(["sokoban"], workers=1, metrics=False,
                       extra=["--token-file", str(tokens), "--state-token-file", str(state)]) as s:
        with EnvClient(s.address, token=ALICE) as alice, EnvClient(s.address, token=BOB) as bob, \
                EnvClient(s.address, token=JUDGE) as judge:
            a, b = alice.open("sokoban", 1)[0], bob.open("sokoban", 1)[0]
            alice.reset_one(a, 1)
            bob.reset_one(b, 1)
            assert judge.get_state(a).session_id == a
            with pytest.raises(PermissionDeniedError):
                judge.get_state(b)


def test_without_state_tokens_the_owner_reads_its_own_state():
    with ServerProcess(["sokoban"], workers=1, metrics=False, env_vars={"ENVSERVE_TOKENS": f"{ALICE},{BOB}"}) as s:
        with EnvClient(s.address, token=ALICE) as alice, EnvClient(s.address, token=BOB) as bob:
            sid = alice.open("sokoban", 1)[0]
            alice.reset_one(sid, 5)
            assert alice.get_state(sid).session_id == sid
            with pytest.raises(PermissionDeniedError):
                bob.get_state(sid)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    d = make_pki(tmp_path_factory.mktemp("pki"))
    return d


def test_tls_serves_clients_that_trust_its_ca(pki):
    ca = (pki / "ca.pem").read_bytes()
    with ServerProcess(["sokoban"], workers=1, metrics=False, tls_ca=ca,
                       extra=["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")]) as s:
        with EnvClient(s.address, root_certificates=str(pki / "ca.pem")) as c:
            sid = c.open("sokoban", 1)[0]
            assert check(c.reset_one(sid, 0)).observation.text
        from envserve.client import StreamingClient
        with StreamingClient(s.address, root_certificates=str(pki / "ca.pem")) as c:  # its lane too
            sid = c.open("sokoban", 1)[0]
            check(c.reset([sid], [0])[0])
            assert check(c.step([(sid, "<answer>Up</answer>")])[0]).turn == 1 and len(c._lanes) == 1
        with EnvClient(s.address, timeout=5) as plain:  # a plaintext client cannot talk to it
            with pytest.raises(UnavailableError):
                plain.list_envs()
        health = subprocess.run([sys.executable, "-m", "envserve.cli", "health", "--address", s.address, "--tls-ca", str(pki / "ca.pem")],
                                capture_output=True, text=True)
        assert health.returncode == 0 and "SERVING" in health.stdout


def test_mutual_tls_requires_a_client_certificate(pki):
    ca = (pki / "ca.pem").read_bytes()
    extra = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
             "--tls-client-ca", str(pki / "ca.pem")]
    pass_ = grpc.ssl_channel_credentials(ca, (pki / "client.key").read_bytes(), (pki / "client.pem").read_bytes())
    with ServerProcess(["sokoban"], workers=1, metrics=False, extra=extra, tls_ca=pass_) as s:
        with EnvClient(s.address, channel=grpc.secure_channel(s.address, pass_)) as c:
            assert [e.env_id for e in c.list_envs()] == ["sokoban"]
        with EnvClient(s.address, root_certificates=ca, timeout=5) as no_cert:
            with pytest.raises(UnavailableError):
                no_cert.list_envs()


def test_monitor_service_is_authorised_like_state(secured):
    from envserve.v1 import envserve_pb2 as pb
    from envserve.v1 import envserve_pb2_grpc as pb_grpc
    with EnvClient(secured.address, token=ALICE) as alice:
        sid = alice.open("sokoban", 1)[0]
        alice.reset_one(sid, 5)
    with grpc.insecure_channel(secured.address) as ch:
        stub = pb_grpc.MonitorServiceStub(ch)
        for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), (ALICE, grpc.StatusCode.PERMISSION_DENIED)):
            with pytest.raises(grpc.RpcError) as e:
                stub.ListSessions(pb.ListSessionsRequest(), metadata=(("authorization", f"Bearer {token}"),)
                                  if token else None)
            assert e.value.code() == code
        # A state token sees the sessions that grant it; one the operator lets read all sees every one.
        seen = stub.ListSessions(pb.ListSessionsRequest(), metadata=(("authorization", f"Bearer {JUDGE}"),))
        assert sid not in [s.session_id for s in seen.sessions]
        seen = stub.ListSessions(pb.ListSessionsRequest(), metadata=(("authorization", f"Bearer {OPS}"),))
        assert sid in [s.session_id for s in seen.sessions]
