"""Every HTTP route of a live facade (and its OpenEnv socket) fed random JSON bodies, headers, query
strings and WebSocket messages by hypothesis: whatever comes in, the answer is a clean code
(never a 500, never an INTERNAL error message), and the connection is never dropped without one.
Derandomized and without an example database, so each run sends the same requests."""
from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from serverproc import ServerProcess
from webproc import WebProcess

ALICE, BOB = "alice-token-1", "bob-token-2"
EXAMPLES = 300  # per route: about 30 s for the file on a 2-core machine
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def facade(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"{ALICE}\n{BOB}\n")
    with ServerProcess(["sokoban"], workers=1, metrics=False, extra=["--token-file", str(tokens)]) as s, \
            WebProcess.facade([s.address], extra=["--openenv-max-http-sessions", "64",
                                                  "--openenv-idle-seconds", "5"]) as w:
        yield w


@pytest.fixture(scope="module")
def http(facade):
    with httpx.Client(base_url=facade.url, timeout=60) as c:
        yield c


# -- what is sent ------------------------------------------------------------------------------------------
KEYS = ["envId", "env_id", "count", "config", "actionFormat", "action_format", "items", "sessionId", "session_id",
        "sessionIds", "seed", "action", "message", "text", "type", "data", "turn", "taskId", "task_id", "split",
        "sameTask", "episode_id", "render_image", "dim_room", "max_turns"]
SESSION_IDS = st.sampled_from(["", "x", "x/y", "sokoban", "../..", "a" * 300]) | st.text(max_size=40)
scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-2 ** 70, max_value=2 ** 70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30) | SESSION_IDS)
values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                      | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), kids, max_size=4),
                      max_leaves=12)
objects = st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), values, max_size=5)
# Bodies: mostly JSON objects, some other JSON, raw bytes, and literals JSON does not have.
bodies = st.one_of(objects.map(lambda v: json.dumps(v).encode()), values.map(lambda v: json.dumps(v).encode()),
                   st.binary(max_size=64),
                   st.sampled_from([b"", b"{", b"NaN", b'{"seed": Infinity}', b'{"envId": 1e999}', b"[" * 300,
                                    b'{"items": [{"sessionId": "x/y", "seed": -1e400}]}', b"\xef\xbb\xbf{}",
                                    b'"\\ud800"', b"{}" * 3]))
# Header values as bytes: latin-1 that HTTP/1.1 can carry (no CR, LF or NUL; no space at either end).
header_bytes = st.binary(max_size=40).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7f).strip(b" \t"))
authorizations = st.sampled_from([None, f"Bearer {ALICE}".encode(), f"Bearer {BOB}".encode(), b"Bearer",
                                  b"Bearer nobody", b"Basic YTpi", b"bearer " + ALICE.encode()]) | header_bytes
content_types = st.sampled_from([b"application/json", b"application/json; charset=utf-8", b"text/plain",
                                 b"application/x-www-form-urlencoded", b"application/problem+json", None]) | header_bytes
forwarded_for = st.sampled_from([None, b"127.0.0.1", b"203.0.113.9", b"::1", b"unknown"]) | header_bytes


@st.composite
def headers(draw, json_body: bool = True):
    h = {}
    for name, strategy in (("Authorization", authorizations), ("X-Forwarded-For", forwarded_for),
                           ("Content-Type", content_types if json_body else st.none())):
        v = draw(strategy)
        if v is not None:
            h[name] = v
    if draw(st.booleans()):
        h[draw(st.sampled_from(["X-Forwarded-Proto", "Accept", "Origin", "Content-Encoding", "X-Anything"]))] = \
            draw(header_bytes)
    return h


queries = st.dictionaries(st.sampled_from(["limit", "env_id", "images", "turn", "episode", "trial", "session_id"])
                          | st.text(max_size=6),
                          st.text(max_size=12) | st.integers(min_value=-2 ** 64, max_value=2 ** 64).map(str),
                          max_size=4)


