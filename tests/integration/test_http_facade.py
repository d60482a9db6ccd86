"""The HTTP/JSON facade (`envserve web`) over real replica processes on loopback."""
import base64
import functools
import io
import time

import grpc
import httpx
import pytest
from PIL import Image

from envserve.client import EnvClient, check
from envserve.directory import ReplicaInfo, open_directory, replica_of
from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc
from serverproc import ServerProcess, calls_while_it_stops, start_together
from webproc import WebProcess

MOVE = "<think>plan</think><answer>{}</answer>"


@pytest.fixture(scope="module")
def replica_a():
    with ServerProcess(["sokoban", "frozenlake"], workers=1, metrics=False) as s:
        yield s


@pytest.fixture(scope="module")
def replica_b():
    with ServerProcess(["sokoban"], workers=1, metrics=False) as s:
        yield s


@pytest.fixture(scope="module")
def web(replica_a, replica_b):
    with WebProcess.facade([replica_a.address, replica_b.address]) as w:
        yield w


@pytest.fixture
def http(web):
    with httpx.Client(base_url=web.url, timeout=60) as c:
        yield c


def grpc_client_for(session_id, *replicas):
    """A gRPC client on the replica a session id names."""
    for r in replicas:
        with EnvClient(r.address) as c:
            if c.env.ListEnvs(pb.ListEnvsRequest()).replica_id == replica_of(session_id):
                return EnvClient(r.address)
    raise AssertionError(f"no replica holds {session_id}")


def ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()


def live_sessions(http, **params) -> dict:
    body = ok(http.get("/v1/live", params=params))
    return {s["sessionId"]: s for r in body["replicas"] for s in r["sessions"]}


def test_envs_and_specs(http):
    body = ok(http.get("/v1/envs"))
    assert {e["envId"] for e in body["envs"]} == {"sokoban", "frozenlake"}
    assert len(body["replicas"]) == 2 and all(r["replicaId"] for r in body["replicas"])
    spec = ok(http.get("/v1/envs/frozenlake"))
    assert spec["envId"] == "frozenlake" and spec["maxActionsPerTurn"] == 3 and "free_think" in spec["actionFormats"]


def test_tasks_over_http_are_the_replicas_listing(http, replica_a):
    first = ok(http.get("/v1/envs/sokoban/tasks", params={"split": "test", "page_size": 2}))
    with EnvClient(replica_a.address) as c:
        grpc_page = c.list_tasks("sokoban", "test", 4)
    assert int(first["total"]) == grpc_page.total == 100_000
    following = ok(http.get("/v1/envs/sokoban/tasks", params={"split": "test", "page_size": 2,
                                                              "page_token": first["nextPageToken"]}))
    assert [t["taskId"] for t in first["tasks"] + following["tasks"]] == [t.task_id for t in grpc_page.tasks]
    assert first["tasks"][0]["parameters"]["num_boxes"] == 1 and first["tasks"][0]["split"] == "test"
    default = ok(http.get("/v1/envs/frozenlake/tasks"))
    assert len(default["tasks"]) == 100 and default["tasks"][0]["split"] == "train"


def test_episodes_of_a_scope_opened_over_http_are_counted(http):
    sid = ok(http.post("/v1/sessions", json={"envId": "frozenlake", "count": 1, "statsScope": "http-run",
                                             "config": {"max_turns": 1}}))["sessionIds"][0]
    ok(http.post("/v1/reset", json={"items": [{"sessionId": sid, "seed": 12}]}))
    ok(http.post("/v1/step", json={"items": [{"sessionId": sid, "action": MOVE.format("Left")}]}))
    deadline = time.monotonic() + 60
    while not (found := ok(http.get("/v1/envs/frozenlake/task-stats", params={"scope": "http-run"})).get("stats")):
        assert time.monotonic() < deadline, "the episode was never counted"
        time.sleep(0.25)
    assert [(s["taskId"], s["episodes"]) for s in found] == [("12", "1")]   # int64 travels as a JSON string


