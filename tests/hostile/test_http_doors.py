"""The HTTP doors tried as a hostile caller, through real servers on loopback: a replica with
tokens (`--token-file`) and its own OpenEnv endpoint (`--openenv-port`), and the facade in front
of it (`envserve web`). Another token's session is never readable, closable, steppable or
resettable through any HTTP or WebSocket door; bodies are bounded while they are read; JSON
routes take JSON only, finite and not too deep; every refusal is a clean code; and afterwards
both servers still answer a normal call."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import httpx
import psutil
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from envserve.client import EnvClient
from envserve.directory import replica_of
from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc
from serverproc import ServerProcess
from webproc import WebProcess

ALICE, BOB, MONITOR, JUDGE = "alice-token-1", "bob-token-2", "monitor-token-3", "judge-token-4"
AS_ALICE = {"Authorization": f"Bearer {ALICE}"}
AS_BOB = {"Authorization": f"Bearer {BOB}"}
AS_MONITOR = {"Authorization": f"Bearer {MONITOR}"}
MOVE = "<answer>{}</answer>"
MIB = 1 << 20


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    (d / "tokens").write_text(f"{ALICE}\n{BOB}\n")
    # The page's token reads every session; the judge's only those whose owner granted it (none here).
    (d / "state-tokens").write_text(f"{MONITOR} name=monitor reads=*\n{JUDGE} name=judge\n")
    (d / "monitor").write_text(f"{MONITOR}\n")
    return d


@pytest.fixture(scope="module")
def replica(secrets_dir):
    with ServerProcess(["sokoban", "frozenlake"], workers=1, metrics=False,
                       extra=["--token-file", str(secrets_dir / "tokens"),
                              "--state-token-file", str(secrets_dir / "state-tokens"), "--openenv-port", "0"]) as s:
        line = next(x for x in s.output if "envserve openenv on " in x)
        s.openenv_url = line.split("envserve openenv on ")[1].split()[0]
        yield s


@pytest.fixture(scope="module")
def facade(replica, secrets_dir):
    with WebProcess.facade([replica.address], extra=["--monitor-token-file", str(secrets_dir / "monitor")]) as w:
        yield w


@pytest.fixture(scope="module")
def small_facade(replica):
    """A facade with small limits, that takes tokens over plain HTTP from anywhere (as behind a
    TLS-ending proxy)."""
    with WebProcess.facade([replica.address], extra=["--max-body-bytes", str(MIB), "--openenv-max-http-sessions", "2",
                                                     "--allow-plain-http-tokens"]) as w:
        yield w


@pytest.fixture(scope="module", params=["facade", "replica"])
def openenv_base(request, facade, replica):
    """An OpenEnv base URL for sokoban: through the facade, or the replica's own endpoint."""
    if request.param == "facade":
        return facade.url + "/openenv/sokoban"
    return replica.openenv_url + "/sokoban"


def refused(resp: httpx.Response, status: int, code: str, words: str = "") -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["code"] == code and body["message"], body
    assert words.lower() in body["message"].lower(), body
    return body["message"]


def truth(replica, sid: str) -> pb.SessionSummary | None:
    """The replica's own record of a session (MonitorService, with the token that reads all)."""
    with grpc.insecure_channel(replica.address) as ch:
        reply = pb_grpc.MonitorServiceStub(ch).ListSessions(pb.ListSessionsRequest(limit=10000),
                                                            metadata=(("authorization", f"Bearer {MONITOR}"),))
    return next((s for s in reply.sessions if s.session_id == sid), None)


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://", 1) + "/ws"


async def socket_exchange(url: str, headers: dict, messages=(), unasked: bool = False) -> list[dict]:
    """Opens a socket, reads what comes unasked (when told to), sends messages one by one and reads
    each reply; stops at the first error reply or when the server closes."""
    replies = []
    async with connect(url, additional_headers=headers, ping_interval=None, max_size=None) as ws:
        try:
            if unasked:
                replies.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
                if replies[-1]["type"] == "error":
                    return replies
            for m in messages:
                await ws.send(m if isinstance(m, (str, bytes)) else json.dumps(m))
                replies.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
        except ConnectionClosed:
            replies.append({"type": "closed"})
    return replies


