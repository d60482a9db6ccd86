"""Ports on the command line: a number out of range is a one-line usage error (not a server on a
wrapped port), and a port already taken is one line and exit code 1 (not a traceback), for every
command that listens."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest


def envserve(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "envserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args", [
    ["serve", "sokoban", "--port", "99999"], ["serve", "sokoban", "--port", "-1"],
    ["serve", "sokoban", "--metrics-port", "-2"], ["serve", "sokoban", "--openenv-port", "70000"],
    ["up", "--http-port", "65536"], ["web", "--replica", "127.0.0.1:1", "--port", "8o80"],
    ["judge", "--port", "100000"], ["judge", "--metrics-port", "65536"], ["demo", "--port", "-5"],
    ["web", "--replica", "127.0.0.1:1", "--max-body-bytes", "0"],
])
def test_a_port_out_of_range_is_a_one_line_usage_error(args):
    r = envserve(*args)
    assert r.returncode == 2 and r.stdout == "", r
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and f"envserve {args[0]}: error: argument {args[-2]}" in lines[0], r.stderr


@pytest.fixture
def taken():
    """A port something else listens on."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s.getsockname()[1]


@pytest.mark.parametrize("command", [
    ["serve", "sokoban", "--workers", "1", "--port", "{port}"],
    ["serve", "sokoban", "--workers", "1", "--port", "0", "--metrics-port", "{port}"],
    ["serve", "sokoban", "--workers", "1", "--port", "0", "--openenv-port", "{port}"],
    ["up", "sokoban", "--workers", "1", "--port", "{port}"],
    ["up", "sokoban", "--workers", "1", "--port", "0", "--http-port", "{port}"],
    ["web", "--replica", "127.0.0.1:1", "--port", "{port}"],
    ["judge", "--env-address", "127.0.0.1:1", "--port", "{port}"],
])
def test_a_port_already_taken_is_one_line_and_exit_code_1(taken, command):
    r = envserve(*[a.format(port=taken) for a in command])
    assert r.returncode == 1, r
    assert r.stderr == f"envserve: cannot listen on 127.0.0.1:{taken}: address already in use\n", r.stderr
