"""The Go client generated from proto/envserve/v1/envserve.proto (clients/go) against a real replica:
clients/go/run.sh generates the code, runs `go test` and the example program of docs/clients/go.md.

Skips where the Go toolchain or its plugins are missing, unless ENVSERVE_REQUIRE_CLIENT_TOOLCHAINS=1
(CI installs them, so there a missing one fails the run instead of hiding it)."""
import os
import re
import time

import pytest

from serverproc import ServerProcess
from toolchains import REPO as ROOT, missing, run

RUN = ROOT / "clients" / "go" / "run.sh"
TOKEN = "go-client-token"
GO_TESTS = ["TestListEnvsAndSpec", "TestBadInputGetsCleanCodes", "TestSokobanSessionStepsReadsForksAndCloses",
            "TestFrozenLakeEpisodeToSuccess"]


def _toolchain_or_skip():
    """clients/go/run.sh names what of the Go toolchain is missing (its one list of what it needs)."""
    check = run(["bash", str(RUN), "check"], ROOT, timeout=60)
    if check.returncode != 0:
        missing("Go client toolchain: " + check.stdout.strip().removeprefix("missing: "))


@pytest.fixture(scope="module")
def replica():
    _toolchain_or_skip()
    # A token on the replica, so the client's bearer metadata is exercised (and a call without it
    # must be refused).
    server = ServerProcess(["sokoban", "frozenlake"], workers=1, metrics=False, env_vars={"ENVSERVE_TOKENS": TOKEN})
    try:
        yield server
    finally:
        server.terminate()


def test_go_client_plays_against_a_replica(replica, report):
    env = dict(os.environ, ENVSERVE_ADDRESS=replica.address, ENVSERVE_TOKEN=TOKEN)
    started = time.monotonic()
    # The timeout only stops a hung build from holding the run; a first build compiles grpc-go.
    done = run(["bash", str(RUN)], ROOT, env=env, timeout=540)
    seconds = time.monotonic() - started
    output = done.stdout
    assert done.returncode == 0, f"clients/go/run.sh exited {done.returncode}:\n{output}"
    passed = set(re.findall(r"^--- PASS: (\w+)", output, flags=re.M))
    assert passed == set(GO_TESTS), f"Go tests passed: {sorted(passed)}, expected {GO_TESTS}:\n{output}"
    assert "--- FAIL" not in output and "--- SKIP" not in output, output
    # The example program's last line: it closed its session.
    assert output.rstrip().endswith("closed: OK"), output
    report(f"Go client: generate, vet, build, test and example in {seconds:.1f} s")


def test_the_go_page_shows_the_example_program():
    """docs/clients/go.md's listing is clients/go/example/main.go, which the test above runs."""
    page = (ROOT / "docs" / "clients" / "go.md").read_text()
    listings = re.findall(r"^```go\n(.*?)^```$", page, flags=re.M | re.S)
    program = (ROOT / "clients" / "go" / "example" / "main.go").read_text()
    assert program in listings, "docs/clients/go.md has no ```go listing equal to clients/go/example/main.go"