# -- ownership ---------------------------------------------------------------------------------------------
def test_another_tokens_openenv_session_is_never_touched(openenv_base, replica):
    opened = httpx.post(f"{openenv_base}/reset", json={"seed": 3}, headers=AS_ALICE, timeout=60)
    assert opened.status_code == 200, opened.text
    sid = opened.json()["metadata"]["session_id"]
    step = httpx.post(f"{openenv_base}/step", json={"session_id": sid, "action": {"message": MOVE.format("Up")}},
                      headers=AS_ALICE, timeout=60)
    assert step.status_code == 200 and step.json()["metadata"]["turn"] == 1, step.text
    before = truth(replica, sid)
    assert before.turn == 1

    for headers, status, code in (({}, 401, "UNAUTHENTICATED"), (AS_BOB, 403, "PERMISSION_DENIED")):
        with httpx.Client(base_url=openenv_base, headers=headers, timeout=60) as c:
            refused(c.get("/state", params={"session_id": sid}), status, code)
            refused(c.post("/step", json={"session_id": sid, "action": {"message": MOVE.format("Down")}}),
                    status, code)
            refused(c.post("/reset", json={"session_id": sid, "seed": 9}), status, code)
            refused(c.post("/reset", json={"session_id": sid, "config": {"render_image": True}}), status, code)
            refused(c.post("/close", json={"session_id": sid}), status, code)
        # A socket attaching to it is told no and closed before it can do anything.
        replies = asyncio.run(socket_exchange(f"{ws_url(openenv_base)}?session_id={sid}", headers,
                                              [{"type": "step", "data": {"message": MOVE.format("Down")}}],
                                              unasked=True))
        assert replies[0]["type"] == "error" and replies[0]["data"]["status"] == code, replies
    # A token the replica does not know fares no better.
    with httpx.Client(base_url=openenv_base, headers={"Authorization": "Bearer nobody"}, timeout=60) as c:
        r = c.get("/state", params={"session_id": sid})
        assert r.status_code in (401, 403) and r.json()["code"] in ("UNAUTHENTICATED", "PERMISSION_DENIED"), r.text

    # Nothing happened to it: same turn, same last action, still open, still the opener's.
    after = truth(replica, sid)
    assert after is not None and (after.turn, after.last_action) == (1, MOVE.format("Up"))
    state = httpx.get(f"{openenv_base}/state", params={"session_id": sid}, headers=AS_ALICE, timeout=60)
    assert state.status_code == 200 and state.json()["step_count"] == 1, state.text
    # Its owner attaches a socket and steps on.
    replies = asyncio.run(socket_exchange(f"{ws_url(openenv_base)}?session_id={sid}", AS_ALICE,
                                          [{"type": "step", "data": {"message": MOVE.format("Left")}}]))
    assert replies[0]["type"] == "observation" and replies[0]["data"]["metadata"]["turn"] == 2, replies
    closed = httpx.post(f"{openenv_base}/close", json={"session_id": sid}, headers=AS_ALICE, timeout=60)
    assert closed.status_code == 200 and closed.json()["closed"] is True
    assert truth(replica, sid) is None


def test_each_socket_session_belongs_to_its_own_token(openenv_base, replica):
    """Two sockets of two tokens: each steps its own session, with its own credentials."""
    async def run():
        alice = await socket_exchange(ws_url(openenv_base), AS_ALICE, [{"type": "reset", "data": {"seed": 1}}])
        bob = await socket_exchange(ws_url(openenv_base), AS_BOB, [{"type": "reset", "data": {"seed": 1}}])
        nobody = await socket_exchange(ws_url(openenv_base), {}, unasked=True)
        return alice, bob, nobody
    alice, bob, nobody = asyncio.run(run())
    assert alice[0]["type"] == bob[0]["type"] == "observation"
    assert alice[0]["data"]["metadata"]["session_id"] != bob[0]["data"]["metadata"]["session_id"]
    assert nobody[0]["type"] == "error" and nobody[0]["data"]["status"] == "UNAUTHENTICATED", nobody


