"""ALFWorld through the real gRPC server: the package's handcoded expert solves generated games of
all six task types, the official-data path serves a json_2.1.1 folder, RLVMR and LaMer splits,
"Nothing happens." for invalid actions, one engine process per session that dies alone.
Needs the `alfworld` and `textworld[pddl]` packages."""
import json
import os
import shutil
import uuid

import psutil
import pytest

pytest.importorskip("alfworld")
pytest.importorskip("fast_downward")

from envserve.client import EnvClient, check, state_dict  # noqa: E402
from envserve.client.errors import SessionLostError  # noqa: E402
from envserve.envs.alfworld import generate as gen  # noqa: E402
from envserve.envs.alfworld.engine import EngineClient, normalize_command  # noqa: E402
from envserve.envs.alfworld.env import _SPLITS, SPLIT_STRIDE, AlfWorldEnv, _select  # noqa: E402
from envserve.envs.alfworld.games import GameRef, GeneratedGames, scan_official  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow


SPEC = AlfWorldEnv.spec
HELDOUT = set(SPEC.config_defaults["heldout_task_types"].split(","))


def answer(action: str) -> str:
    return f"<answer>{action}</answer>"


def engine_children(pid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "alfworld.engine" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def session_engines(worker: int) -> list[psutil.Process]:
    """The sessions' engines: forks of the worker's template engine, so not the worker's own
    children. The template comes and goes with the tests that run before (one kills it)."""
    out = []
    for p in engine_children(worker):
        try:
            if p.ppid() != worker:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


# Every process of this module's server (fork copies of engines included) carries this tag in
# its environment, so counting them is not disturbed by other servers on the machine.
SERVER_TAG = f"test-alfworld-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["alfworld"], workers=1, metrics=False, env_vars={"ENVSERVE_TEST_TAG": SERVER_TAG}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with EnvClient(server.address) as c:
        yield c


def follow_expert(client, sid, limit=60):
    """Steps the expert's advice (from the state endpoint) until the episode ends."""
    r = None
    for _ in range(limit):
        action = state_dict(client.get_state(sid, -1))["expert_action"]
        assert action, "the expert gave up"
        r = client.step_one(sid, answer(action))
        assert r.action_valid, (action, r.feedback)
        if r.done or r.truncated:
            break
    return r


def test_expert_solves_generated_games_of_all_six_types_through_grpc(client):
    sid = client.open("alfworld", 1, {"expert": True, "max_turns": 60}, "no_think")[0]
    solved = {}
    # Game i of a split is task type i mod 6: seeds 0-5 of train are one game of each type.
    for seed in range(6):
        r = client.reset_one(sid, seed=seed)
        truth = state_dict(client.get_state(sid, 0))
        assert "Your task is to:" in r.observation.text and truth["goal"] in r.observation.text
        assert truth["won"] is False and truth["location"] == "middle of the room"
        end = follow_expert(client, sid)
        assert end.done and end.success and end.reward == SPEC.config_defaults["success_reward"]
        assert state_dict(client.get_state(sid, -1))["won"] is True
        solved[truth["task_type"]] = end.turn
    assert sorted(solved) == sorted(gen.TASK_TYPES)
    client.close_sessions([sid])


def test_invalid_action_is_nothing_happens_and_changes_nothing(client):
    sid = client.open("alfworld", 1, {"include_valid_actions": True}, "no_think")[0]
    first = client.reset_one(sid, seed=1)
    admissible = list(first.info["valid_actions"])
    assert "look" in admissible and any(a.startswith("go to ") for a in admissible)
    r = client.step_one(sid, answer("fly to the moon"))
    assert not r.action_valid and r.feedback == "Nothing happens."
    assert "Nothing happens." in r.observation.text and r.anchor == first.anchor and not r.done
    # "take" of something that is not there is also nothing.
    r = client.step_one(sid, answer("take unicorn 1 from countertop 1"))
    assert not r.action_valid and r.anchor == first.anchor
    # Looking does not change the world, so (s, look, s') is the same transition each time.
    a = client.step_one(sid, answer("look"))
    b = client.step_one(sid, answer("look"))
    assert a.action_valid and a.anchor == b.anchor == first.anchor and a.transition == b.transition != ""
    # Moving does: a new state and a new transition key.
    go = next(x for x in admissible if x.startswith("go to "))
    moved = client.step_one(sid, answer(go.upper()))  # case and spacing are normalized
    assert moved.action_valid and moved.anchor != first.anchor and moved.transition != a.transition
    assert state_dict(client.get_state(sid, -1))["location"] == go[len("go to "):]
    client.close_sessions([sid])


def test_goal_line_and_impossible_command_penalty_follow_the_config(client):
    """By default every observation after the first repeats the task line and an impossible command
    costs -0.1; goal_in_observations=False and invalid_action_penalty=0 give the alfworld package's
    observations and rewards."""
    ours = client.open("alfworld", 1, {"include_valid_actions": True}, "no_think")[0]
    package = client.open("alfworld", 1, {"include_valid_actions": True, "goal_in_observations": False,
                                          "invalid_action_penalty": 0.0}, "no_think")[0]
    firsts = [client.reset_one(s, seed=2) for s in (ours, package)]
    assert firsts[0].observation.text == firsts[1].observation.text      # the intro names the task once
    goal = state_dict(client.get_state(ours, 0))["goal"]
    go = next(a for a in firsts[0].info["valid_actions"] if a.startswith("go to "))
    moved, moved_plain = (client.step_one(s, answer(go)) for s in (ours, package))
    assert moved.observation.text == f"Your task is to: {goal}\n\n{moved_plain.observation.text}"
    assert "Your task is to:" not in moved_plain.observation.text and moved_plain.anchor == moved.anchor
    bad, bad_plain = (client.step_one(s, answer("fly to the moon")) for s in (ours, package))
    assert not bad.action_valid and not bad_plain.action_valid
    assert bad.reward == -0.1 and dict(bad.reward_components) == {"invalid_action": -0.1}
    assert bad_plain.reward == 0.0 and bad_plain.observation.text == "Nothing happens."
    spec = client.get_spec("alfworld")
    schema = json.loads(spec.config_schema_json)["properties"]
    assert schema["goal_in_observations"]["default"] is True and schema["invalid_action_penalty"]["default"] == -0.1
    assert "alfworld package" in schema["invalid_action_penalty"]["description"]
    client.close_sessions([ours, package])


def test_put_in_on_is_accepted_for_move_to():
    assert normalize_command("Put  Apple 1 in/on CounterTop 1 ") == "move apple 1 to countertop 1"
    assert normalize_command("put mug 2 in fridge 1") == "move mug 2 to fridge 1"
    assert normalize_command("go to fridge 1") == "go to fridge 1"


def walkthrough_of(client, sid) -> list[str]:
    truth = state_dict(client.get_state(sid, 0))
    games_root = os.environ["ENVSERVE_ALFWORLD_GAMES"]
    path = os.path.join(games_root, "json_2.1.1", truth["game"], "game.tw-pddl")
    with open(path) as f:
        game = json.load(f)
    assert game["solvable"] is True and 0 < len(game["walkthrough"]) <= gen.MAX_EXPERT_STEPS
    return game["walkthrough"]


@pytest.mark.parametrize("fork_copies", [True, False], ids=["fork-copies-the-engine", "fork-replays"])
def test_walkthrough_replays_and_a_fork_ends_alike(client, fork_copies):
    """The walkthrough stored in the game file wins through gRPC; a fork halfway (a copy of the
    engine process, or replayed) ends the same way."""
    seed = SPEC.split("valid_seen").seed_offset + 2
    sid = client.open("alfworld", 1, {"max_turns": 80, "fork_copies": fork_copies}, "no_think")[0]
    client.reset_one(sid, seed=seed)
    walk = walkthrough_of(client, sid)
    half = len(walk) // 2
    r = None
    for action in walk[:half]:
        r = client.step_one(sid, answer(action))
        assert r.action_valid, action
    fork = client.fork(sid, 1)[0]
    assert client.get_state(fork, -1).anchor == client.get_state(sid, -1).anchor
    ends = []
    for s in (sid, fork):
        for action in walk[half:]:
            r = client.step_one(s, answer(action))
        ends.append((r.done, r.success, r.anchor))
    assert ends[0] == ends[1] and ends[0][:2] == (True, True)
    client.close_sessions([sid, fork])


def engines_anywhere() -> dict[int, psutil.Process]:
    """This module server's engine processes wherever they are: copies made for a Fork are not the
    worker's descendants."""
    out = {}
    for p in psutil.process_iter():
        try:
            if ("alfworld.engine" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE
                    and p.environ().get("ENVSERVE_TEST_TAG") == SERVER_TAG):
                out[p.pid] = p
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_fork_copies_the_engine_process_and_each_copy_goes_its_own_way(client):
    seed = SPEC.split("valid_seen").seed_offset + 2
    sid = client.open("alfworld", 1, {"max_turns": 80, "fork_copy_ttl_s": 1.0}, "no_think")[0]
    client.reset_one(sid, seed=seed)
    walk = walkthrough_of(client, sid)
    half = len(walk) // 2
    for action in walk[:half]:
        assert client.step_one(sid, answer(action)).action_valid
    before = set(engines_anywhere())
    forks = client.fork(sid, 3)
    new = set(engines_anywhere()) - before
    assert len(new) == 4       # three copies and the frozen copy they were forked from
    parent = client.get_state(sid, -1)
    for f in forks:            # the same game at the same point: facts, location, admissible commands
        s = client.get_state(f, -1)
        assert (s.anchor, state_dict(s), s.turn) == (parent.anchor, state_dict(parent), parent.turn)
    moved = client.step_one(forks[0], answer(walk[half]))
    assert moved.action_valid and moved.anchor != parent.anchor
    assert client.get_state(sid, -1).anchor == parent.anchor == client.get_state(forks[1], -1).anchor
    ends = []
    for s in (sid, *forks):
        r = None
        for action in walk[half + (s == forks[0]):]:
            r = client.step_one(s, answer(action))
        ends.append((r.done, r.success))
    assert ends == [(True, True)] * 4
    assert [st.code for st in client.close_sessions([sid, *forks])] == [0] * 4
    gone, alive = psutil.wait_procs([p for pid, p in engines_anywhere().items() if pid in new], timeout=15)
    assert not alive           # the copies end with their sessions, the frozen copy after its ttl


def test_splits_follow_rlvmr_and_lamer():
    counts = {"train": 60, "valid_seen": 24, "valid_unseen": 18}
    refs = {b: [GameRef(b, i, gen.TASK_TYPES[i % 6]) for i in range(n)] for b, n in counts.items()}
    heldout = frozenset(HELDOUT)
    assert heldout == {"pick_cool_then_place_in_recep", "pick_two_obj_and_place"}
    splits = _select(refs, heldout, frozenset(SPEC.config_defaults["ood_task_types"].split(",")))
    keys = {k: {(r.base, r.index) for r in v} for k, v in splits.items()}
    types = {k: {r.task_type for r in v} for k, v in splits.items()}
    assert not keys["L0"] & keys["L1"] and not keys["L0"] & keys["L2"] and not keys["L1"] & keys["L2"]
    assert types["L0"] == types["L1"] == types["train_seen"] == set(gen.TASK_TYPES) - heldout
    assert types["L2"] == types["ood"] == heldout and types["id"] == set(gen.TASK_TYPES) - heldout
    assert {b for b, _ in keys["L0"]} == {"valid_seen"} and {b for b, _ in keys["L1"]} == {"valid_unseen"}
    assert keys["id"] | keys["ood"] == keys["valid_seen"] | keys["valid_unseen"]
    assert not keys["train_seen"] & (keys["L0"] | keys["L1"] | keys["L2"])
    for k, (name, _, _) in enumerate(_SPLITS):
        assert SPEC.split(name).seed_offset == k * SPLIT_STRIDE
    # The generated unseen split never uses a floor plan of the others.
    g = GeneratedGames("/nonexistent", counts, (10, 219, 308, 424))
    assert set(g.floor_plans("valid_unseen")) == {10, 219, 308, 424}
    assert not set(g.floor_plans("train")) & set(g.floor_plans("valid_unseen"))


def test_heldout_split_serves_only_heldout_types(client):
    sid = client.open("alfworld", 1, {}, "no_think")[0]
    for k in (0, 1):
        client.reset_one(sid, seed=SPEC.split("L2").seed_offset + k)
        assert state_dict(client.get_state(sid, 0))["task_type"] in HELDOUT
    client.reset_one(sid, seed=SPEC.split("L1").seed_offset)
    truth = state_dict(client.get_state(sid, 0))
    assert truth["task_type"] not in HELDOUT and truth["split_base"] == "valid_unseen"
    client.close_sessions([sid])


def test_generator_is_deterministic_and_varied():
    plans = gen.all_floor_plans()
    seen_plans, objects, goals = set(), set(), set()
    for seed in range(24):
        task_type = gen.TASK_TYPES[seed % 6]
        a = gen.generate(seed, task_type, plans)
        b = gen.generate(seed, task_type, plans)
        if a is None:
            continue
        assert a.problem == b.problem and a.traj_data == b.traj_data and a.game == b.game
        assert "(:goal" in a.problem and a.traj_data["task_type"] == task_type
        seen_plans.add(a.traj_data["scene"]["scene_num"])
        objects.add(a.traj_data["pddl_params"]["object_target"])
        goals.add(a.game["grammar"].split("Your task is to: ", 1)[1].split(".", 1)[0])
    assert len(seen_plans) >= 12 and len(objects) >= 8 and len(goals) >= 16


def test_generated_game_is_checked_by_the_expert_in_an_engine_process(tmp_path):
    """Two engine processes generate the same seed into two folders: the same game, marked
    solvable, with a walkthrough the expert found."""
    paths = []
    for k in range(2):
        engine = EngineClient()
        try:
            paths.append(engine.generate(7, "pick_heat_then_place_in_recep", gen.all_floor_plans(),
                                         str(tmp_path / f"run{k}")))
        finally:
            engine.close()
    games = [json.load(open(p)) for p in paths]
    assert games[0] == games[1] and games[0]["solvable"] is True and games[0]["walkthrough"]
    assert os.path.relpath(paths[0], tmp_path / "run0") == os.path.relpath(paths[1], tmp_path / "run1")
    folder = os.path.dirname(paths[0])
    assert sorted(os.listdir(folder)) == ["game.tw-pddl", "initial_state.pddl", "traj_data.json"]
    assert not [n for n in os.listdir(tmp_path / "run0") if n.startswith(".gen-")]


@pytest.fixture(scope="module")
def official_data(tmp_path_factory):
    """A small folder in the official json_2.1.1 layout, made from generated games, plus what the
    official loader skips: a movable-receptacle task and a game marked unsolvable."""
    root = tmp_path_factory.mktemp("alfworld-data")
    src_root = os.path.join(os.environ["ENVSERVE_ALFWORLD_GAMES"], "json_2.1.1")
    engine = EngineClient()
    made = {}
    try:
        for base, plans, types in (("train", gen.all_floor_plans(), gen.TASK_TYPES[:3]),
                                   ("valid_seen", gen.all_floor_plans(), gen.TASK_TYPES[3:5]),
                                   ("valid_unseen", [10, 219, 308, 424], gen.TASK_TYPES[5:] + gen.TASK_TYPES[:1])):
            for k, task_type in enumerate(types):
                path = engine.generate(500 + k, task_type, plans, os.path.join(src_root, "official-src", base))
                rel = os.path.relpath(os.path.dirname(path), os.path.join(src_root, "official-src", base))
                dest = root / "json_2.1.1" / base / rel.replace("trial_G", "trial_T")
                shutil.copytree(os.path.dirname(path), dest)
                made.setdefault(base, []).append(str(dest / "game.tw-pddl"))
    finally:
        engine.close()
    first = os.path.dirname(os.path.dirname(made["train"][0]))
    shutil.copytree(first, os.path.join(os.path.dirname(first), "pick_and_place_with_movable_recep-Pen-Bowl-Desk-301"))
    unsolvable = os.path.dirname(os.path.dirname(made["train"][1])) + "-copy"
    shutil.copytree(os.path.dirname(os.path.dirname(made["train"][1])), unsolvable)
    for dirpath, _, files in os.walk(unsolvable):
        if "game.tw-pddl" in files:
            p = os.path.join(dirpath, "game.tw-pddl")
            data = json.load(open(p))
            data["solvable"] = False
            json.dump(data, open(p, "w"))
    return root, made


def test_official_layout_folder_is_scanned_like_alfworld(official_data):
    root, made = official_data
    refs = scan_official(str(root / "json_2.1.1"))
    assert {b: sorted(r.path for r in v) for b, v in refs.items()} == {b: sorted(v) for b, v in made.items()}


def test_official_data_served_through_grpc(official_data):
    root, made = official_data
    with ServerProcess(["alfworld"], workers=1, metrics=False, env_vars={"ALFWORLD_DATA": str(root)}) as s, \
            EnvClient(s.address) as c:
        sid = c.open("alfworld", 1, {"data_source": "official", "expert": True, "max_turns": 60}, "no_think")[0]
        served = set()
        for name, base in (("train", "train"), ("valid_seen", "valid_seen"), ("valid_unseen", "valid_unseen")):
            for k in range(len(made[base])):
                c.reset_one(sid, seed=SPEC.split(name).seed_offset + k)
                truth = state_dict(c.get_state(sid, 0))
                assert truth["split_base"] == base
                served.add(truth["game"])
        expected = {"/".join(p.split("/")[-4:-1]) for ps in made.values() for p in ps}
        assert served == expected and all("/trial_T" in g for g in served)
        # L2 holds the held-out types only; an official game plays to the end with the expert.
        c.reset_one(sid, seed=SPEC.split("L2").seed_offset)
        assert state_dict(c.get_state(sid, 0))["task_type"] in HELDOUT
        end = follow_expert(c, sid)
        assert end.done and end.success
        c.close_sessions([sid])
        # A data folder on the server is the operator's to allow: a caller's is refused, there or not.
        from envserve.client.errors import EnvServeError
        with pytest.raises(EnvServeError) as e:
            c.open("alfworld", 1, {"data_source": "official", "data_dir": str(root / "missing")})
        assert e.value.code.name == "INVALID_ARGUMENT" and "config.data_dir" in e.value.message


def test_engine_caches_change_nothing(client):
    """The memoized translation and grammar parsing give the same game, step by step."""
    plays = []
    for caches in (True, False):
        sid = client.open("alfworld", 1, {"engine_caches": caches, "include_valid_actions": True,
                                          "expert": True}, "no_think")[0]
        r = client.reset_one(sid, seed=4)
        trace = [(r.observation.text, list(r.info["valid_actions"]), r.anchor)]
        for _ in range(8):
            action = state_dict(client.get_state(sid, -1))["expert_action"]
            r = client.step_one(sid, answer(action))
            trace.append((r.observation.text, list(r.info["valid_actions"]), r.anchor))
            if r.done:
                break
        plays.append(trace)
        client.close_sessions([sid])
    assert plays[0] == plays[1] and len(plays[0]) > 3


def test_killed_engine_loses_only_its_session_and_close_leaves_no_engine(server, client):
    (worker,) = server.worker_pids()
    before = {p.pid for p in session_engines(worker)}
    a = client.open("alfworld", 1, {}, "no_think")[0]
    (a_engine,) = [p for p in session_engines(worker) if p.pid not in before]
    b = client.open("alfworld", 1, {}, "no_think")[0]
    assert len(session_engines(worker)) == len(before) + 2
    for s in (a, b):
        client.reset_one(s, seed=1)
    a_engine.kill()
    # The worker reaps it when it next talks to it: until then it is a zombie.
    psutil.wait_procs([a_engine], timeout=0.5)
    assert not a_engine.is_running() or a_engine.status() == psutil.STATUS_ZOMBIE
    res = client.step([(a, answer("look"))])[0]
    with pytest.raises(SessionLostError) as e:
        check(res)
    assert "session lost" in e.value.message and str(a_engine.pid) in e.value.message
    for _ in range(3):
        assert client.step_one(b, answer("look")).action_valid
    # The lost session's next episode gets a new engine process.
    client.reset_one(a, seed=1)
    assert client.step_one(a, answer("look")).action_valid
    assert len([p for p in session_engines(worker) if p.pid not in before]) == 2
    assert a_engine.pid not in {p.pid for p in engine_children(worker)}
    assert [s.code for s in client.close_sessions([a, b])] == [0, 0]
    assert {p.pid for p in session_engines(worker)} == before


def test_engines_fork_from_the_workers_template_and_outlive_it(server, client):
    (worker,) = server.worker_pids()

    def engines_of_new_sessions(before):
        return [p for p in engine_children(worker) if p.pid not in before and p.ppid() != worker]

    before = {p.pid for p in engine_children(worker)}
    a, b = client.open("alfworld", 2, {}, "no_think")
    ours = engines_of_new_sessions(before)
    assert len(ours) == 2
    # The sessions' engines are forks of one template (the worker's, for engine caches on), not new
    # interpreters: their parent is an engine process that is the worker's child.
    (template_pid,) = {p.ppid() for p in ours}
    template = psutil.Process(template_pid)
    assert template.ppid() == worker and "alfworld.engine" in " ".join(template.cmdline())
    for s in (a, b):
        client.reset_one(s, seed=2)
    template.kill()
    psutil.wait_procs([template], timeout=0.5)   # a zombie until the worker next looks at it
    assert not template.is_running() or template.status() == psutil.STATUS_ZOMBIE
    # Sessions' engines are processes of their own: the template's death loses nothing.
    for s in (a, b):
        assert client.step_one(s, answer("look")).action_valid
    # The next session starts a new template.
    before = {p.pid for p in engine_children(worker)}
    c = client.open("alfworld", 1, {}, "no_think")[0]
    client.reset_one(c, seed=2)
    assert client.step_one(c, answer("look")).action_valid
    (c_engine,) = engines_of_new_sessions(before)
    assert c_engine.ppid() != template.pid and psutil.Process(c_engine.ppid()).ppid() == worker
    assert [st.code for st in client.close_sessions([a, b, c])] == [0, 0, 0]


def test_a_template_engine_shares_the_planner_file_and_a_second_planner_gets_a_copy(tmp_path):
    """In an engine process the first PddlEnv maps fast-downward's own file; one made while it
    is alive (a game generated beside a loaded game) maps a private copy, as PddlEnv always did."""
    engine = EngineClient()      # an engine process of its own (a template's copies load the same way)
    try:
        game = engine.generate(3, "pick_and_place_simple", gen.all_floor_plans(), str(tmp_path))
        engine.load(game, False)
        maps = open(f"/proc/{engine.pid}/maps").read()
        from fast_downward.interface import DOWNWARD_LIB_PATH
        assert os.path.realpath(DOWNWARD_LIB_PATH) in maps
        # A second game generated while the first is loaded planned with a private copy.
        engine.generate(4, "pick_and_place_simple", gen.all_floor_plans(), str(tmp_path))
        copies = {line.split()[-2] if line.endswith("(deleted)") else line.split()[-1]
                  for line in maps.splitlines() + open(f"/proc/{engine.pid}/maps").read().splitlines()
                  if "libdownward.so" in line}
        assert len(copies) >= 2
        assert engine.step("look")["valid"]
    finally:
        engine.close()
