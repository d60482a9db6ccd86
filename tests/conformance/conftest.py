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
    from envserve.core.registry import env_ids, prefix_examples, prefixes
    # Prefix families (gymnasium:<id>) are held to the contract on the ids they say they serve here;
    # openenv:<module>:<Class> serves the user's classes, so it is held to it on the test package's.
    return env_ids() + [e for p in sorted(prefixes()) for e in prefix_examples(p)] + openenv_test_envs()


def openenv_test_envs() -> list[str]:
    from envserve.core.registry import prefixes
    if "openenv" not in prefixes():
        return []
    import openenv_envs
    return list(openenv_envs.ALL)


def server_env_vars() -> dict:
    # The servers import the test package's OpenEnv classes, so tests/ goes on their path.
    import openenv_envs
    return openenv_envs.on_path()


# `serve --inline` steps sessions in the front process; it is meant for the microsecond grid
# games, and the suite holds it to the same contract on those.
INLINE_ENVS = ("sokoban", "frozenlake", "minesweeper")


def quick() -> bool:
    """ENVSERVE_CONFORMANCE_QUICK=1 (`make check`): every check once per env on worker processes, one
    seed; `make test` adds the other seeds and the inline replica."""
    return os.environ.get("ENVSERVE_CONFORMANCE_QUICK", "") not in ("", "0")


def pytest_generate_tests(metafunc):
    if "env_id" in metafunc.fixturenames:
        envs = conformance_envs()
        cases = [("workers", e) for e in envs]
        # Given servers are tested as they are.
        if not os.environ.get("ENVSERVE_CONFORMANCE_ADDRESSES") and not quick():
            cases += [("inline", e) for e in envs if e in INLINE_ENVS]
        metafunc.parametrize(("serving_mode", "env_id"), cases, scope="session",
                             ids=[e if mode == "workers" else f"{e}-inline" for mode, e in cases])


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """The cases of one serving mode run together, in the order they were shuffled into: the servers
    of a mode start when its first case runs and stop when a case of the other mode comes, so each
    switch of mode would start two replicas of every env again."""
    slots = [i for i, item in enumerate(items)
             if "serving_mode" in getattr(getattr(item, "callspec", None), "params", {})]
    ordered = sorted((items[i] for i in slots), key=lambda item: item.callspec.params["serving_mode"] != "workers")
    for i, item in zip(slots, ordered):
        items[i] = item


@pytest.fixture(scope="session")
def conformance_addresses(serving_mode):
    given = os.environ.get("ENVSERVE_CONFORMANCE_ADDRESSES")
    if given:
        yield given.split(",")[:2]
        return
    if serving_mode == "inline":
        envs = [e for e in conformance_envs() if e in INLINE_ENVS]
        servers = [ServerProcess(envs, metrics=False, extra=["--inline"]) for _ in range(2)]
    else:
        servers = [ServerProcess(conformance_envs(), workers=1, metrics=False, env_vars=server_env_vars())
                   for _ in range(2)]
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