def test_v1_routes_go_out_with_the_callers_own_token(facade, replica):
    with httpx.Client(base_url=facade.url, timeout=60) as http:
        sid = http.post("/v1/sessions", json={"envId": "sokoban"}, headers=AS_ALICE).json()["sessionIds"][0]
        assert http.post("/v1/reset", json={"items": [{"sessionId": sid, "seed": 2}]},
                         headers=AS_ALICE).json()["results"][0]["status"]["code"] == 0
        denied = grpc.StatusCode.PERMISSION_DENIED.value[0]
        for route, body in (("/v1/step", {"items": [{"sessionId": sid, "action": MOVE.format("Up")}]}),
                            ("/v1/reset", {"items": [{"sessionId": sid, "seed": 5}]})):
            r = http.post(route, json=body, headers=AS_BOB)
            assert r.status_code == 200 and r.json()["results"][0]["status"]["code"] == denied, r.text
            refused(http.post(route, json=body), 401, "UNAUTHENTICATED")
        r = http.post("/v1/close", json={"sessionIds": [sid]}, headers=AS_BOB)
        assert r.json()["statuses"][0]["code"] == denied, r.text
        refused(http.post("/v1/fork", json={"sessionId": sid}, headers=AS_BOB), 403, "PERMISSION_DENIED")
        refused(http.get(f"/v1/sessions/{sid}/state", headers=AS_BOB), 403, "PERMISSION_DENIED")
        refused(http.get(f"/v1/sessions/{sid}/state"), 401, "UNAUTHENTICATED")
        summary = truth(replica, sid)
        assert summary is not None and summary.turn == 0
        r = http.post("/v1/step", json={"items": [{"sessionId": sid, "action": MOVE.format("Up")}]}, headers=AS_ALICE)
        assert r.json()["results"][0]["turn"] == 1
        assert http.post("/v1/close", json={"sessionIds": [sid]}, headers=AS_ALICE).json()["statuses"][0]["code"] == 0


def test_the_live_page_shows_everything_only_to_the_monitor_token(facade, replica):
    with EnvClient(replica.address, token=ALICE) as alice, EnvClient(replica.address, token=BOB) as bob:
        mine, theirs = alice.open("sokoban", 1)[0], bob.open("sokoban", 1)[0]
        with httpx.Client(base_url=facade.url, timeout=60) as http:
            def seen(headers):
                r = http.get("/v1/live", params={"limit": 10000, "images": "false"}, headers=headers)
                assert r.status_code == 200, r.text
                return {s["sessionId"] for rep in r.json()["replicas"] for s in rep["sessions"]}
            refused(http.get("/v1/live"), 401, "UNAUTHENTICATED", "token")
            refused(http.get("/v1/live", headers={"Authorization": "Bearer nobody"}), 401, "UNAUTHENTICATED")
            assert {mine, theirs} <= seen(AS_MONITOR)
            # Another token is passed on as it is: the replica shows it what it may read.
            assert not {mine, theirs} & seen({"Authorization": f"Bearer {JUDGE}"})
            refused(http.get("/v1/live", headers=AS_BOB), 403, "PERMISSION_DENIED", "state token")
            # The page itself is served to anyone: it asks for the token.
            assert http.get("/").status_code == 200
        alice.close_sessions([mine])
        bob.close_sessions([theirs])


# -- bounded reading --------------------------------------------------------------------------------------
def _chunks(total: int, size: int = MIB):
    block = b" " * size
    sent = 0
    while sent < total:
        yield block[:min(size, total - sent)]
        sent += size


class PeakRss:
    """The peak resident memory of a process while the block runs: the kernel's high-water mark
    (reset first) where it can be read, else the largest of frequent samples."""

    def __init__(self, pid: int):
        self.p, self.pid = psutil.Process(pid), pid
        self.peak = 0

    def _hwm(self) -> int | None:
        try:
            for line in open(f"/proc/{self.pid}/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def __enter__(self):
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.kernel = True
        except OSError:
            self.kernel = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.p.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.p.memory_info().rss, (self._hwm() or 0) if self.kernel else 0)


def test_a_300_mb_body_costs_the_facade_no_more_than_its_limit(facade, small_facade, report):
    """Refused at its declared length before it is read; without a length, read only up to the
    limit. Measured as the facade's peak RSS against its own baseline (ratios, not times)."""
    cases = [("declared length, 64 MiB limit", facade, {"Content-Length": str(300 * MIB)}, 64 * MIB),
             ("chunked, 64 MiB limit", facade, {}, 64 * MIB),
             ("chunked, 1 MiB limit", small_facade, {}, MIB)]
    for label, web, headers, limit in cases:
        proc = psutil.Process(web.proc.pid)
        with httpx.Client(base_url=web.url, timeout=120) as http:
            assert http.get("/v1/envs", headers=AS_ALICE).status_code == 200  # warm: a baseline of a working facade
            baseline = proc.memory_info().rss
            with PeakRss(web.proc.pid) as rss:
                r = http.post("/v1/step", content=_chunks(300 * MIB),
                              headers={"Content-Type": "application/json", **headers})
            refused(r, 413, "RESOURCE_EXHAUSTED", "body over")
            assert http.get("/v1/envs", headers=AS_ALICE).status_code == 200  # still answers
        ratio, grown = rss.peak / baseline, (rss.peak - baseline) / limit
        report(f"facade RSS, 300 MB body ({label}): baseline {baseline / MIB:.0f} MiB, peak {rss.peak / MIB:.0f} MiB "
               f"= {ratio:.2f}x baseline, growth {grown:.2f}x the limit")
        if "declared" in label or limit <= MIB:
            assert ratio < 1.5  # next to nothing of the body is held
        else:
            # Never the body's 300 MB (read whole before the limit was checked: about 660 MB at the
            # peak, 10x): at most the limit's worth of it, as a body of that size is accepted.
            assert rss.peak - baseline < 1.5 * limit


