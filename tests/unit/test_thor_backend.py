"""The AI2-THOR backend against a test double of ai2thor's Controller (the Unity build cannot run
here): action mapping, ground truth from THOR metadata (direction from yaw, distance), success,
the warm pool (reuse, cap, dead controllers dropped) and failing fast without a build."""
import os
import subprocess
import sys

import numpy as np
import pytest

from envserve.core import limits
from envserve.core.env import resolve_config
from envserve.core.session import SessionError, full_spec
from envserve.envs.navigation import thor_backend
from envserve.envs.navigation.env import DEFAULTS, NavigationEnv
from envserve.envs.navigation.thor_backend import POOL, ThorBackend, parse_scenes

SCENE_OBJECTS = [
    # objectType, position, the sofa is the only object of its type
    ("Sofa", {"x": 0.0, "y": 0.4, "z": 3.0}),
    ("Chair", {"x": 2.0, "y": 0.4, "z": 0.0}),
    ("Chair", {"x": -2.0, "y": 0.4, "z": 0.0}),
    ("Floor", {"x": 0.0, "y": 0.0, "z": 0.0}),
]


class FakeEvent:
    def __init__(self, metadata, frame):
        self.metadata = metadata
        self.frame = frame


class FakeThorController:
    """Test double of ai2thor.controller.Controller: a flat room where MoveAhead/Back/Left/Right,
    Rotate and Look change the agent's pose as AI2-THOR does (yaw 0 faces +z, RotateRight grows
    it, positive horizon looks down); objects are visible within 50 degrees of the heading."""

    instances = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls = []
        self.unity_pid = os.getpid()  # alive while this test runs
        self.stopped = False
        self.scene = None
        self.pos = {"x": 0.0, "y": 0.9, "z": 0.0}
        self.yaw, self.horizon = 0.0, 0.0
        self.last_success = True
        FakeThorController.instances.append(self)

    def reset(self, scene=None, **_):
        self.calls.append(("reset", scene))
        self.scene = scene
        self.last_success = True
        return self._event()

    def step(self, action=None, **args):
        self.calls.append((action, args))
        self.last_success = True
        ret = None
        if action == "GetReachablePositions":
            ret = [{"x": x * 0.5, "y": 0.9, "z": z * 0.5} for x in range(-4, 5) for z in range(-4, 1)]
        elif action == "Teleport":
            self.pos = dict(args["position"])
            self.yaw, self.horizon = float(args["rotation"]["y"]), float(args["horizon"])
        elif action in ("MoveAhead", "MoveBack", "MoveRight", "MoveLeft"):
            import math
            m = args["moveMagnitude"]
            heading = {"MoveAhead": 0, "MoveRight": 90, "MoveBack": 180, "MoveLeft": 270}[action]
            a = math.radians(self.yaw + heading)
            self.pos = {"x": self.pos["x"] + m * math.sin(a), "y": self.pos["y"], "z": self.pos["z"] + m * math.cos(a)}
        elif action in ("RotateRight", "RotateLeft"):
            self.yaw = (self.yaw + (1 if action == "RotateRight" else -1) * args["degrees"]) % 360
        elif action in ("LookUp", "LookDown"):
            h = self.horizon + (-1 if action == "LookUp" else 1) * args["degrees"]
            if -30 <= h <= 60:
                self.horizon = h
            else:
                self.last_success = False
        return self._event(ret)

    def _event(self, action_return=None):
        import math
        objects = []
        for i, (kind, p) in enumerate(SCENE_OBJECTS):
            ang = math.degrees(math.atan2(p["x"] - self.pos["x"], p["z"] - self.pos["z"])) - self.yaw
            ang = (ang + 180) % 360 - 180
            objects.append({"objectType": kind, "objectId": f"{kind}|{i}", "position": p,
                            "visible": abs(ang) <= 50 and kind != "Floor"})
        meta = {"agent": {"position": dict(self.pos), "rotation": {"x": 0.0, "y": self.yaw, "z": 0.0},
                          "cameraHorizon": self.horizon},
                "objects": objects, "lastActionSuccess": self.last_success, "actionReturn": action_return}
        w, h = self.kwargs.get("width", 300), self.kwargs.get("height", 300)
        frame = np.full((h, w, 3), int(self.yaw) % 256, dtype=np.uint8)
        return FakeEvent(meta, frame)

    def stop(self):
        self.stopped = True


