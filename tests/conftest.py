import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from serverproc import ServerProcess  # noqa: E402

GRID_ENVS = ["sokoban", "frozenlake", "minesweeper"]


@pytest.fixture(scope="session")
def grid_server():
    """One real server process on loopback serving the grid environments, shared by the session."""
    with ServerProcess(GRID_ENVS, workers=2) as server:
        yield server


@pytest.fixture
def client(grid_server):
    from envserve.client import EnvClient
    with EnvClient(grid_server.address) as c:
        yield c
