"""Navigation through the real gRPC server, on the offline MiniWorld backend: a scripted agent that
reads the target from GetState reaches it (+10), invalid action names, ground-truth directions
against a known pose, frames that change with moves and agree across server processes, and the
AI2-THOR backend failing fast with a clear message where no Unity build exists.
Needs the `miniworld` package (headless EGL)."""
import math
import os
import stat
from importlib.util import find_spec

import grpc
import numpy as np
import pytest

# Not importorskip: importing miniworld here would open a GL display without PYGLET_HEADLESS.
if find_spec("miniworld") is None:
    pytest.skip("needs the miniworld package", allow_module_level=True)

from envserve.client import EnvClient, decode_image, state_dict  # noqa: E402
from envserve.client.errors import EnvServeError  # noqa: E402
from envserve.client.experts import NavigationExpert, Truth, agent_frame_offsets  # noqa: E402
from envserve.envs.navigation.env import ACTIONS, DEFAULTS, NavigationEnv  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

SPEC = NavigationEnv.spec
# No AI2-THOR build anywhere: an empty variable counts as unset.
NO_THOR = {"AI2THOR_LOCAL_EXECUTABLE_PATH": ""}


def answer(*actions: str) -> str:
    return "<answer>" + ", ".join(actions) + "</answer>"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["navigation"], workers=1, metrics=False, env_vars=NO_THOR) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with EnvClient(server.address) as c:
        yield c


def truth(client, sid, turn=-1) -> dict:
    return state_dict(client.get_state(sid, turn))


@pytest.mark.parametrize("seed", [1, 2, 6, 9])
def test_scripted_agent_reaches_the_target_for_the_success_reward(client, seed):
    sid = client.open("navigation", 1, {"render_image": False}, "no_think")[0]
    first = client.reset_one(sid, seed=seed)
    start = truth(client, sid, 0)
    assert start["target_obj_type"] and start["distance_to_target"] > DEFAULTS["success_distance"]
    assert first.observation.text.startswith("Human Instruction: Navigate to the ")
    # The expert turns toward the target, walks at it and sidesteps when a turn got it no closer.
    expert = NavigationExpert(DEFAULTS)
    r, total = first, 0.0
    for _ in range(SPEC.max_turns):
        move = expert.act(Truth.from_response(client.get_state(sid, -1)), SPEC.max_actions_per_turn)
        r = client.step_one(sid, answer(*move.actions))
        assert r.action_valid, r.feedback
        total += r.reward
        if r.done or r.truncated:
            break
    assert r.done and r.success and not r.truncated
    assert r.reward_components["success"] == DEFAULTS["success_reward"]
    assert r.reward_components["step"] == pytest.approx(DEFAULTS["step_penalty"] * r.actions_executed)
    end = truth(client, sid)
    assert end["status"] == "success" and end["distance_to_target"] <= DEFAULTS["success_distance"]
    client.close_sessions([sid])


def test_invalid_action_names_are_invalid_with_feedback(client):
    sid = client.open("navigation", 1, {"render_image": False, "include_valid_actions": True}, "no_think")[0]
    first = client.reset_one(sid, seed=2)
    assert sorted(first.info["valid_actions"]) == sorted(ACTIONS)
    r = client.step_one(sid, answer("fly"))
    assert not r.action_valid and r.actions_executed == 0
    assert "Invalid action 'fly'" in r.feedback and "moveahead" in r.feedback
    assert r.anchor == first.anchor and r.reward_components["invalid_action"] < 0
    # The valid prefix runs; the turn stops at the first invalid name.
    r = client.step_one(sid, answer("rotateleft", "jump", "moveahead"))
    assert not r.action_valid and r.actions_executed == 1 and "jump" in r.feedback
    assert truth(client, sid)["agent"]["yaw"] != truth(client, sid, 0)["agent"]["yaw"]
    # Names are matched loosely on case, spaces and underscores.
    r = client.step_one(sid, answer("Rotate Right", "ROTATE_LEFT"))
    assert r.action_valid and r.actions_executed == 2
    client.close_sessions([sid])


def test_directions_follow_the_pose_and_flip_after_turning_around(client):
    sid = client.open("navigation", 1, {"render_image": False}, "no_think")[0]
    client.reset_one(sid, seed=4)
    before = truth(client, sid)
    f, r = agent_frame_offsets(before)
    # The direction is VAGEN's sector of the angle between the heading and the target.
    angle = math.degrees(math.atan2(r, f))
    expected = "ahead" if abs(angle) <= 45 else "back" if abs(angle) > 135 else "right" if angle > 0 else "left"
    assert before["target_relative_direction"] == expected
    flip = {"ahead": "back", "back": "ahead", "left": "right", "right": "left"}
    res = client.step_one(sid, answer("rotateright", "rotateright"))
    assert res.action_valid and res.actions_executed == 2
    after = truth(client, sid)
    assert after["agent"]["position"] == before["agent"]["position"]
    assert (after["agent"]["yaw"] - before["agent"]["yaw"]) % 360 == pytest.approx(180)
    assert after["target_relative_direction"] == flip[before["target_relative_direction"]]
    assert after["distance_to_target"] == before["distance_to_target"]
    # One right turn: what was ahead is now on the left.
    client.step_one(sid, answer("rotateright"))
    quarter = truth(client, sid)
    assert (quarter["agent"]["yaw"] - before["agent"]["yaw"]) % 360 == pytest.approx(270)
    # Visible objects carry VAGEN's fields, nearest first.
    seen = quarter["visible_objects"] + after["visible_objects"] + before["visible_objects"]
    assert seen, "no object visible in three directions"
    for state in (before, after, quarter):
        dists = [v["distance"] for v in state["visible_objects"]]
        assert dists == sorted(dists) and len(dists) <= DEFAULTS["max_objects_in_state"]
        for v in state["visible_objects"]:
            assert set(v) == {"type", "distance", "relative_direction"}
    client.close_sessions([sid])