@pytest.fixture
def fake_thor(monkeypatch, tmp_path):
    build = tmp_path / "thor-Linux64-test"
    build.write_text("#!/bin/sh\n")
    build.chmod(0o755)
    FakeThorController.instances = []
    monkeypatch.setattr(ThorBackend, "controller_factory",
                        staticmethod(lambda settings, platform: FakeThorController(**settings)))
    monkeypatch.delenv(thor_backend.ENV_VAR, raising=False)
    POOL.clear(lambda c: c.stop())
    # The build and the task files are in tmp_path: an operator's limits allow any path here (by
    # default only "" is allowed: core/limits.py).
    any_path = {"enum": None, "maxLength": 4096}
    limits.install({"navigation": {"thor_local_executable_path": any_path, "thor_task_file": any_path}})
    yield str(build)
    limits.install({})
    POOL.clear(lambda c: c.stop())


def make_env(**overrides) -> NavigationEnv:
    config = resolve_config(full_spec(NavigationEnv.spec), {"backend": "ai2thor", "render_image": False, **overrides})
    return NavigationEnv(config)


def test_actions_map_to_thor_actions_with_config_magnitudes(fake_thor):
    env = make_env(thor_local_executable_path=fake_thor, step_length=0.25, rotate_degrees=45.0)
    env.reset(0)
    ctrl = FakeThorController.instances[0]
    assert ctrl.kwargs["local_executable_path"] == fake_thor
    assert ctrl.kwargs["fieldOfView"] == DEFAULTS["field_of_view"] and ctrl.kwargs["width"] == 300
    ctrl.calls.clear()
    for name in ("moveahead", "moveback", "moveright", "moveleft", "rotateright", "rotateleft", "lookup", "lookdown"):
        assert env.step(name).valid
    assert ctrl.calls == [
        ("MoveAhead", {"moveMagnitude": 0.25}), ("MoveBack", {"moveMagnitude": 0.25}),
        ("MoveRight", {"moveMagnitude": 0.25}), ("MoveLeft", {"moveMagnitude": 0.25}),
        ("RotateRight", {"degrees": 45.0}), ("RotateLeft", {"degrees": 45.0}),
        ("LookUp", {"degrees": DEFAULTS["look_degrees"]}), ("LookDown", {"degrees": DEFAULTS["look_degrees"]}),
    ]
    bad = env.step("teleport")
    assert not bad.valid and "moveahead" in bad.feedback and len(ctrl.calls) == 8
    env.close()


def known_pose_tasks(tmp_path, yaw=0.0) -> str:
    """A task file (VAGEN's format) putting the agent at the origin facing `yaw`, target the sofa."""
    import json
    path = tmp_path / f"tasks-{yaw:g}.json"
    path.write_text(json.dumps({"tasks": [{
        "scene": "FloorPlan5", "targetObjectType": "Sofa", "target_position": {"x": 0.0, "y": 0.4, "z": 3.0},
        "agentPose": {"position": {"x": 0.0, "y": 0.9, "z": 0.0}, "rotation": yaw, "horizon": 30}}]}))
    return str(path)


