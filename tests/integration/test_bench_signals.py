"""A benchmark stopped with SIGTERM (a job's time limit, `kill`) stops the servers it started."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

TESTS = Path(__file__).resolve().parents[1]

RUN = """
import sys, time
sys.path.insert(0, {tests!r})
from serverproc import ServerProcess, stop_on_sigterm
if {handled}:
    stop_on_sigterm()
with ServerProcess(["sokoban"], workers=1, metrics=False) as server:
    print(server.proc.pid, flush=True)
    while True:  # a benchmark's main thread runs Python code, where the handler runs
        time.sleep(0.2)
"""


def _server_after_sigterm(handled: bool, wait: float) -> bool:
    """Whether the server a script started is still running `wait` seconds after the script ended
    on SIGTERM."""
    script = subprocess.Popen([sys.executable, "-c", RUN.format(tests=str(TESTS), handled=handled)],
                              stdout=subprocess.PIPE, text=True)
    server = psutil.Process(int(script.stdout.readline()))
    try:
        script.send_signal(signal.SIGTERM)
        script.wait(60)
        deadline = time.monotonic() + wait
        while server.is_running() and server.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        return server.is_running() and server.status() != psutil.STATUS_ZOMBIE
    finally:
        if server.is_running():
            for p in server.children(recursive=True) + [server]:
                p.kill()


def test_sigterm_stops_the_servers_a_benchmark_started():
    assert not _server_after_sigterm(handled=True, wait=60)


def test_without_the_handler_they_would_be_left_running():
    # A slow machine only makes a server left running more likely to be seen running.
    assert _server_after_sigterm(handled=False, wait=3)
