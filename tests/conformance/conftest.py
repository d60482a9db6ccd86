"""The conformance suite runs against every registered environment, on two real server
processes (seed determinism must hold across processes). Point it at servers of your own
with ENVSERVE_CONFORMANCE_ADDRESSES=host:port,host:port and ENVSERVE_CONFORMANCE_ENVS=a,b."""
import os

import pytest

from envserve.client import EnvClient
from serverproc import ServerProcess


def conformance_envs() -> list[str]:
    if os.environ.get("ENVSERVE_CONFORMANCE_ENVS"):
        return os.environ["ENVSERVE_CONFORMANCE_ENVS"].split(",")
    from envserve.core.registry import env_ids
    return env_ids()


def pytest_generate_tests(metafunc):
    if "env_id" in metafunc.fixturenames:
        metafunc.parametrize("env_id", conformance_envs())


@pytest.fixture(scope="session")
def conformance_addresses():
    given = os.environ.get("ENVSERVE_CONFORMANCE_ADDRESSES")
    if given:
        yield given.split(",")[:2]
        return
    servers = [ServerProcess(conformance_envs(), workers=1, metrics=False) for _ in range(2)]
    try:
        yield [s.address for s in servers]
    finally:
        for s in servers:
            s.kill()


@pytest.fixture(scope="session")
def clients(conformance_addresses):
    cs = [EnvClient(a) for a in conformance_addresses]
    yield cs
    for c in cs:
        c.close()