def answered(resp: httpx.Response) -> None:
    """A clean answer: a status below 500 and, for an error, the facade's {"code", "message"}."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400 and resp.status_code != 405:
        body = resp.json()
        assert body["code"] not in ("INTERNAL", "UNKNOWN") and isinstance(body["message"], str), body


POSTS = ["/v1/sessions", "/v1/reset", "/v1/step", "/v1/fork", "/v1/close",
         "/openenv/sokoban/reset", "/openenv/sokoban/step", "/openenv/sokoban/close"]


@pytest.mark.parametrize("route", POSTS)
@FUZZ
@given(body=bodies, h=headers())
def test_json_routes_answer_every_body_cleanly(http, route, body, h):
    answered(http.post(route, content=body, headers=h))


# The ORS door answers errors as ORS clients read them: {"detail": ...}.
ORS_POSTS = ["/create", "/ping", "/delete", "/sokoban/call", "/sokoban/tasks", "/sokoban/num_tasks", "/sokoban/task",
             "/sokoban/task_range"]
ORS_GETS = ["/list_environments", "/sokoban/splits", "/sokoban/tools", "/{id}/tools", "/sokoban/prompt",
            "/sokoban/task_tools"]


def answered_ors(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400 and resp.status_code != 405:
        body = resp.json()
        assert isinstance(body.get("detail", body.get("message")), str), body


ors_headers = headers().flatmap(lambda h: st.one_of(st.just(h), header_bytes.map(
    lambda sid: {**h, "X-Session-ID": sid} if sid else h)))


@pytest.mark.parametrize("route", ORS_POSTS)
@FUZZ
@given(body=bodies, h=ors_headers)
def test_ors_routes_answer_every_body_cleanly(http, route, body, h):
    answered_ors(http.post(route, content=body, headers=h))


@pytest.mark.parametrize("route", ORS_GETS)
@FUZZ
@given(sid=SESSION_IDS, h=ors_headers)
def test_ors_get_routes_answer_every_query_cleanly(http, route, sid, h):
    answered_ors(http.get(route.replace("{id}", quote(sid, safe="") or "x"), headers=h))


GETS = ["/v1/envs", "/v1/envs/{id}", "/v1/sessions/{id}/state", "/v1/live", "/openenv/{id}/state",
        "/openenv/sokoban/state", "/openenv/sokoban/health", "/openenv/{id}/schema", "/openenv/sokoban/metadata", "/"]


@pytest.mark.parametrize("route", GETS)
@FUZZ
@given(sid=SESSION_IDS, q=queries, h=headers(json_body=False))
def test_get_routes_answer_every_query_cleanly(http, route, sid, q, h):
    path = route.replace("{id}", quote(sid, safe="/") or "x")
    answered(http.get(path, params=q, headers=h))


messages = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["reset", "step", "state", "close", "bogus"]) | st.text(max_size=6)},
                          optional={"data": values}).map(json.dumps),
    values.map(json.dumps), st.text(max_size=40), st.binary(max_size=40),
    st.sampled_from(['{"type": "step", "data": {"message": NaN}}', '{"type": "reset", "data": {"seed": 1e400}}',
                     '{"type": "step", "data": ' + "[" * 80 + "]" * 80 + "}", "{"]))


@FUZZ
@given(sent=st.lists(messages, min_size=1, max_size=4), q=queries,
       auth=st.sampled_from([f"Bearer {ALICE}", f"Bearer {BOB}", None, "Bearer nobody"]))
def test_the_openenv_socket_answers_every_message(facade, sent, q, auth):
    url = facade.url.replace("http://", "ws://") + "/openenv/sokoban/ws"
    if q:
        url += "?" + httpx.QueryParams(q).__str__()
    with connect(url, additional_headers={"Authorization": auth} if auth else {}, open_timeout=60,
                 max_size=None) as ws:
        for m in sent:
            try:
                ws.send(m)
                reply = json.loads(ws.recv(timeout=60))
            except ConnectionClosed as e:
                # Only a close it asked for, or a socket refused as it opened (its error came first).
                assert e.rcvd is not None and e.rcvd.code in (1000, 1008), e
                return
            assert reply["type"] in ("observation", "state", "error"), reply
            if reply["type"] == "error":
                assert reply["data"].get("status") not in (None, "INTERNAL", "UNKNOWN"), reply
                assert reply["data"]["message"], reply


@pytest.mark.last_in_module
def test_the_facade_still_answers_after_the_fuzz(http):
    r = http.post("/v1/sessions", json={"envId": "sokoban"}, headers={"Authorization": f"Bearer {ALICE}"})
    assert r.status_code == 200, r.text
    sid = r.json()["sessionIds"][0]
    assert http.post("/v1/close", json={"sessionIds": [sid]},
                     headers={"Authorization": f"Bearer {ALICE}"}).json()["statuses"][0]["code"] == 0
