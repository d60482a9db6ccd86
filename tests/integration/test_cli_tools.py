"""The command line's tools for environment authors and judges, through real servers: `new-env`
(a scaffolded package registered like an installed one, served by `envserve serve` and held to the
conformance suite), `state` (GetState of a live session, or of a seed after given actions) and
`judge --preview` (the LLM judge's prompt for one reply, state cut included)."""
import json
import os
import subprocess
import sys
import textwrap
import tomllib

import pytest

from envserve.client import EnvClient
from envserve.judge.llm_judge import LLMJudgeConfig, request_body
from envserve.judge.prompts import MAX_STATE_CHARS, judge_prompt
from envserve.judge.service import record_of
from outoftree import register_on_path

REPLY = ("<think><observation>The box is below me and the target is below-left.</observation>"
         "<reasoning>push it down</reasoning><prediction>the box is on the target</prediction></think>"
         "<answer>Down</answer>")


def cli(*args, env_vars=None, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "envserve.cli", *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env_vars or {})), cwd=cwd, timeout=timeout)


# -- new-env ------------------------------------------------------------------------------------------
def test_a_scaffolded_package_passes_the_conformance_suite_as_generated(tmp_path):
    pkg = tmp_path / "tide-walk"
    made = cli("new-env", "tide-walk", "--dir", str(pkg))
    assert made.returncode == 0, made.stderr
    again = cli("new-env", "tide-walk", "--dir", str(pkg))
    assert again.returncode == 2 and "not an empty folder" in again.stderr
    assert cli("new-env", "Tide Walk!", "--dir", str(tmp_path / "x")).returncode == 2

    # Registered from the generated pyproject's own entry points, as pip would install them.
    project = tomllib.loads((pkg / "pyproject.toml").read_text())
    entry_points = project["project"]["entry-points"]
    assert entry_points == {"envserve.envs": {"tide-walk": "tide_walk_env.env:TideWalkEnv"}}
    env_vars = register_on_path(pkg, project["project"]["name"], entry_points)
    listed = cli("ls", env_vars=env_vars)
    assert listed.returncode == 0 and "tide-walk" in listed.stdout

    # Its own tests: the env alone, then envserve's conformance suite, which serves it on two
    # `envserve serve` processes.
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests"],
                         cwd=pkg, capture_output=True, text=True, env=dict(os.environ, **env_vars), timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "3 passed" in run.stdout and "skipped" not in run.stdout


# -- state --------------------------------------------------------------------------------------------
def played(client, env_id, seed, actions):
    sid = client.open(env_id, 1, None, "no_think")[0]
    client.reset_one(sid, seed=seed)
    for a in actions:
        client.step_one(sid, f"<answer>{a}</answer>")
    return sid


def test_state_of_a_seed_after_actions_here_and_on_a_server(grid_server):
    with EnvClient(grid_server.address) as c:
        sid = played(c, "frozenlake", 7, ["Down", "Right"])
        truth = c.get_state(sid, -1)
        c.close_sessions([sid])
    args = ["state", "frozenlake", "--seed", "7", "--action", "Down", "--action", "Right", "--json"]
    here, there = cli(*args), cli(*args, "--address", grid_server.address)
    assert here.returncode == 0 and there.returncode == 0, here.stderr + there.stderr
    records = [json.loads(p.stdout) for p in (here, there)]
    assert records[0] == records[1]
    assert records[0]["turn"] == 2 and records[0]["anchor"] == truth.anchor
    assert records[0]["relations"] == list(truth.relations) and truth.relations
    assert records[0]["observation_text"] == truth.observation_text
    assert records[0]["state"]["player"] == [int(v) for v in truth.state["player"]]

    pretty = cli("state", "frozenlake", "--seed", "7", "--action", "Down", "--action", "Right",
                 "--address", grid_server.address)
    assert pretty.returncode == 0
    head, _, relations = pretty.stdout.partition("\nRelations:\n")
    assert json.loads(head)["anchor"] == truth.anchor
    assert relations.splitlines() == [f"- {r}" for r in truth.relations]


def test_state_of_a_live_session_leaves_it_live(grid_server):
    with EnvClient(grid_server.address) as c:
        sid = played(c, "sokoban", 5, ["Left", "Down"])
        first = c.get_state(sid, 1)
        out = cli("state", "sokoban", "--address", grid_server.address, "--session", sid, "--turn", "1", "--json")
        assert out.returncode == 0, out.stderr
        record = json.loads(out.stdout)
        assert record["session_id"] == sid and record["turn"] == 1 and record["anchor"] == first.anchor
        assert c.step_one(sid, "<answer>Up</answer>").turn == 3      # still the caller's session
        wrong = cli("state", "frozenlake", "--address", grid_server.address, "--session", sid)
        assert wrong.returncode == 2 and "'sokoban' session" in wrong.stderr
        c.close_sessions([sid])


