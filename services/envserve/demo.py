"""`make run`: start `envserve up`, play one episode on each grid env with a scripted agent.

The scripted agent plans from the ground truth (StateService.GetState) — the same endpoint a
judge uses — and answers in the free-think format, several moves per turn, so the demo shows
the whole path: open, reset, batched text actions, rewards, ground truth, close, drain.
"""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time

MOVES = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}


def _cells(items) -> set[tuple[int, int]]:
    # Ground truth crosses the wire as a protobuf Struct, where every number is a float.
    return {(int(r), int(c)) for r, c in items}


def plan_sokoban(state: dict) -> list[str]:
    """Breadth-first search over (player, boxes); small rooms solve in milliseconds."""
    walls = {(r, c) for r, row in enumerate(state["grid"]) for c, ch in enumerate(row) if ch == "#"}
    targets = frozenset(_cells(state["targets"]))
    start = (next(iter(_cells([state["player"]]))), frozenset(_cells(state["boxes"])))
    seen, queue = {start: None}, collections.deque([start])
    while queue:
        node = queue.popleft()
        player, boxes = node
        if boxes <= targets:
            path = []
            while seen[node] is not None:
                node, move = seen[node]
                path.append(move)
            return path[::-1]
        for move, (dr, dc) in MOVES.items():
            nxt = (player[0] + dr, player[1] + dc)
            if nxt in walls:
                continue
            new_boxes = boxes
            if nxt in boxes:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if beyond in walls or beyond in boxes:
                    continue
                new_boxes = (boxes - {nxt}) | {beyond}
            child = (nxt, frozenset(new_boxes))
            if child not in seen:
                seen[child] = (node, move)
                queue.append(child)
    return []


def plan_frozenlake(state: dict) -> list[str]:
    size, holes = int(state["size"]), _cells(state["holes"])
    goal, start = next(iter(_cells([state["goal"]]))), next(iter(_cells([state["player"]])))
    seen, queue = {start: None}, collections.deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            path = []
            while seen[cell] is not None:
                cell, move = seen[cell]
                path.append(move)
            return path[::-1]
        for move, (dr, dc) in MOVES.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in holes and nxt not in seen:
                seen[nxt] = (cell, move)
                queue.append(nxt)
    return []


def next_minesweeper_reveal(state: dict) -> list[str]:
    mines, revealed = _cells(state["mines"]), _cells(state["revealed"])
    for r in range(int(state["rows"])):
        for c in range(int(state["cols"])):
            if (r, c) not in mines and (r, c) not in revealed:
                return [f"({r}, {c})"]
    return []


PLANNERS = {"sokoban": plan_sokoban, "frozenlake": plan_frozenlake, "minesweeper": next_minesweeper_reveal}


def play(client, env_id: str, seed: int) -> dict:
    from envserve.client import check, state_dict
    spec = client.get_spec(env_id)
    sid = client.open(env_id, 1, {"render_image": True}, "free_think")[0]
    r = check(client.reset([sid], [seed])[0])
    print(f"\n== {env_id} (seed {seed}) ==\n{r.observation.text}")
    total, turns = 0.0, 0
    while not (r.done or r.truncated):
        truth = state_dict(client.get_state(sid, -1))
        plan = PLANNERS[env_id](truth)[: spec.max_actions_per_turn] or ["Up"]
        text = f"<think>plan from the ground truth: {', '.join(plan)}</think><answer>{', '.join(plan)}</answer>"
        r = check(client.step([(sid, text)])[0])
        total += r.reward
        turns += 1
        print(f"turn {r.turn}: {', '.join(r.parsed_actions)} -> reward {r.reward:+.2f}")
    print(r.observation.text)
    png = len(r.observation.images[0].png) if r.observation.images else 0
    client.close_sessions([sid])
    return {"env": env_id, "success": r.success, "return": round(total, 2), "turns": turns, "png_bytes": png}


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
