"""The Node and TypeScript clients of clients/typescript against a real replica: the plain grpc-js
client loading the .proto at run time, the typed client protoc-gen-es generates (through buf) called
over Connect's gRPC transport, and the example program of docs/clients/typescript.md.

Skips where node or npm is missing, unless ENVSERVE_REQUIRE_CLIENT_TOOLCHAINS=1 (tests/clients/
toolchains.py)."""
import os
import re
import time

import pytest

from serverproc import ServerProcess
from toolchains import REPO, TYPESCRIPT, node_modules, run, tool

# The replica has a token, so each client's bearer metadata is exercised and a call without it is
# refused.
TOKEN = "typescript-client-token"


@pytest.fixture(scope="module")
def node():
    """node_modules installed, the TypeScript generated from proto/ and compiled into dist/."""
    node_modules()
    done = run([tool("npm"), "run", "build"], TYPESCRIPT)
    assert done.returncode == 0, f"npm run build (buf generate, tsc) failed:\n{done.stdout}"
    return tool("node")


@pytest.fixture(scope="module")
def replica(node):
    with ServerProcess(["sokoban", "frozenlake"], workers=1, metrics=False,
                       env_vars={"ENVSERVE_TOKENS": TOKEN}) as server:
        yield server


def _node(node, replica, report, *args) -> str:
    started = time.monotonic()
    done = run([node, *args], TYPESCRIPT, env={**os.environ, "ENVSERVE_ADDRESS": replica.address,
                                               "ENVSERVE_TOKEN": TOKEN})
    report(f"node {' '.join(args)}: {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, f"node {' '.join(args)} exited {done.returncode}:\n{done.stdout}"
    return done.stdout


def _node_test(node, replica, report, test_file):
    output = _node(node, replica, report, "--test", "--test-reporter=tap", test_file)
    # A file that failed to register its tests would pass too; a skipped test means a missing token.
    assert re.search(r"^# pass [1-9]", output, re.M) and re.search(r"^# skipped 0$", output, re.M), output


def test_plain_node_client(node, replica, report):
    """@grpc/grpc-js + @grpc/proto-loader: config_json, status on OK results, ReadState's latest
    turn, the deprecated GetState, closing the client, the bearer token."""
    _node_test(node, replica, report, "test/grpc-js.test.mjs")


def test_generated_typescript_client(node, replica, report):
    """protoc-gen-es + Connect: an episode to the goal, a fork, typed ground truth, clean codes for
    bad input, CloseSessions, the bearer token."""
    _node_test(node, replica, report, "dist/test/connect.test.js")


def test_example_program_plays_an_episode(node, replica, report):
    output = _node(node, replica, report, "dist/example/episode.js")
    assert re.search(r"^turn 1: (Down|Right) reward ", output, re.M), output
    assert re.search(r"^done: ", output, re.M), output
    assert output.rstrip().endswith("closed: OK"), output


def test_the_typescript_page_shows_the_example_program():
    """docs/clients/typescript.md's listing is clients/typescript/example/episode.ts, which the test
    above runs."""
    page = (REPO / "docs" / "clients" / "typescript.md").read_text()
    listings = re.findall(r"^```ts\n(.*?)^```$", page, flags=re.M | re.S)
    program = (TYPESCRIPT / "example" / "episode.ts").read_text()
    assert program in listings, "docs/clients/typescript.md has no ```ts listing equal to the example program"