def test_state_refuses_bad_input_with_a_reason(grid_server):
    cases = [
        (["state", "nope"], 2, "unknown environment"),
        (["state", "sokoban", "--config", "[1]"], 2, "JSON object"),
        (["state", "sokoban", "--config", '{"no_such_key": 1}'], 1, "no_such_key"),
        (["state", "sokoban", "--session", "abc"], 2, "--address"),
        (["state", "sokoban", "--address", grid_server.address, "--session", "abc", "--seed", "1"], 2, "not both"),
        # seed 3 of sokoban is solved by its first push (an Up): no turn is left for the second.
        (["state", "sokoban", "--seed", "3", "--action", "Up", "--action", "Up"], 1, "episode ended"),
    ]
    for args, status, says in cases:
        out = cli(*args)
        assert out.returncode == status and says in out.stderr, (args, out.returncode, out.stderr)


# -- judge --preview ----------------------------------------------------------------------------------
def test_judge_preview_prints_the_prompts_the_llm_judge_sends(grid_server):
    with EnvClient(grid_server.address) as c:
        sid = played(c, "sokoban", 5, ["Left"])
        now = record_of(c.get_state(sid, -1))
        c.step_one(sid, "<answer>Down</answer>")
        after = record_of(c.get_state(sid, -1))
        c.close_sessions([sid])
    expected = {
        "grounding": judge_prompt("yesno", "sokoban", "grounding",
                                  "The box is below me and the target is below-left.", now),
        "world_modeling": judge_prompt("yesno", "sokoban", "world_modeling", "the box is on the target", after, now),
    }
    base = ["judge", "--preview", "--env", "sokoban", "--seed", "5", "--action", "Left", "--reply", REPLY,
            "--env-address", grid_server.address]
    out = cli(*base)
    assert out.returncode == 0, out.stderr
    for field, prompt in expected.items():
        assert f"field {field}, mode yesno" in out.stdout
        for message in prompt.messages:
            assert f"--- {message['role']} ---\n{message['content']}\n" in out.stdout + "\n"
    assert "Map, top row first" in out.stdout and "True state after the action(s):" in out.stdout

    body = cli(*base, "--json", "--llm-model", "judge-7b", "--field", "world_modeling")
    assert body.returncode == 0, body.stderr
    assert json.loads(body.stdout) == {
        "world_modeling": request_body(LLMJudgeConfig(model="judge-7b"), expected["world_modeling"])}
    assert cli(*base, "--json").returncode == 2      # a request names its model

    structured = cli(*base, "--llm-mode", "structured", "--field", "grounding")
    assert structured.returncode == 0
    assert "mode structured" in structured.stdout and "JSON list of relation atoms" in structured.stdout

    no_fields = cli("judge", "--preview", "--env", "sokoban", "--reply", "<answer>Up</answer>")
    assert no_fields.returncode == 2 and "--field" in no_fields.stderr


def test_judge_preview_of_a_live_session_reads_the_turns_the_service_reads(grid_server):
    with EnvClient(grid_server.address) as c:
        sid = played(c, "sokoban", 5, ["Left", "Down"])
        t1, t2 = (record_of(c.get_state(sid, t)) for t in (1, 2))
        base = ["judge", "--preview", "--env-address", grid_server.address, "--session", sid, "--reply", REPLY,
                "--field", "world_modeling"]
        out = cli(*base, "--turn", "1")
        assert out.returncode == 0, out.stderr
        prompt = judge_prompt("yesno", "sokoban", "world_modeling", "the box is on the target", t2, t1)
        assert prompt.messages[1]["content"] in out.stdout
        assert "ground truth: turn 2 of episode 0" in out.stdout
        latest = cli(*base)            # the latest turn has no turn after it yet
        assert latest.returncode == 1 and "turn 3" in latest.stderr
        assert c.step_one(sid, "<answer>Up</answer>").turn == 3     # the session is still the caller's
        c.close_sessions([sid])


