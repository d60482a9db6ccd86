import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# engine and built (the images) are session fixtures in tests/conftest.py, shared with tests/deploy.


@pytest.fixture(scope="session")
def engine_api(engine):
    """The Docker Engine API over the same engine (docker SDK; podman's compatible service)."""
    from envserve.containers import EngineConnection
    conn = EngineConnection(engine=engine.name, env=engine.env)
    yield conn.client
    conn.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed container test reports the last lines of every container's log beside it."""
    outcome = yield
    rep = outcome.get_result()
    stack = getattr(item, "funcargs", {}).get("stack")
    if rep.when == "call" and rep.failed and hasattr(stack, "logs"):
        try:
            rep.sections.append(("container logs", stack.logs()))
        except Exception as e:  # noqa: BLE001 - the logs only help; never hide the real failure
            rep.sections.append(("container logs", f"could not read the logs: {e}"))
