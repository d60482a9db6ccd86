"""What every environment served by envserve must do, checked through the protocol only."""
import json
import random

import grpc
import pytest

from envserve.client import check, decode_image, state_dict
from envserve.client.errors import SessionNotFoundError

from .conftest import quick

pytestmark = pytest.mark.slow


CONFIG = {"include_valid_actions": True}
SEEDS = [0, 1, 7, 123456][:1 if quick() else None]


def answer(action: str) -> str:
    return f"<answer>{action}</answer>"


def open_one(client, env_id, config=None):
    return client.open(env_id, 1, {**CONFIG, **(config or {})}, "no_think")[0]


def policy_actions(result, spec, k=0):
    """A deterministic legal action: the k-th of the valid actions the env lists, else of its action space."""
    listed = list(result.info["valid_actions"]) if "valid_actions" in result.info else []
    if not listed:
        listed = [a.strip() for a in spec.action_space.split(",") if a.strip()]
    return listed[k % len(listed)]


def test_spec_is_complete(clients, env_id):
    spec = clients[0].get_spec(env_id)
    assert spec.env_id == env_id
    assert spec.system_prompt.strip() and spec.description.strip() and spec.action_space.strip()
    assert spec.max_turns > 0 and spec.max_actions_per_turn > 0
    assert "text" in spec.modalities or "image" in spec.modalities
    assert spec.default_action_format in spec.action_formats
    schema = json.loads(spec.config_schema_json)
    for key in ("max_turns", "max_actions_per_turn", "render_image", "format_penalty"):
        assert "default" in schema["properties"][key]
    assert spec.splits


def test_schema_bounds_every_key(clients, env_id):
    """Callers choose within bounds: every number has a maximum, every string a maxLength or an
    enum (the allowed paths of a key naming a file), every object and list a size, and each
    default is within its own bounds (else Opens without that key would be refused)."""
    from jsonschema import Draft202012Validator
    props = json.loads(clients[0].get_spec(env_id).config_schema_json)["properties"]
    unbounded = []
    for key, p in props.items():
        kind = p.get("type")
        if kind in ("integer", "number") and not {"maximum", "exclusiveMaximum", "enum"} & set(p):
            unbounded.append(f"{key} (a number without a maximum)")
        elif kind == "string" and not {"maxLength", "enum"} & set(p):
            unbounded.append(f"{key} (a string without maxLength or enum)")
        elif kind == "object" and "maxProperties" not in p:
            unbounded.append(f"{key} (an object without maxProperties)")
        elif kind == "array" and "maxItems" not in p:
            unbounded.append(f"{key} (a list without maxItems)")
        elif kind is None:
            unbounded.append(f"{key} (no type)")
        Draft202012Validator.check_schema(p)
        assert Draft202012Validator(p).is_valid(p["default"]), f"{env_id}.{key}: default {p['default']!r} out of bounds"
    assert not unbounded, f"{env_id}: unbounded config keys: {', '.join(unbounded)}"


def test_a_value_out_of_bounds_is_invalid_argument_naming_it(clients, env_id):
    from envserve.client.errors import EnvServeError
    props = json.loads(clients[0].get_spec(env_id).config_schema_json)["properties"]
    with pytest.raises(EnvServeError) as e:
        clients[0].open(env_id, 1, {"image_size": props["image_size"]["maximum"] + 1})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "config.image_size" in e.value.message


def test_lifecycle(clients, env_id):
    c = clients[0]
    spec = c.get_spec(env_id)
    sid = open_one(c, env_id)
    r = c.reset_one(sid, seed=3)
    assert r.observation.text and r.turn == 0 and r.episode == 0 and r.anchor
    assert not r.done
    r = c.step_one(sid, answer(policy_actions(r, spec)))
    assert r.action_valid and r.actions_executed == 1 and r.turn == 1
    assert set(r.reward_components) and abs(sum(r.reward_components.values()) - r.reward) < 1e-9
    assert [s.code for s in c.close_sessions([sid])] == [0]
    with pytest.raises(SessionNotFoundError):
        c.step_one(sid, answer("x"))


def test_unknown_config_key_is_invalid_argument(clients, env_id):
    from envserve.client.errors import EnvServeError
    with pytest.raises(EnvServeError) as e:
        clients[0].open(env_id, 1, {"no_such_key_anywhere": 1})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("seed", SEEDS)
