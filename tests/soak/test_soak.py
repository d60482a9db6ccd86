"""Three minutes of bench/soak.py: mixed load on 3 replicas and a real redis-server while a worker, a
replica and Redis are killed and a replica is drained on a schedule. Asserts counts, never times:
every episode completes, the sessions are back to 0 after idle plus lease, and no process, JVM or
fd is left behind."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[2]
REPLICAS = 3
# Channels made on first use (the judge to each replica, a replica to the ones it moves sessions to)
# stay open: a few fds per process tree, not one per session or per fault.
FDS_PER_TREE = 8


def test_three_minutes_of_faults_lose_no_episode_and_leave_nothing_behind(report):
    if not __import__("shutil").which("redis-server"):
        pytest.skip("redis-server is not installed")
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", os.environ.get("ENVSERVE_SOAK_MINUTES", "3"),
           "--envs", "sokoban,frozenlake,minesweeper,webshop", "--replicas", str(REPLICAS), "--lease", "10",
           "--fault-every", "15", "--sample-every", "5", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    report(f"soak {result['minutes']} min: {result['episodes']} episodes, faults {result['faults']}, "
           f"failed items {result['failed_items']}, judge errors {result['judge_errors']}, "
           f"left behind {result['left_behind']}")
    assert result["episodes"] > 0 and result["forks"] > 0 and result["stream_cancels"] > 0
    assert all(n >= 1 for n in result["faults"].values()), result["faults"]
    assert result["failed_items"] == 0, result["failures"]
    left = result["left_behind"]
    assert left["sessions"] == 0 and left["processes"] == 0 and left["jvms"] == 0, left
    assert left["fds"] <= FDS_PER_TREE * (REPLICAS + 1), left
