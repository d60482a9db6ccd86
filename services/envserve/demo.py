"""`make run`: start `envserve up`, play one episode on each grid env with a scripted agent.

The scripted agent is the env's expert (envserve.client.experts): it plans from the ground truth
(StateService.GetState) — the same endpoint a judge uses; Minesweeper's deduces from the visible
board only — and answers in the free-think format, several moves per turn, so the demo shows the
whole path: open, reset, batched text actions, rewards, ground truth, close, drain.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def play(client, env_id: str, seed: int) -> dict:
    from envserve.client.experts import play_expert
    (ep,) = play_expert(client, env_id, [seed], "free_think", config={"render_image": True})
    print(f"\n== {env_id} (seed {seed}) ==\n{ep.first.observation.text}")
    for t in ep.turns:
        r = t.result
        print(f"turn {r.turn}: {', '.join(r.parsed_actions)} -> reward {r.reward:+.2f}")
    last = ep.turns[-1].result if ep.turns else ep.first
    print(last.observation.text)
    png = len(last.observation.images[0].png) if last.observation.images else 0
    return {"env": env_id, "success": ep.success, "return": round(ep.score, 2), "turns": len(ep.turns),
            "png_bytes": png}


def main(address: str = "", port: int = 50051) -> int:
    from envserve.client import EnvClient
    server = None
    if not address:
        address = f"127.0.0.1:{port}"
        server = subprocess.Popen([sys.executable, "-m", "envserve.cli", "up", "--port", str(port),
                                   "--metrics-port", "0"], env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        client = EnvClient(address)
        _wait_ready(client, server)
        summary = [play(client, env_id, seed=7) for env_id in ("sokoban", "frozenlake", "minesweeper")]
        print("\nenv          success  return  turns  image")
        for s in summary:
            print(f"{s['env']:12s} {str(s['success']):8s} {s['return']:+6.2f}  {s['turns']:5d}  {s['png_bytes']} B png")
        client.close()
        return 0 if all(s["success"] for s in summary) else 1
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)  # drains, then exits
            server.wait(30)


def _wait_ready(client, server, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            client.list_envs()
            return
        except Exception:
            if server is not None and server.poll() is not None:
                raise SystemExit("envserve up exited; is the port taken?")
            if time.time() > deadline:
                raise
            time.sleep(0.2)