def test_session_opened_over_http_is_a_grpc_session(http, replica_a, replica_b):
    opened = ok(http.post("/v1/sessions", json={"envId": "sokoban", "count": 1, "actionFormat": "free_think",
                                                "config": {"render_image": True}}))
    sid = opened["sessionIds"][0]
    assert opened["leaseSeconds"] > 0 and "<answer>" in opened["systemPrompt"]
    first = ok(http.post("/v1/reset", json={"items": [{"sessionId": sid, "seed": 7}]}))["results"][0]
    assert first["status"]["code"] == 0 and first["turn"] == 0
    png = base64.b64decode(first["observation"]["images"][0]["png"])
    assert Image.open(io.BytesIO(png)).size == (128, 128)
    with grpc_client_for(sid, replica_a, replica_b) as env:
        over_grpc = check(env.step([(sid, MOVE.format("Left"))])[0])
        assert over_grpc.turn == 1
        truth = env.get_state(sid, turn=1)
    state = ok(http.get(f"/v1/sessions/{sid}/state", params={"turn": 1}))
    assert state["anchor"] == truth.anchor == over_grpc.anchor
    assert state["observationText"] == over_grpc.observation.text
    second = ok(http.post("/v1/step", json={"items": [{"session_id": sid, "action": MOVE.format("Right")}]}))
    assert second["results"][0]["turn"] == 2
    ok(http.post("/v1/close", json={"sessionIds": [sid]}))
    with grpc_client_for(sid, replica_a, replica_b) as env:
        assert env.step([(sid, MOVE.format("Up"))])[0].status.code == grpc.StatusCode.NOT_FOUND.value[0]


def test_session_opened_over_grpc_is_driven_over_http(http, replica_a):
    with EnvClient(replica_a.address) as env:
        sid = env.open("frozenlake", 1)[0]
        env.reset([sid], seeds=[3])
        step = ok(http.post("/v1/step", json={"items": [{"sessionId": sid, "action": MOVE.format("Down")}]}))
        r = step["results"][0]
        assert r["status"]["code"] == 0 and r["turn"] == 1 and r["parsedActions"] == ["Down"]
        assert env.get_state(sid).observation_text == r["observation"]["text"]
        forks = ok(http.post("/v1/fork", json={"sessionId": sid, "count": 2}))["sessionIds"]
        assert len(forks) == 2 and all(replica_of(f) == replica_of(sid) for f in forks)
        assert [check(x).turn for x in env.step([(f, MOVE.format("Right")) for f in forks])] == [2, 2]
        closed = ok(http.post("/v1/close", json={"sessionIds": [sid, *forks]}))
        assert [s["code"] for s in closed["statuses"]] == [0, 0, 0]


def test_batches_keep_per_item_statuses_across_replicas(http, replica_a, replica_b):
    with EnvClient(replica_a.address) as a, EnvClient(replica_b.address) as b:
        sa, sb = a.open("sokoban", 1)[0], b.open("sokoban", 1)[0]
    missing = f"{replica_of(sa)}/00000000deadbeef"
    body = ok(http.post("/v1/reset", json={"items": [
        {"sessionId": sa, "seed": 1}, {"sessionId": missing}, {"sessionId": sb, "seed": 2}]}))
    results = body["results"]
    assert [r["sessionId"] for r in results] == [sa, missing, sb]
    assert [r["status"]["code"] for r in results] == [0, 5, 0]
    assert "unknown session" in results[1]["status"]["message"]
    # A session naming a replica the facade never knew is unknown (NOT_FOUND, as a replica says of
    # an id it never gave), and so is a non-id; only a known replica that is gone loses sessions
    # (DATA_LOSS: test_routing_through_a_directory).
    body = ok(http.post("/v1/step", json={"items": [
        {"sessionId": "no-such-replica/1234", "action": "x"}, {"sessionId": sb, "action": MOVE.format("Up")},
        {"sessionId": "plainword", "action": "x"}]}))
    assert [r["status"]["code"] for r in body["results"]] == [5, 0, 5]
    assert "unknown session" in body["results"][0]["status"]["message"]
    # Stepping before a reset is the item's own FAILED_PRECONDITION, not the call's.
    with EnvClient(replica_b.address) as b:
        unreset = b.open("sokoban", 1)[0]
    body = ok(http.post("/v1/step", json={"items": [{"sessionId": unreset, "action": "x"}]}))
    assert body["results"][0]["status"]["code"] == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    statuses = ok(http.post("/v1/close", json={"sessionIds": [sa, missing, sb, unreset]}))["statuses"]
    assert [s["code"] for s in statuses] == [0, 5, 0, 0]