def test_seed_determinism_across_processes(clients, env_id, seed):
    seen = []
    for c in clients:
        sid = open_one(c, env_id)
        r = c.reset_one(sid, seed=seed)
        truth = c.get_state(sid, 0)
        seen.append((r.observation.text, r.anchor, json.dumps(state_dict(truth), sort_keys=True),
                     list(truth.relations)))
        c.close_sessions([sid])
    assert seen[0] == seen[1]


def test_different_seeds_give_different_tasks(clients, env_id):
    c = clients[0]
    if not c.get_spec(env_id).seed_varies_start:
        pytest.skip(f"{env_id} starts in one state; its seed drives only what follows")
    sid = open_one(c, env_id)
    anchors = {c.reset_one(sid, seed=s).anchor for s in range(8)}
    c.close_sessions([sid])
    assert len(anchors) > 1


def _play(c, spec, sid, steps, first):
    out, r = [], first
    for k in range(steps):
        if r.done or r.truncated:
            break
        r = c.step_one(sid, answer(policy_actions(r, spec, k)))
        truth = c.get_state(sid, -1)
        out.append((r.observation.text, r.reward, r.done, r.success, r.anchor,
                    json.dumps(state_dict(truth), sort_keys=True)))
    return out


def test_fork_equivalence(clients, env_id):
    c = clients[0]
    spec = c.get_spec(env_id)
    sid = open_one(c, env_id)
    # Fork a live episode: where one step can end it (a card game), the next seeds are tried;
    # where every episode ends at its first step (one question, one answer), the fork is taken
    # at the start, so the step after it is still compared.
    for seed in range(11, 11 + 8):
        r = c.reset_one(sid, seed=seed)
        r = c.step_one(sid, answer(policy_actions(r, spec, 1)))
        if not (r.done or r.truncated):
            break
    else:
        r = c.reset_one(sid, seed=11)
    forks = c.fork(sid, 2)
    assert len(forks) == 2 and sid not in forks
    # A fork starts where the original is, including the ground truth of earlier turns.
    for f in forks:
        assert c.get_state(f, 0).anchor == c.get_state(sid, 0).anchor
        assert c.get_state(f, -1).anchor == r.anchor
    trajectories = [_play(c, spec, s, 6, r) for s in [sid, *forks]]
    assert trajectories[0] and trajectories[0] == trajectories[1] == trajectories[2]
    c.close_sessions([sid, *forks])


def test_replay_rebuilds_the_session_in_another_process(clients, env_id):
    """What lets a client carry a session over from a dead replica: its history (seed, actions),
    replayed by Restore in another process, ends in the same anchors and steps on the same."""
    from envserve.client import messages as pb
    a, b = clients
    spec = a.get_spec(env_id)
    sid = open_one(a, env_id)
    first = r = a.reset_one(sid, seed=13)
    turns = []
    for k in range(3):
        if r.done or r.truncated:
            break
        text = answer(policy_actions(r, spec, k))
        r = a.step_one(sid, text)
        turns.append(pb.ReplayTurn(action=text, anchor=r.anchor))
    config = pb.OpenRequest()
    config.config.update(CONFIG)
    history = pb.SessionHistory(env_id=env_id, config=config.config, action_format="no_think", seed=13,
                                trial=first.trial, episode=first.episode, reset_anchor=first.anchor, turns=turns)
    restored = b.restore([history]).sessions[0]
    if not spec.replay_exact:
        assert restored.status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        return
    assert restored.status.code == 0, restored.status.message
    assert restored.anchor == r.anchor
    assert b.get_state(restored.session_id, 0).anchor == first.anchor
    assert _play(b, spec, restored.session_id, 3, r) == _play(a, spec, sid, 3, r)
    a.close_sessions([sid])
    b.close_sessions([restored.session_id])


def test_ground_truth_matches_observation(clients, env_id):
    c = clients[0]
    spec = c.get_spec(env_id)
    sid = open_one(c, env_id)
    r = c.reset_one(sid, seed=5)
    results = [r]
    for k in range(4):
        if r.done or r.truncated:
            break
        r = c.step_one(sid, answer(policy_actions(r, spec, k + 2)))
        results.append(r)
    for res in results:
        truth = c.get_state(sid, res.turn)
        assert truth.turn == res.turn and truth.episode == res.episode
        assert truth.observation_text == res.observation.text
        assert truth.anchor == res.anchor
        assert state_dict(truth)
    c.close_sessions([sid])


