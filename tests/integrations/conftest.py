"""Fixtures of the framework adapter tests: the expert policy (tests/adapter_support.py) and a
replica of their own that a test may kill."""
from __future__ import annotations

import pytest

from adapter_support import ExpertPolicy


@pytest.fixture
def expert():
    return ExpertPolicy


@pytest.fixture
def own_server():
    """A replica of the test's own (frozenlake, one worker), that the test may kill."""
    from serverproc import ServerProcess
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as server:
        yield server
