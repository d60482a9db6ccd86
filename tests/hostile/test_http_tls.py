"""TLS on the HTTP doors, with a real CA and certificates made by openssl: the facade (`envserve web
--tls-cert --tls-key [--tls-client-ca]`), a replica's own OpenEnv endpoint (its `--tls-cert`) and
`envserve up --http-port` serve HTTPS and WSS, so bearer tokens never travel in clear; plain HTTP
to them fails; tokens are accepted over TLS from any peer."""
from __future__ import annotations

import asyncio
import json
import ssl
import time

import httpx
import pytest
from websockets.asyncio.client import connect

from pki import make_pki
from serverproc import ServerProcess
from webproc import WebProcess

ALICE = "alice-token-1"
AS_ALICE = {"Authorization": f"Bearer {ALICE}"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    d = make_pki(tmp_path_factory.mktemp("pki"))
    (d / "tokens").write_text(f"{ALICE}\n")
    return d


def trusting(pki, client_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if client_cert:
        ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
    return ctx


def server_tls(pki) -> list[str]:
    return ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")]


@pytest.fixture(scope="module")
def replica(pki):
    with ServerProcess(["sokoban"], workers=1, metrics=False, tls_ca=(pki / "ca.pem").read_bytes(),
                       extra=[*server_tls(pki), "--token-file", str(pki / "tokens"), "--openenv-port", "0"]) as s:
        line = next(x for x in s.output if "envserve openenv on " in x)
        s.openenv_url = line.split("envserve openenv on ")[1].split()[0]
        yield s


async def one_episode_step(url: str, ctx: ssl.SSLContext, headers: dict) -> dict:
    async with connect(url, ssl=ctx, additional_headers=headers, ping_interval=None) as ws:
        await ws.send(json.dumps({"type": "reset", "data": {"seed": 1}}))
        first = json.loads(await ws.recv())
        assert first["type"] == "observation", first
        await ws.send(json.dumps({"type": "step", "data": {"message": "<answer>Up</answer>"}}))
        return json.loads(await ws.recv())


def test_the_facade_serves_https_and_wss(pki, replica):
    with WebProcess.facade([replica.address], extra=["--tls-ca", str(pki / "ca.pem"), *server_tls(pki)]) as w:
        assert w.url.startswith("https://")
        with httpx.Client(base_url=w.url, verify=trusting(pki), headers=AS_ALICE, timeout=60) as http:
            sid = http.post("/v1/sessions", json={"envId": "sokoban"}).json()["sessionIds"][0]
            r = http.post("/v1/reset", json={"items": [{"sessionId": sid, "seed": 2}]})
            assert r.json()["results"][0]["status"]["code"] == 0, r.text
            # Over TLS a token is welcome from any peer (here one a proxy on this machine reports).
            r = http.post("/v1/close", json={"sessionIds": [sid]}, headers={"X-Forwarded-For": "203.0.113.7"})
            assert r.status_code == 200 and r.json()["statuses"][0]["code"] == 0, r.text
        step = asyncio.run(one_episode_step(w.url.replace("https://", "wss://") + "/openenv/sokoban/ws",
                                            trusting(pki), AS_ALICE))
        assert step["type"] == "observation" and step["data"]["metadata"]["turn"] == 1, step
        # Plain HTTP to the TLS port gets no session, and no token crosses in clear.
        plain = w.url.replace("https://", "http://")
        with pytest.raises(httpx.HTTPError):
            r = httpx.get(plain + "/v1/envs", headers=AS_ALICE, timeout=10)
            r.raise_for_status()
        # A client that does not trust the CA stops at the handshake.
        with pytest.raises(httpx.ConnectError):
            httpx.get(w.url + "/healthz", timeout=10)


def test_the_facade_can_require_client_certificates(pki, replica):
    extra = ["--tls-ca", str(pki / "ca.pem"), *server_tls(pki), "--tls-client-ca", str(pki / "ca.pem")]
    with WebProcess.facade([replica.address], extra=extra) as w:
        r = httpx.get(w.url + "/v1/envs", verify=trusting(pki, client_cert=True), headers=AS_ALICE, timeout=60)
        assert r.status_code == 200 and [e["envId"] for e in r.json()["envs"]] == ["sokoban"]
        with pytest.raises(httpx.HTTPError):
            httpx.get(w.url + "/v1/envs", verify=trusting(pki), headers=AS_ALICE, timeout=10).raise_for_status()


def test_a_replicas_openenv_endpoint_serves_its_own_tls(pki, replica):
    assert replica.openenv_url.startswith("https://")
    base = replica.openenv_url + "/sokoban"
    r = httpx.get(base + "/health", verify=trusting(pki), headers=AS_ALICE, timeout=60)
    assert r.json() == {"status": "healthy"}, r.text
    step = asyncio.run(one_episode_step(base.replace("https://", "wss://") + "/ws", trusting(pki), AS_ALICE))
    assert step["type"] == "observation" and step["data"]["metadata"]["turn"] == 1, step
    with pytest.raises(httpx.HTTPError):
        httpx.get(base.replace("https://", "http://") + "/health", headers=AS_ALICE, timeout=10).raise_for_status()


def test_up_serves_its_facade_over_the_replicas_tls(pki):
    args = ["up", "sokoban", "--port", "0", "--workers", "1", "--http-port", "0", *server_tls(pki),
            "--tls-ca", str(pki / "ca.pem"), "--token-file", str(pki / "tokens")]
    with WebProcess(args) as w, httpx.Client(base_url=w.url, verify=trusting(pki), headers=AS_ALICE,
                                              timeout=60) as http:
        assert w.url.startswith("https://")
        deadline = time.monotonic() + 60  # the replica registers a moment after the facade is up
        while not http.get("/v1/envs").json().get("envs") and time.monotonic() < deadline:
            time.sleep(0.1)
        sid = http.post("/v1/sessions", json={"envId": "sokoban"}).json()["sessionIds"][0]
        assert http.post("/v1/close", json={"sessionIds": [sid]}).json()["statuses"][0]["code"] == 0