def test_same_task_restarts_initial_state(clients, env_id):
    c = clients[0]
    spec = c.get_spec(env_id)
    sid = open_one(c, env_id)
    first = c.reset_one(sid, seed=9)
    c.step_one(sid, answer(policy_actions(first, spec)))
    again = check(c.reset([sid], same_task=True)[0])
    assert again.episode == 1 and again.turn == 0
    assert again.observation.text == first.observation.text and again.anchor == first.anchor
    assert c.get_state(sid, 0, episode=0).anchor == first.anchor
    fresh = c.reset_one(sid, seed=10)
    assert fresh.episode == 0
    c.close_sessions([sid])


def test_tasks_of_every_split_page_stably_and_each_id_starts_its_task(clients, env_id):
    """ListTasks: each split's size is the spec's, ids are unique within a split, two pages in a
    row are one longer page, a listing repeats, and a task's id starts the same initial state as
    its seed, in either server process."""
    c = clients[0]
    spec = c.get_spec(env_id)
    for split in spec.splits:
        first = c.list_tasks(env_id, split.name, page_size=3)
        assert first.total == split.num_tasks > 0
        assert 0 < len(first.tasks) <= 3 and {t.split for t in first.tasks} == {split.name}
        ids = [t.task_id for t in first.tasks]
        if first.next_page_token:
            second = c.list_tasks(env_id, split.name, page_size=3, page_token=first.next_page_token)
            ids += [t.task_id for t in second.tasks]
            assert [t.task_id for t in c.list_tasks(env_id, split.name, page_size=6).tasks] == ids
        assert len(set(ids)) == len(ids)
        assert c.list_tasks(env_id, split.name, page_size=3) == first
    task = c.list_tasks(env_id, spec.splits[-1].name, page_size=2).tasks[-1]
    anchors = set()
    for cl in clients:
        sid = open_one(cl, env_id)
        anchors.add(cl.reset_one(sid, task_id=task.task_id).anchor)
        anchors.add(cl.reset_one(sid, seed=task.seed).anchor)
        cl.close_sessions([sid])
    assert len(anchors) == 1, f"{env_id} task {task.task_id}: {anchors}"


GARBAGE = ["", " ", "\x00\x01\x02", "<answer>", "</answer>", "<answer><answer>Up</answer>",
           "<think><answer>Up</think></answer>", "<answer>" + "A" * 5000 + "</answer>",
           "<answer>\u202e\ufeff</answer>", "<answer>, , ,</answer>", "<answer>(99, 99)</answer>",
           "<answer>DROP TABLE</answer>", "<<<>>>", "<answer>Up" * 50, "x" * 20000]


def test_garbage_actions_never_crash(clients, env_id):
    c = clients[0]
    spec = c.get_spec(env_id)
    sid = open_one(c, env_id, {"max_turns": 10_000})
    r = c.reset_one(sid, seed=2)
    rng = random.Random(env_id)
    texts = GARBAGE + ["".join(rng.choice("<>/answerthink ,()0123\n\x7f") for _ in range(rng.randint(0, 80)))
                       for _ in range(60)]
    for t in texts:
        res = c.step([(sid, t)])[0]
        assert res.status.code == 0, res.status.message
        if not res.action_valid:
            assert res.feedback
        # Where any text is an answer (a question's env), garbage can end the episode: go on in a new one.
        if res.done or res.truncated:
            res = c.reset_one(sid, seed=2)
    # The session still works afterwards.
    if not res.done:
        ok = c.step_one(sid, answer(policy_actions(res, spec)))
        assert ok.status.code == 0
    c.close_sessions([sid])


def test_images_when_asked(clients, env_id):
    c = clients[0]
    spec = c.get_spec(env_id)
    if "image" not in spec.modalities:
        pytest.skip(f"{env_id} is text only")
    sid = open_one(c, env_id, {"render_image": True, "image_size": 96})
    r = c.reset_one(sid, seed=1)
    assert len(r.observation.images) == 1
    img = decode_image(r.observation.images[0])
    assert img.shape == (96, 96, 3) and r.observation.images[0].height == 96
    r2 = c.step_one(sid, answer(policy_actions(r, spec)))
    assert r2.observation.images[0].png
    c.close_sessions([sid])