def test_every_json_route_refuses_bodies_over_the_limit(small_facade, replica):
    """1 MiB on the small facade; the replica's own endpoint at its default 64 MiB."""
    big = b'{"pad": "' + b"x" * (2 * MIB) + b'"}'
    with httpx.Client(base_url=small_facade.url, timeout=60, headers={"Content-Type": "application/json"}) as http:
        for route in ("/v1/sessions", "/v1/reset", "/v1/step", "/v1/fork", "/v1/close",
                      "/openenv/sokoban/reset", "/openenv/sokoban/step", "/openenv/sokoban/close",
                      "/create", "/sokoban/call", "/sokoban/task_range"):
            refused(http.post(route, content=big), 413, "RESOURCE_EXHAUSTED")
            refused(http.post(route, content=_chunks(2 * MIB)), 413, "RESOURCE_EXHAUSTED")
    endpoint = replica.openenv_url + "/sokoban"
    r = httpx.post(f"{endpoint}/reset", content=_chunks(100 * MIB), headers={"Content-Type": "application/json",
                                                                            **AS_ALICE}, timeout=120)
    refused(r, 413, "RESOURCE_EXHAUSTED")


def test_a_websocket_message_over_the_limit_closes_its_socket(small_facade):
    async def run():
        async with connect(ws_url(small_facade.url + "/openenv/sokoban"), additional_headers=AS_ALICE,
                           ping_interval=None, max_size=None) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {"seed": 0}}))
            assert json.loads(await ws.recv())["type"] == "observation"
            await ws.send("x" * (2 * MIB))
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 60)
            return closed.value.rcvd.code if closed.value.rcvd else None
    assert asyncio.run(run()) == 1009  # message too big