def test_errors_of_whole_calls(http, replica_a):
    def error(resp, status, code):
        assert resp.status_code == status, resp.text
        body = resp.json()
        assert body["code"] == code and body["message"], body
        return body["message"]

    assert "not served" in error(http.post("/v1/sessions", json={"envId": "nope"}), 404, "NOT_FOUND")
    error(http.get("/v1/envs/nope"), 404, "NOT_FOUND")
    error(http.get("/v1/envs/nope/tasks"), 404, "NOT_FOUND")
    assert "unknown split" in error(http.get("/v1/envs/sokoban/tasks", params={"split": "nope"}), 400, "INVALID_ARGUMENT")
    assert "page_token" in error(http.get("/v1/envs/sokoban/tasks", params={"page_token": "x"}), 400, "INVALID_ARGUMENT")
    error(http.get("/v1/envs/sokoban/tasks", params={"page_size": -1}), 400, "INVALID_ARGUMENT")
    assert "JSON" in error(http.post("/v1/step", content=b'{"items": [}', headers={"Content-Type": "application/json"}),
                           400, "INVALID_ARGUMENT")
    assert "itemz" in error(http.post("/v1/step", json={"itemz": []}), 400, "INVALID_ARGUMENT")
    error(http.post("/v1/reset", json=[1, 2]), 400, "INVALID_ARGUMENT")
    error(http.post("/v1/step", json={"items": [{"sessionId": 5}]}), 400, "INVALID_ARGUMENT")
    error(http.post("/v1/sessions", json={"envId": "sokoban", "config": {"no_such_key": 1}}), 400, "INVALID_ARGUMENT")
    error(http.post("/v1/sessions", json={"envId": "sokoban", "count": -3}), 400, "INVALID_ARGUMENT")
    with EnvClient(replica_a.address) as env:
        rid = env.env.ListEnvs(pb.ListEnvsRequest()).replica_id
    error(http.post("/v1/fork", json={"sessionId": f"{rid}/0000"}), 404, "NOT_FOUND")
    error(http.get(f"/v1/sessions/{rid}/0000/state"), 404, "NOT_FOUND")
    error(http.get(f"/v1/sessions/{rid}/0000/state", params={"turn": "abc"}), 400, "INVALID_ARGUMENT")
    error(http.get("/v1/no-such-route"), 404, "NOT_FOUND")


def test_open_over_http_says_the_replicas_cap(http):
    """An HTTP Open goes to one replica, as a gRPC Open: more than its --max-open-per-call is a 400
    naming the cap, and every reply says the cap, so an HTTP client knows how to split."""
    resp = http.post("/v1/sessions", json={"envId": "sokoban", "count": 5000})
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["code"] == "INVALID_ARGUMENT" and "1..4096" in body["message"], body
    assert "--max-open-per-call" in body["message"]
    opened = ok(http.post("/v1/sessions", json={"envId": "sokoban", "count": 2}))
    assert opened["maxOpenPerCall"] == 4096 and opened["maxBatchItems"] == 4096
    ok(http.post("/v1/close", json={"sessionIds": opened["sessionIds"]}))