def test_generated_task_targets_a_unique_type_out_of_reach(fake_thor):
    env = make_env(thor_local_executable_path=fake_thor, thor_scenes="FloorPlan7")
    env.reset(3)
    ctrl = FakeThorController.instances[0]
    assert ctrl.calls[0] == ("reset", "FloorPlan7")
    assert [c[0] for c in ctrl.calls[1:]] == ["GetReachablePositions", "Teleport"]
    # The target is the object whose type is unique (the sofa), never the floor.
    state = env.ground_truth().state
    assert state["target_obj_type"] == "Sofa" and state["scene"] == "FloorPlan7"
    assert "Navigate to the sofa" in env.render_text()
    assert state["distance_to_target"] > DEFAULTS["success_distance"] + 1.0 - 0.01
    assert state["agent"]["yaw"] in (0.0, 90.0, 180.0, 270.0) and state["agent"]["horizon"] == DEFAULTS["start_horizon"]
    # The same seed gives the same task.
    again = make_env(thor_local_executable_path=fake_thor, thor_scenes="FloorPlan7")
    again.reset(3)
    assert again.ground_truth().state == state
    env.close()
    again.close()


def test_ground_truth_directions_and_distances_from_metadata(fake_thor, tmp_path):
    env = make_env(thor_local_executable_path=fake_thor, thor_task_file=known_pose_tasks(tmp_path))
    env.reset(0)
    # At the origin facing +z the sofa (0, 3) is 3 m ahead; the chairs at x=+2 and x=-2 are
    # right and left of the agent, outside the view.
    s = env.ground_truth().state
    assert (s["target_relative_direction"], s["distance_to_target"]) == ("ahead", 3.0)
    assert s["visible_objects"] == [{"type": "Sofa", "distance": 3.0, "relative_direction": "ahead"}]
    assert s["agent"] == {"position": {"x": 0.0, "y": 0.9, "z": 0.0}, "yaw": 0.0, "horizon": 30.0}
    # Turning right by 90: the sofa is on the left, the right-hand chair ahead.
    env.step("rotateright")
    s = env.ground_truth().state
    assert s["target_relative_direction"] == "left" and s["agent"]["yaw"] == 90.0
    assert s["visible_objects"] == [{"type": "Chair", "distance": 2.0, "relative_direction": "ahead"}]
    env.step("rotateright")
    assert env.ground_truth().state["target_relative_direction"] == "back"
    env.step("rotateright")
    assert env.ground_truth().state["target_relative_direction"] == "right"
    assert "the Sofa (target) is right of the agent, 3.00 m away" in env.ground_truth().relations
    env.close()


def test_success_within_the_threshold_pays_the_success_reward(fake_thor, tmp_path):
    env = make_env(thor_local_executable_path=fake_thor, thor_task_file=known_pose_tasks(tmp_path))
    env.reset(0)
    first = env.step("moveahead")  # 2.5 m from the sofa
    assert first.valid and not first.done and first.components == {"step": DEFAULTS["step_penalty"]}
    assert first.info["distance"] == pytest.approx(2.5)
    env.step("moveahead")  # 2.0
    last = env.step("moveahead")  # 1.5: within the threshold
    assert last.done and last.success
    assert last.components == {"step": DEFAULTS["step_penalty"], "success": DEFAULTS["success_reward"]}
    assert env.ground_truth().state["status"] == "success"
    assert not env.step("moveahead").valid  # the episode is over
    # A failed THOR action counts as a step but is reported as not executed.
    env.reset(0)
    for _ in range(2):
        r = env.step("lookdown")  # 30 -> 60, then 90 is past THOR's limit
    assert r.valid and r.info["last_action_success"] is False and "not executed successfully" in r.feedback
    env.close()


def test_frames_come_from_the_event_resized_to_the_image_size(fake_thor):
    env = make_env(thor_local_executable_path=fake_thor, thor_width=64, thor_height=64)
    env.reset(1)
    assert env.render_image(64).shape == (64, 64, 3)
    assert env.render_image(32).shape == (32, 32, 3)
    env.close()