# -- JSON: its Content-Type, finite numbers, bounded depth ------------------------------------------------------
JSON_ROUTES = ["/v1/sessions", "/v1/reset", "/v1/step", "/v1/fork", "/v1/close",
               "/openenv/sokoban/reset", "/openenv/sokoban/step", "/openenv/sokoban/close"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp"])
def test_json_routes_take_json_only(facade, replica, content_type):
    """What a page of another site may POST to a server on this machine without asking first
    (text/plain, a form) opens nothing: 415."""
    headers = {"Content-Type": content_type} if content_type else {}
    body = b'{"envId": "sokoban"}'
    with httpx.Client(base_url=facade.url, timeout=60) as http:
        for route in JSON_ROUTES:
            refused(http.post(route, content=body, headers=headers), 415, "INVALID_ARGUMENT", "Content-Type")
    refused(httpx.post(replica.openenv_url + "/sokoban/reset", content=b"{}", headers=headers, timeout=60),
            415, "INVALID_ARGUMENT")


def test_json_types_with_parameters_are_json(facade):
    with httpx.Client(base_url=facade.url, timeout=60, headers=AS_ALICE) as http:
        for content_type in ("application/json; charset=utf-8", "Application/JSON", "application/merge-patch+json"):
            r = http.post("/v1/close", content=b'{"sessionIds": []}', headers={"Content-Type": content_type})
            assert r.status_code == 200, (content_type, r.text)


NON_FINITE = [b'{"envId": "sokoban", "config": {"dim_room": 1e400}}', b'{"envId": "sokoban", "config": {"x": NaN}}',
              b'{"envId": "sokoban", "config": {"x": -Infinity}}', b'{"envId": "sokoban", "count": Infinity}']


def test_non_finite_numbers_and_deep_nesting_are_named(facade, replica):
    deep = b'{"envId": "sokoban", "config": {"x": ' + b"[" * 200 + b"]" * 200 + b"}}"
    deeper = b"[" * 100_000 + b"]" * 100_000
    with httpx.Client(base_url=facade.url, timeout=60, headers={"Content-Type": "application/json", **AS_ALICE}) as http:
        for route in ("/v1/sessions", "/openenv/sokoban/reset"):
            for body in NON_FINITE:
                refused(http.post(route, content=body), 400, "INVALID_ARGUMENT", "not finite")
            refused(http.post(route, content=deep), 400, "INVALID_ARGUMENT", "nested deeper than 64")
            refused(http.post(route, content=deeper), 400, "INVALID_ARGUMENT", "nested deeper than 64")
        refused(http.post("/openenv/sokoban/reset", content=b'{"seed": 1e400}'), 400, "INVALID_ARGUMENT", "not finite")
        refused(http.post("/openenv/sokoban/reset", content=b'{"seed": 18446744073709551616}'), 400,
                "INVALID_ARGUMENT", "seed")
    r = httpx.post(replica.openenv_url + "/sokoban/reset", content=NON_FINITE[0],
                   headers={"Content-Type": "application/json", **AS_ALICE}, timeout=60)
    refused(r, 400, "INVALID_ARGUMENT", "not finite")

    async def socket():
        return await socket_exchange(ws_url(facade.url + "/openenv/sokoban"), AS_ALICE, [
            '{"type": "reset", "data": {"seed": NaN}}', '{"type": "step", "data": ' + "[" * 100 + "]" * 100 + "}",
            b'\xff\xfe', {"type": "reset", "data": {"seed": 0}}])
    replies = asyncio.run(socket())
    assert [r["type"] for r in replies] == ["error", "error", "error", "observation"], replies
    assert "not finite" in replies[0]["data"]["message"] and "nested deeper" in replies[1]["data"]["message"]
    assert {r["data"]["code"] for r in replies[:3]} == {"INVALID_JSON"}
    assert {r["data"]["status"] for r in replies[:3]} == {"INVALID_ARGUMENT"}


def test_query_numbers_beyond_the_protocol_are_invalid_arguments(facade):
    with httpx.Client(base_url=facade.url, timeout=60, headers=AS_MONITOR) as http:
        refused(http.get("/v1/live", params={"limit": 2 ** 40}), 400, "INVALID_ARGUMENT")
        refused(http.get("/v1/live", params={"limit": -1}), 400, "INVALID_ARGUMENT")
        for key in ("turn", "episode", "trial"):
            refused(http.get("/v1/sessions/x/y/state", params={key: 2 ** 40}), 400, "INVALID_ARGUMENT")


# -- tokens over plain HTTP ------------------------------------------------------------------------------------
def test_tokens_over_plain_http_only_from_this_machine(facade, small_facade, replica):
    """A request from another machine (here: as a proxy on this one reports it, X-Forwarded-For)
    carrying a token over plain HTTP is refused before anything reads it, unless the operator
    allows it (TLS ended by that proxy)."""
    remote = {"X-Forwarded-For": "203.0.113.7"}
    for base in (facade.url, replica.openenv_url.rsplit("/openenv", 1)[0]):
        route = "/v1/envs" if base == facade.url else "/openenv/sokoban/health"
        refused(httpx.get(base + route, headers={**remote, **AS_ALICE}, timeout=60), 403, "PERMISSION_DENIED", "TLS")
        refused(httpx.post(base + "/openenv/sokoban/reset", json={}, headers={**remote, **AS_ALICE}, timeout=60),
                403, "PERMISSION_DENIED", "TLS")
        replies = asyncio.run(socket_exchange(ws_url(base + "/openenv/sokoban"), {**remote, **AS_ALICE}, unasked=True))
        assert replies[0]["type"] == "error" and replies[0]["data"]["status"] == "PERMISSION_DENIED", replies
        assert "TLS" in replies[0]["data"]["message"]
        # Told it is a proxy's TLS: accepted.
        r = httpx.get(base + route, headers={**remote, **AS_ALICE, "X-Forwarded-Proto": "https"}, timeout=60)
        assert r.status_code == 200, r.text
    # Without a token the rule has nothing to protect; with --allow-plain-http-tokens it steps aside.
    assert httpx.get(facade.url + "/healthz", headers=remote, timeout=60).status_code == 200
    assert httpx.get(small_facade.url + "/v1/envs", headers={**remote, **AS_ALICE}, timeout=60).status_code == 200


def test_a_page_of_another_site_cannot_open_a_socket(facade, replica):
    """Browsers open WebSockets anywhere without asking first, with their page's Origin: one that
    is not the server's own is refused; programs (no Origin) and the server's own pages are not."""
    for base in (facade.url, replica.openenv_url.rsplit("/openenv", 1)[0]):
        url = ws_url(base + "/openenv/sokoban")
        for origin in ("http://evil.example", "null", "http://localhost:1"):
            replies = asyncio.run(socket_exchange(url, {"Origin": origin, **AS_ALICE}, unasked=True))
            assert replies[0]["type"] == "error" and replies[0]["data"]["status"] == "PERMISSION_DENIED", replies
        own = base  # the page served from this server: http://host:port
        replies = asyncio.run(socket_exchange(url, {"Origin": own, **AS_ALICE}, [{"type": "reset", "data": {}}]))
        assert replies[0]["type"] == "observation", replies


# -- bounded tables, and the same codes as gRPC ------------------------------------------------------------
def test_openenv_http_sessions_are_bounded(small_facade):
    with httpx.Client(base_url=small_facade.url + "/openenv/sokoban", timeout=60, headers=AS_ALICE) as http:
        sids = [http.post("/reset", json={"seed": i}).json()["metadata"]["session_id"] for i in range(2)]
        refused(http.post("/reset", json={"seed": 3}), 429, "RESOURCE_EXHAUSTED", "limit")
        # A reset of a held session with another config replaces it: no room needed.
        r = http.post("/reset", json={"session_id": sids[0], "config": {"render_image": True}})
        assert r.status_code == 200, r.text
        sids[0] = r.json()["metadata"]["session_id"]
        assert http.post("/close", json={"session_id": sids[1]}).status_code == 200
        r = http.post("/reset", json={"seed": 4})
        assert r.status_code == 200, r.text
        for sid in (sids[0], r.json()["metadata"]["session_id"]):
            assert http.post("/close", json={"session_id": sid}).json()["closed"] is True


def test_a_session_of_a_replica_never_known_is_unknown(facade, replica):
    """As a replica over gRPC says of an id it never gave: NOT_FOUND, not DATA_LOSS."""
    with EnvClient(replica.address, token=ALICE) as env:
        rid = env.env.ListEnvs(pb.ListEnvsRequest(), metadata=(("authorization", f"Bearer {ALICE}"),)).replica_id
    with httpx.Client(base_url=facade.url, timeout=60, headers=AS_ALICE) as http:
        for sid in ("typo-replica/0123456789abcdef", "no-slash"):
            refused(http.post("/v1/fork", json={"sessionId": sid}), 404, "NOT_FOUND", "unknown session")
            r = http.post("/v1/step", json={"items": [{"sessionId": sid, "action": "x"}]}).json()["results"][0]
            assert r["status"]["code"] == grpc.StatusCode.NOT_FOUND.value[0] and "unknown" in r["status"]["message"]
            r = http.post("/v1/close", json={"sessionIds": [sid]}).json()["statuses"][0]
            assert r["code"] == grpc.StatusCode.NOT_FOUND.value[0]
        refused(http.get("/v1/sessions/typo-replica/0123/state", headers=AS_MONITOR), 404, "NOT_FOUND")
        # The replica's own answer for an id it never gave, through the facade: the same code.
        refused(http.post("/v1/fork", json={"sessionId": f"{rid}/0000"}), 404, "NOT_FOUND")
        assert replica_of(f"{rid}/0000") == rid


@pytest.mark.last_in_module
def test_both_servers_still_answer_a_normal_call(facade, replica):
    """Last: after everything above, a whole round trip through each door."""
    with httpx.Client(base_url=facade.url, timeout=60, headers=AS_ALICE) as http:
        sid = http.post("/v1/sessions", json={"envId": "frozenlake"}).json()["sessionIds"][0]
        r = http.post("/v1/reset", json={"items": [{"sessionId": sid, "seed": 1}]}).json()["results"][0]
        assert r["status"]["code"] == 0
        assert http.post("/v1/close", json={"sessionIds": [sid]}).json()["statuses"][0]["code"] == 0
    endpoint = replica.openenv_url + "/frozenlake"
    replies = asyncio.run(socket_exchange(ws_url(endpoint), AS_ALICE, [{"type": "reset", "data": {"seed": 0}},
                                                                       {"type": "step", "data": {"message": "Left"}}]))
    assert [r["type"] for r in replies] == ["observation", "observation"], replies
    with EnvClient(replica.address, token=ALICE) as env:
        assert {s.env_id for s in env.list_envs()} == {"sokoban", "frozenlake"}
