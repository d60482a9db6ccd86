"""Plays one short episode of one environment on a real replica and prints what the docs show.

Run by the docs build (docs/hooks/env_pages.py), one process per environment:

    python docs/hooks/run_env.py sokoban

It starts `envserve serve ENV --port 0` on loopback, reads the env's spec through the client, opens a
session, resets it on seed 0, reads the ground truth (GetState) of turn 0, lets the env's expert
answer one turn in the env's default action format, steps it and reads turn 1. Everything printed
(one JSON object) came back over gRPC, so the pages show what a client sees.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

# The answer of the first turn where the env has no scripted expert.
FIXED_ANSWERS = {"svg": '<svg xmlns="http://www.w3.org/2000/svg" width="256" height="256">'
                        '<rect x="48" y="48" width="160" height="160" fill="#3366cc"/></svg>'}
READY = re.compile(r"serving .* on ([\d.]+:\d+) with \d+ workers")


def start_replica(env_id: str) -> tuple[subprocess.Popen, str, list[str]]:
    cmd = [sys.executable, "-u", "-m", "envserve.cli", "serve", env_id, "--port", "0", "--workers", "1",
           "--metrics-port", "-1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        m = READY.search(line)
        if m:
            threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
            return proc, m.group(1), lines
    proc.wait()
    raise RuntimeError("the replica did not start:\n" + "".join(lines[-20:]))


def truth_json(response) -> dict:
    from envserve.client.client import state_dict
    return {"turn": response.turn, "state": state_dict(response), "relations": list(response.relations),
            "anchor": response.anchor}


def play(address: str, env_id: str) -> dict:
    from envserve.client import EnvClient
    from envserve.client.experts import Truth, answer_text, expert_for, session_settings
    from envserve.client.experts.answers import meta_tag

    with EnvClient(address) as client:
        spec = client.get_spec(env_id)
        out = {
            "env_id": spec.env_id, "description": spec.description, "system_prompt": spec.system_prompt,
            "action_space": spec.action_space, "max_turns": spec.max_turns,
            "max_actions_per_turn": spec.max_actions_per_turn, "modalities": list(spec.modalities),
            "default_action_format": spec.default_action_format, "action_formats": list(spec.action_formats),
            "config_schema": json.loads(spec.config_schema_json or "{}"),
            "splits": [{"name": s.name, "description": s.description} for s in spec.splits],
            "supports_snapshot": spec.supports_snapshot, "replay_exact": spec.replay_exact,
        }
        try:
            expert_cls = expert_for(env_id)
        except ValueError:          # no scripted expert (svg): a fixed answer stands in
            expert_cls = None
        config = dict(expert_cls.session_config) if expert_cls else {}
        opened = client.open_sessions(env_id, 1, config, spec.default_action_format)
        sid = opened.session_ids[0]
        out["session_config"] = config
        out["session_system_prompt"] = opened.system_prompt
        try:
            first = client.reset_one(sid, seed=0)
            out["observation"] = first.observation.text
            out["images"] = [{"width": im.width, "height": im.height} for im in first.observation.images]
            state0 = client.get_state(sid, 0)
            out["state0"] = truth_json(state0)
            truth = Truth.from_response(state0)
            settings = session_settings(spec, config)
            if expert_cls:
                move = expert_cls(settings).act(truth, int(settings["max_actions_per_turn"]))
                actions, reasoning, tag = move.actions, move.reasoning, meta_tag(move, True)
            else:
                actions, reasoning, tag = [FIXED_ANSWERS.get(env_id, "")], "", "planning"
            text = answer_text(spec.default_action_format, actions, truth, None, reasoning=reasoning,
                               tag=tag, separator=str(settings["action_separator"]))
            out["answer"] = text
            r = client.step_one(sid, text)
            out["step"] = {"observation": r.observation.text, "reward": r.reward,
                           "reward_components": dict(r.reward_components), "done": r.done,
                           "action_valid": r.action_valid, "parsed_actions": list(r.parsed_actions),
                           "feedback": r.feedback}
            out["state1"] = truth_json(client.get_state(sid, 1))
        finally:
            client.close_sessions([sid])
    return out


def main() -> int:
    env_id = sys.argv[1]
    proc, address, lines = start_replica(env_id)
    try:
        print(json.dumps(play(address, env_id), default=str))
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