def test_task_file_in_vagen_format(fake_thor, tmp_path):
    import json
    tasks = {"tasks": [{"scene": "FloorPlan12", "instruction": "go to the sofa please",
                        "agentPose": {"position": {"x": 1.0, "y": 0.9, "z": -1.0}, "rotation": 270, "horizon": 0},
                        "targetObjectType": "Sofa", "target_position": {"x": 0.0, "y": 0.4, "z": 3.0}}]}
    path = tmp_path / "base.json"
    path.write_text(json.dumps(tasks))
    env = make_env(thor_local_executable_path=fake_thor, thor_task_file=str(path))
    env.reset(41)
    s = env.ground_truth().state
    assert s["scene"] == "FloorPlan12" and s["instruction"] == "go to the sofa please"
    assert s["agent"]["yaw"] == 270.0 and s["target_position"] == {"x": 0.0, "z": 3.0}
    env.close()
    path.write_text(json.dumps({"tasks": [{"scene": "FloorPlan1"}]}))
    with pytest.raises(ValueError, match="lacks"):
        make_env(thor_local_executable_path=fake_thor, thor_task_file=str(path))


def test_warm_pool_reuses_caps_and_drops_dead_controllers(fake_thor):
    created = POOL.created
    a = make_env(thor_local_executable_path=fake_thor, thor_pool_size=1)
    b = make_env(thor_local_executable_path=fake_thor, thor_pool_size=1)
    ctrl_a, ctrl_b = a._backend.controller, b._backend.controller
    assert ctrl_a is not ctrl_b and POOL.created == created + 2
    a.close()
    b.close()  # the pool keeps one idle controller: the second is stopped
    assert not ctrl_a.stopped and ctrl_b.stopped
    c = make_env(thor_local_executable_path=fake_thor, thor_pool_size=1)
    assert c._backend.controller is ctrl_a and POOL.created == created + 2
    # Other settings, another controller.
    d = make_env(thor_local_executable_path=fake_thor, thor_width=128)
    ctrl_d = d._backend.controller
    assert ctrl_d is not ctrl_a and ctrl_d.kwargs["width"] == 128
    d.close()
    assert not ctrl_d.stopped and POOL.idle_count() == 1
    # The cap counts every setting's idle controllers: c's goes in, the oldest (d's) is stopped,
    # so a caller trying setting after setting cannot pile up Unity processes.
    c.close()
    assert ctrl_d.stopped and not ctrl_a.stopped and POOL.idle_count() == 1
    # A controller whose Unity process died is not reused.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ctrl_a.unity_pid = dead.pid
    e = make_env(thor_local_executable_path=fake_thor, thor_pool_size=1)
    assert e._backend.controller is not ctrl_a and ctrl_a.stopped
    e.close()


def test_a_failing_controller_loses_the_session_and_is_not_pooled(fake_thor):
    env = make_env(thor_local_executable_path=fake_thor)
    env.reset(0)
    ctrl = env._backend.controller

    def broken(**_):
        raise TimeoutError("unity hung")
    ctrl.step = broken
    with pytest.raises(SessionError) as e:
        env.step("moveahead")
    assert e.value.code == "DATA_LOSS" and "unity hung" in e.value.message
    env.close()
    assert ctrl.stopped and POOL.idle_count() == 0


def test_no_build_fails_before_any_controller_exists(fake_thor, monkeypatch, tmp_path):
    with pytest.raises(SessionError) as e:
        make_env()
    assert e.value.code == "FAILED_PRECONDITION" and "AI2THOR_LOCAL_EXECUTABLE_PATH" in e.value.message
    with pytest.raises(SessionError, match="does not exist"):
        make_env(thor_local_executable_path=str(tmp_path / "missing"))
    # The environment variable is read when the config leaves the path empty.
    monkeypatch.setenv(thor_backend.ENV_VAR, str(tmp_path))
    with pytest.raises(SessionError, match="not an executable"):
        make_env()
    assert FakeThorController.instances == []
    monkeypatch.setenv(thor_backend.ENV_VAR, fake_thor)
    make_env().close()
    assert len(FakeThorController.instances) == 1


def test_scene_lists():
    assert parse_scenes("FloorPlan1-3, FloorPlan201") == ["FloorPlan1", "FloorPlan2", "FloorPlan3", "FloorPlan201"]
    assert len(parse_scenes(DEFAULTS["thor_scenes"])) == 120
    with pytest.raises(ValueError):
        parse_scenes(" , ")