def test_open_goes_to_the_least_loaded_replica(http, replica_a, replica_b):
    def total(r):
        with grpc.insecure_channel(r.address) as ch:
            return pb_grpc.MonitorServiceStub(ch).ListSessions(pb.ListSessionsRequest(limit=1)).total

    with EnvClient(replica_a.address) as a, EnvClient(replica_b.address) as b:
        rid_b = b.env.ListEnvs(pb.ListEnvsRequest()).replica_id
        rid_a = a.env.ListEnvs(pb.ListEnvsRequest()).replica_id
        ballast = a.open("sokoban", total(replica_b) - total(replica_a) + 3)
        try:
            sid = ok(http.post("/v1/sessions", json={"envId": "sokoban"}))["sessionIds"][0]
            assert replica_of(sid) == rid_b
            # Only A serves frozenlake, however loaded it is.
            fl = ok(http.post("/v1/sessions", json={"envId": "frozenlake", "count": 2}))["sessionIds"]
            assert {replica_of(s) for s in fl} == {rid_a}
            ok(http.post("/v1/close", json={"sessionIds": [sid, *fl]}))
        finally:
            a.close_sessions(ballast)


def test_live_listing_follows_steps(http, replica_b):
    with EnvClient(replica_b.address) as env:
        sid = env.open("sokoban", 1, {"render_image": True})[0]
        env.reset([sid], seeds=[11])
        r1 = check(env.step([(sid, MOVE.format("Left"))])[0])
        s = live_sessions(http, limit=1000)[sid]
        assert (s["turn"], s["lastAction"], s["envId"], s["started"]) == (1, MOVE.format("Left"), "sokoban", True)
        assert s["reward"] == pytest.approx(r1.reward)
        assert base64.b64decode(s["image"]["png"]) == r1.observation.images[0].png
        r2 = check(env.step([(sid, MOVE.format("Up, Up"))])[0])
        s = live_sessions(http, limit=1000)[sid]
        assert s["turn"] == 2 and s["episodeReturn"] == pytest.approx(r1.reward + r2.reward)
        assert s["observationText"] == r2.observation.text
        assert "image" not in live_sessions(http, limit=1000, images="false")[sid]
        assert sid not in live_sessions(http, env_id="frozenlake", limit=1000)
        env.close_sessions([sid])
    assert sid not in live_sessions(http, limit=1000)


def test_routing_through_a_directory(replica_a):
    """Replicas listed in a directory: load from their records, draining ones skipped; a replica
    that stops answering is unavailable while listed, and lost with its sessions once it is gone."""
    from envserve.web import create_app, start_in_thread

    directory = open_directory("memory://web-routing-test")

    def register(rid, address, live, draining=False):
        directory.heartbeat(ReplicaInfo(rid, address, ["sokoban"], capacity=100, live_sessions=live,
                                        draining=draining), ttl_seconds=600)

    with ServerProcess(["sokoban"], workers=1, metrics=False) as replica_c, \
            EnvClient(replica_a.address) as a, EnvClient(replica_c.address) as c:
        rid_a = a.env.ListEnvs(pb.ListEnvsRequest()).replica_id
        rid_c = c.env.ListEnvs(pb.ListEnvsRequest()).replica_id
        register(rid_a, replica_a.address, live=90)
        register(rid_c, replica_c.address, live=10)
        server, port = start_in_thread(create_app(directory_url="memory://web-routing-test", refresh_seconds=0.0),
                                       "127.0.0.1", 0)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                on_c = ok(http.post("/v1/sessions", json={"envId": "sokoban"}))["sessionIds"][0]
                assert replica_of(on_c) == rid_c
                register(rid_c, replica_c.address, live=10, draining=True)
                on_a = ok(http.post("/v1/sessions", json={"envId": "sokoban"}))["sessionIds"][0]
                assert replica_of(on_a) == rid_a
                ok(http.post("/v1/reset", json={"items": [{"sessionId": on_a, "seed": 1},
                                                           {"sessionId": on_c, "seed": 1}]}))
                steps = {"items": [{"sessionId": on_a, "action": MOVE.format("Up")},
                                   {"sessionId": on_c, "action": MOVE.format("Up")}]}
                replica_c.kill()
                codes = [r["status"]["code"] for r in ok(http.post("/v1/step", json=steps))["results"]]
                assert codes == [0, grpc.StatusCode.UNAVAILABLE.value[0]]
                directory.deregister(rid_c)
                codes = [r["status"]["code"] for r in ok(http.post("/v1/step", json=steps))["results"]]
                assert codes == [0, grpc.StatusCode.DATA_LOSS.value[0]]
                ok(http.post("/v1/close", json={"sessionIds": [on_a]}))
        finally:
            server.should_exit = True
            directory.deregister(rid_a)