BIG_STATE_ENV = textwrap.dedent('''
    from envserve.core import ActionOutcome, Environment, EnvSpec, GroundTruth


    class ShelfEnv(Environment):
        """A shelf of many labelled items: a ground truth longer than the LLM judge shows."""
        spec = EnvSpec(env_id="shelf", description="a long shelf", system_prompt="Look at the shelf.",
                       action_space="look", max_turns=5, max_actions_per_turn=1, config_defaults={"items": 600})

        def reset(self, seed, options=None):
            self.items, self.looks = [f"item {seed}-{i}" for i in range(self.config["items"])], 0

        def step(self, action):
            if action != "look":
                return ActionOutcome(valid=False, feedback="only look")
            self.looks += 1
            return ActionOutcome()

        def render_text(self):
            return f"{len(self.items)} items, looked {self.looks} times"

        def ground_truth(self):
            return GroundTruth({"items": list(self.items), "looks": self.looks}, ["the shelf is long"])
''')


def test_judge_preview_shows_where_the_state_is_cut(tmp_path):
    (tmp_path / "shelf_env.py").write_text(BIG_STATE_ENV)
    env_vars = register_on_path(tmp_path, "shelf-env", {"envserve.envs": {"shelf": "shelf_env:ShelfEnv"}})
    out = cli("judge", "--preview", "--env", "shelf", "--seed", "2", "--action", "look", "--field", "grounding",
              "--reply", "I see a long shelf.", env_vars=env_vars)     # a replica in the command's own process
    assert out.returncode == 0, out.stderr
    state = {"items": [f"item 2-{i}" for i in range(600)], "looks": 1}       # state_json keeps integers
    left_out = len(json.dumps(state, sort_keys=True, ensure_ascii=False)) - MAX_STATE_CHARS
    assert left_out > 0
    assert f"# the state JSON of turn 1 is cut at {MAX_STATE_CHARS} characters: {left_out} more are left out" \
        in out.stdout
    assert f"... (cut: {left_out} more characters)" in out.stdout and "I see a long shelf." in out.stdout
    assert "prompt family generic" in out.stdout


@pytest.mark.parametrize("args, says", [
    (["--session", "abc"], "--env-address"),
    (["--env", "sokoban"], "--reply"),
])
def test_judge_preview_refuses_incomplete_input(args, says):
    out = cli("judge", "--preview", *args)
    assert out.returncode == 2 and says in out.stderr, out.stderr


# -- tasks ----------------------------------------------------------------------------------------------
def test_tasks_list_prints_a_splits_tasks_from_a_replica(grid_server):
    out = cli("tasks", "list", "minesweeper", "--split", "test", "--limit", "3", "--address", grid_server.address)
    assert out.returncode == 0, out.stderr
    with EnvClient(grid_server.address) as c:
        ids = [t.task_id for t in c.list_tasks("minesweeper", "test", 3).tasks]
    assert [line.split()[0] for line in out.stdout.splitlines()] == ids
    assert "test: 100000 tasks" in out.stderr


def test_tasks_export_writes_each_trainers_rows_naming_the_listed_tasks(grid_server, tmp_path):
    import datasets

    from envserve.integrations._common import row_reset_args
    with EnvClient(grid_server.address) as c:
        listed = [(t.task_id, t.seed) for t in c.list_tasks("sokoban", "test", 5).tasks]
    for fmt, kind in (("tasks", "json"), ("trl", "json"), ("verl", "parquet"), ("skyrl", "parquet")):
        path = tmp_path / f"sokoban.{fmt}"
        out = cli("tasks", "export", "sokoban", "--split", "test", "--limit", "5", "--format", fmt, "--out", str(path),
                  "--address", grid_server.address)
        assert out.returncode == 0, out.stderr
        rows = list(datasets.load_dataset(kind, data_files=str(path), split="train"))
        # What envserve's adapters read from a row (TRL its columns, verl and SkyRL extra_info too)
        # names the listed task.
        reset_args = [row_reset_args(r, r.get("extra_info")) for r in rows]
        assert [(task_id, seed) for seed, task_id, _ in reset_args] == listed, fmt
        assert all(split == "test" for _, _, split in reset_args)
        if fmt == "verl":
            assert rows[0]["data_source"] == "envserve/sokoban" and rows[0]["prompt"][0]["role"] == "user"
            assert rows[0]["extra_info"]["tools_kwargs"]["move"]["create_kwargs"]["seed"] == listed[0][1]
        if fmt == "skyrl":
            assert rows[0]["env_class"] == "envserve-sokoban"


def test_tasks_of_an_unknown_split_fail_naming_the_splits(grid_server, tmp_path):
    out = cli("tasks", "export", "sokoban", "--split", "nope", "--out", str(tmp_path / "x"), "--address",
              grid_server.address)
    assert out.returncode == 2 and "train" in out.stderr and "test" in out.stderr
    assert not (tmp_path / "x").exists()
