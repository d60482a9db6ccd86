"""Run the examples under examples/ as a user would, for their smoke tests (tests/examples/)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc

from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DIRECTIONS = ["Up", "Down", "Left", "Right"]


def run_example(args: list[str], timeout: float = 300, env: dict | None = None, cwd: Path | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
    """`python examples/ARGS[0] ARGS[1:]` from the repository root (an absolute ARGS[0] runs as is),
    with this test's environment; a non-zero exit fails with the example's output."""
    cmd = [str(a) for a in args]
    if not os.path.isabs(cmd[0]):
        cmd = [sys.executable, str(EXAMPLES / cmd[0]), *cmd[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def live_session_ids(address: str, env_id: str = "") -> set[str]:
    """The sessions the replica holds now (MonitorService.ListSessions)."""
    with grpc.insecure_channel(address) as ch:
        reply = pb_grpc.MonitorServiceStub(ch).ListSessions(pb.ListSessionsRequest(env_id=env_id, limit=10000))
    return {s.session_id for s in reply.sessions}


def tool_call_text(direction: str) -> str:
    """A complete `move` call as Qwen2.5's chat template writes it."""
    return "<tool_call>\n" + json.dumps({"name": "move", "arguments": {"direction": direction}}) + "\n</tool_call>"