def test_bearer_token_is_forwarded(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alpha-token\nbeta-token\n")
    with ServerProcess(["frozenlake"], workers=1, metrics=False, extra=["--token-file", str(tokens)]) as s, \
            WebProcess.facade([s.address]) as w, httpx.Client(base_url=w.url, timeout=60) as http:
        refused = http.post("/v1/sessions", json={"envId": "frozenlake"})
        assert refused.status_code == 401 and refused.json()["code"] == "UNAUTHENTICATED"
        alpha = {"Authorization": "Bearer alpha-token"}
        sid = ok(http.post("/v1/sessions", json={"envId": "frozenlake"}, headers=alpha))["sessionIds"][0]
        ok(http.post("/v1/reset", json={"items": [{"sessionId": sid, "seed": 0}]}, headers=alpha))
        # The session belongs to the token that opened it, over HTTP as over gRPC.
        other = ok(http.post("/v1/step", json={"items": [{"sessionId": sid, "action": MOVE.format("Down")}]},
                             headers={"Authorization": "Bearer beta-token"}))
        assert other["results"][0]["status"]["code"] == grpc.StatusCode.PERMISSION_DENIED.value[0]
        with EnvClient(s.address, token="alpha-token") as env:
            assert check(env.step([(sid, MOVE.format("Down"))])[0]).turn == 1
        no_token = http.post("/v1/step", json={"items": [{"sessionId": sid, "action": "x"}]})
        assert no_token.status_code == 401 and no_token.json()["code"] == "UNAUTHENTICATED"


def test_up_serves_the_facade_beside_the_replica():
    with WebProcess(["up", "sokoban", "--port", "0", "--workers", "1", "--http-port", "0"]) as w, \
            httpx.Client(base_url=w.url, timeout=60) as http:
        # The replica registers in the in-process directory a moment after the facade is up.
        for _ in range(600):
            if ok(http.get("/v1/envs"))["envs"]:
                break
            time.sleep(0.1)
        sid = ok(http.post("/v1/sessions", json={"envId": "sokoban"}))["sessionIds"][0]
        ok(http.post("/v1/reset", json={"items": [{"sessionId": sid, "seed": 2}]}))
        ok(http.post("/v1/step", json={"items": [{"sessionId": sid, "action": MOVE.format("Left")}]}))
        assert live_sessions(http)[sid]["turn"] == 1


def test_an_open_that_reaches_a_stopping_replica_opens_on_another():
    """Opens over HTTP from threads while one of the two replicas stops: those that reach it as its
    gRPC server shuts down (which cancels them) go to the other replica, like a refused one."""
    stopping, other = start_together(*[functools.partial(ServerProcess, ["sokoban"], workers=1, metrics=False)] * 2)
    try:
        with WebProcess.facade([stopping.address, other.address]) as w, \
                httpx.Client(base_url=w.url, timeout=60) as http:
            def open_one():
                r = http.post("/v1/sessions", json={"envId": "sokoban"})
                return "OK" if r.status_code == 200 else f"{r.status_code} {r.text[:120]}"
            outcomes = calls_while_it_stops(stopping.proc, open_one, threads=6)
    finally:
        stopping.kill()
        other.kill()
    assert set(outcomes) == {"OK"}, outcomes