def test_image_changes_after_moveahead_and_not_after_a_blocked_move(client):
    sid = client.open("navigation", 1, {"image_size": 64, "max_turns": 100, "max_env_steps": 0}, "no_think")[0]
    first = client.reset_one(sid, seed=6)
    img0 = decode_image(first.observation.images[0])
    assert img0.shape == (64, 64, 3) and img0.std() > 5  # a scene, not a blank frame
    moved = None
    for _ in range(4):  # face a free direction
        r = client.step_one(sid, answer("moveahead"))
        if r.info["last_action_success"]:
            moved = r
            break
        client.step_one(sid, answer("rotateright"))
    assert moved is not None
    img1 = decode_image(moved.observation.images[0])
    assert np.abs(img1.astype(int) - img0.astype(int)).mean() > 1.0
    # Walking into the wall ends blocked: the frame stays as it was.
    r = moved
    for _ in range(40):
        if not r.info["last_action_success"] or r.done:
            break
        prev = decode_image(r.observation.images[0])
        r = client.step_one(sid, answer("moveahead"))
    if not r.done:  # (reaching the target on the way would end the episode first)
        assert r.info["last_action_success"] is False and "not executed successfully" in r.feedback
        assert np.array_equal(decode_image(r.observation.images[0]), prev)
    client.close_sessions([sid])


def test_first_frames_are_identical_across_server_processes(client):
    config = {"image_size": 96}
    frames = []
    with ServerProcess(["navigation"], workers=1, metrics=False, env_vars=NO_THOR) as other:
        with EnvClient(other.address) as c2:
            for c in (client, c2):
                sid = c.open("navigation", 1, config, "no_think")[0]
                seen = []
                for seed in (0, 8):
                    r = c.reset_one(sid, seed=seed)
                    seen.append((decode_image(r.observation.images[0]), r.anchor))
                r = c.step_one(sid, answer("rotateleft", "moveahead"))
                seen.append((decode_image(r.observation.images[0]), r.anchor))
                frames.append(seen)
                c.close_sessions([sid])
    for (a, anchor_a), (b, anchor_b) in zip(*frames):
        assert anchor_a == anchor_b and np.array_equal(a, b)
    # Different seeds are different rooms.
    assert not np.array_equal(frames[0][0][0], frames[0][1][0])


def test_spec_defaults(client):
    spec = client.get_spec("navigation")
    assert list(spec.modalities) == ["text", "image"] and spec.max_actions_per_turn == 5
    import json
    props = json.loads(spec.config_schema_json)["properties"]
    assert props["render_image"]["default"] is True
    assert props["backend"]["default"] == "miniworld"
    assert props["success_distance"]["default"] == 1.5 and props["step_length"]["default"] == 0.5
    assert props["success_reward"]["default"] == 10.0 and props["step_penalty"]["default"] == -0.1


def test_bad_config_is_invalid_argument(client):
    for bad in ({"backend": "habitat"}, {"step_length": 0.0}, {"min_horizon": 45.0}):
        with pytest.raises(EnvServeError) as e:
            client.open("navigation", 1, bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, bad


def test_ai2thor_without_a_build_fails_fast_with_a_clear_message(client, tmp_path):
    with pytest.raises(EnvServeError) as e:
        client.open("navigation", 1, {"backend": "ai2thor"})
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    message = str(e.value)
    assert "no AI2-THOR build" in message and "thor_local_executable_path" in message
    assert "AI2THOR_LOCAL_EXECUTABLE_PATH" in message and "download_only=True" in message
    # A build path is the operator's to allow: a caller's is refused, there or not, with the same
    # words (what an allowed path that is missing or not executable answers:
    # tests/unit/test_thor_backend.py).
    plain = tmp_path / "thor-Linux64-x"
    plain.write_text("not a build")
    os.chmod(plain, stat.S_IRUSR | stat.S_IWUSR)
    said = []
    for path in (str(tmp_path / "nope"), str(plain)):
        with pytest.raises(EnvServeError) as e:
            client.open("navigation", 1, {"backend": "ai2thor", "thor_local_executable_path": path})
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        said.append(e.value.message.replace(repr(path), "PATH"))
    assert said[0] == said[1] == "config.thor_local_executable_path: PATH is not one of ['']"
    # The worker is unharmed: the offline backend still opens.
    sid = client.open("navigation", 1, {"render_image": False})[0]
    assert client.reset_one(sid, seed=1).observation.text
    client.close_sessions([sid])
