"""The production backend: AI2-THOR through its real Controller API.

Providing a build. `ai2thor.controller.Controller()` downloads its Unity build on first use; where
that is impossible (air-gapped machines, CI) the service needs a build on disk:
1. On a machine with internet and the same ai2thor version (5.0.0), run
   `python -c "import ai2thor.controller as c; c.Controller(download_only=True)"`; the build lands in
   ~/.ai2thor/releases/thor-Linux64-<commit>/ (the executable is the `thor-Linux64-<commit>` file
   inside it). CloudRendering builds (`platform=CloudRendering`) land in thor-CloudRendering-<commit>/.
2. Copy that folder to the serving machine (or bake it into the image) and point the service at the
   executable: set AI2THOR_LOCAL_EXECUTABLE_PATH=/path/to/thor-Linux64-<commit>/thor-Linux64-<commit>
   in the server's environment, or pass config {"backend": "ai2thor", "thor_local_executable_path": ...}.
3. A Linux64 build needs an X display (Xvfb with GLX works; set DISPLAY or thor_x_display); a
   CloudRendering build needs Vulkan instead (thor_platform="CloudRendering").
Without a build path, or with one that is not an executable file, opening a session fails at once
with FAILED_PRECONDITION and this explanation, before any Controller (which would try to download)
is constructed.

Tasks. With thor_task_file, the seed picks a task of a VAGEN navigation dataset (scene, agent pose,
target type and position, instruction). Otherwise the seed picks a scene of thor_scenes, a target
object whose type occurs once in it, and a reachable start out of reach of the target.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
from typing import Any, Mapping

import numpy as np

from envserve.core.session import SessionError

from .env import Pose, SceneObject, Task
from .pool import WarmPool

ENV_VAR = "AI2THOR_LOCAL_EXECUTABLE_PATH"
HOWTO = ("Provide a build: download it where there is internet with "
         "`python -c \"import ai2thor.controller as c; c.Controller(download_only=True)\"` (ai2thor 5.0.0), "
         "copy ~/.ai2thor/releases/thor-Linux64-<commit>/ to this machine, and set "
         f"{ENV_VAR}=<that folder>/thor-Linux64-<commit> in the server's environment or the session config "
         "key thor_local_executable_path. Or use the offline backend: {\"backend\": \"miniworld\"}.")

# The AI2-THOR action for each of the task's actions, and the argument carrying its magnitude.
THOR_ACTIONS = {
    "moveahead": ("MoveAhead", "moveMagnitude"),
    "moveback": ("MoveBack", "moveMagnitude"),
    "moveright": ("MoveRight", "moveMagnitude"),
    "moveleft": ("MoveLeft", "moveMagnitude"),
    "rotateright": ("RotateRight", "degrees"),
    "rotateleft": ("RotateLeft", "degrees"),
    "lookup": ("LookUp", "degrees"),
    "lookdown": ("LookDown", "degrees"),
}
# Object types that are part of the room rather than something to walk to.
_NOT_TARGETS = {"Floor", "Wall", "Window", "Ceiling", "Door", "Doorway", "Doorframe", "LightSwitch",
                "ShowerDoor", "ShowerCurtain", "Curtains", "Blinds", "Poster", "Painting"}

# Idle controllers per worker process, keyed by the settings they were started with.
POOL = WarmPool("ai2thor")


class ThorUnavailable(SessionError):
    """No usable AI2-THOR build: the server, not the request, lacks something."""

    def __init__(self, message: str):
        super().__init__("FAILED_PRECONDITION", message)


def resolve_build_path(config: Mapping[str, Any]) -> str:
    """The executable to start: the config key, else the environment variable. Raises
    ThorUnavailable when none is set or it is not an executable file."""
    path = str(config.get("thor_local_executable_path") or "").strip() or os.environ.get(ENV_VAR, "").strip()
    if not path:
        raise ThorUnavailable(f"navigation backend 'ai2thor' has no AI2-THOR build: neither the config key "
                              f"thor_local_executable_path nor {ENV_VAR} is set, and the Unity build cannot be "
                              f"downloaded here. {HOWTO}")
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise ThorUnavailable(f"AI2-THOR build {path!r} does not exist. {HOWTO}")
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise ThorUnavailable(f"AI2-THOR build {path!r} is not an executable file (give the "
                              f"thor-Linux64-<commit> executable inside the release folder). {HOWTO}")
    return path


# AI2-THOR has a few hundred scenes: a caller's range must not expand to millions of names.
MAX_SCENES = 1000


def parse_scenes(spec: str) -> list[str]:
    """'FloorPlan1-3,FloorPlan201' -> ['FloorPlan1', 'FloorPlan2', 'FloorPlan3', 'FloorPlan201']."""
    scenes: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        m = re.fullmatch(r"([A-Za-z_]+)(\d+)-(\d+)", part)
        if m:
            lo, hi = int(m.group(2)), int(m.group(3))
            if hi < lo:
                raise ValueError(f"thor_scenes range {part!r} is empty")
            if len(scenes) + hi - lo + 1 > MAX_SCENES:
                raise ValueError(f"thor_scenes names more than {MAX_SCENES} scenes")
            scenes += [f"{m.group(1)}{i}" for i in range(lo, hi + 1)]
        else:
            scenes.append(part)
    if not scenes:
        raise ValueError("thor_scenes names no scene")
    return scenes


def load_task_file(path: str) -> list[dict]:
    try:
        with open(os.path.expanduser(path)) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"thor_task_file {path!r}: {e}") from None
    tasks = data.get("tasks") if isinstance(data, dict) else data
    if not isinstance(tasks, list) or not tasks:
        raise ValueError(f"thor_task_file {path!r} has no task list")
    for i, t in enumerate(tasks):
        missing = {"scene", "agentPose", "targetObjectType", "target_position"} - set(t)
        if missing:
            raise ValueError(f"thor_task_file task {i} lacks {sorted(missing)}")
    return tasks


def controller_settings(config: Mapping[str, Any], path: str) -> dict:
    """The Controller's keyword arguments for this config: also the warm pool's key."""
    settings = {
        "local_executable_path": path,
        "agentMode": "default",
        "gridSize": float(config["thor_grid_size"]),
        "visibilityDistance": float(config["visibility_distance"]),
        "width": int(config["thor_width"]),
        "height": int(config["thor_height"]),
        "fieldOfView": float(config["field_of_view"]),
        "renderDepthImage": False,
        "renderInstanceSegmentation": False,
        "server_timeout": float(config["thor_server_timeout"]),
    }
    if config["thor_x_display"]:
        settings["x_display"] = str(config["thor_x_display"])
    if config["thor_gpu_device"] >= 0:
        settings["gpu_device"] = int(config["thor_gpu_device"])
    return settings


def _make_controller(settings: dict, platform: str):
    from ai2thor.controller import Controller
    kwargs = dict(settings)
    if platform:
        from ai2thor.platform import CloudRendering
        kwargs["platform"] = CloudRendering
    return Controller(**kwargs)


def _controller_alive(controller) -> bool:
    pid = getattr(controller, "unity_pid", None)
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _stop_controller(controller) -> None:
    controller.stop()


class ThorBackend:
    # The Controller factory; a unit test replaces it with a test double.
    controller_factory = staticmethod(_make_controller)

    def __init__(self, config: Mapping[str, Any]):
        c = config
        platform = str(c["thor_platform"]).strip()
        self._scenes = parse_scenes(str(c["thor_scenes"]))
        self._tasks = load_task_file(c["thor_task_file"]) if c["thor_task_file"] else None
        # Fail fast, before a Controller exists: with no build it would try to download one.
        path = resolve_build_path(c)
        settings = controller_settings(c, path)
        self._key = (platform, tuple(sorted(settings.items())))
        self._pool_cap = int(c["thor_pool_size"])
        self._min_start = float(c["success_distance"]) + 1.0
        self._start_horizon = float(c["start_horizon"])
        self._healthy = True
        factory = type(self).controller_factory
        try:
            self.controller = POOL.acquire(self._key, lambda: factory(settings, platform),
                                           _controller_alive, _stop_controller)
        except SessionError:
            raise
        except Exception as e:
            raise ThorUnavailable(f"AI2-THOR did not start from {path!r}: {type(e).__name__}: {e}") from None
        self.event = None

    # -- the simulator calls -----------------------------------------------------------------------
    def _step(self, **kwargs):
        try:
            self.event = self.controller.step(**kwargs)
        except Exception as e:
            # A Unity process that died or hung loses this session; its controller is not reused.
            self._healthy = False
            raise SessionError("DATA_LOSS", f"AI2-THOR failed on {kwargs.get('action')}: {type(e).__name__}: {e}") from None
        return self.event

    def _reset_scene(self, scene: str):
        try:
            self.event = self.controller.reset(scene=scene)
        except Exception as e:
            self._healthy = False
            raise SessionError("DATA_LOSS", f"AI2-THOR could not load {scene}: {type(e).__name__}: {e}") from None

    def load_task(self, seed: int, options: dict) -> Task:
        if self._tasks is not None:
            return self._load_file_task(self._tasks[seed % len(self._tasks)])
        rng = random.Random(seed)
        scene = self._scenes[rng.randrange(len(self._scenes))]
        self._reset_scene(scene)
        objects = self.event.metadata["objects"]
        counts: dict[str, int] = {}
        for o in objects:
            counts[o["objectType"]] = counts.get(o["objectType"], 0) + 1
        candidates = sorted((o for o in objects if counts[o["objectType"]] == 1
                             and o["objectType"] not in _NOT_TARGETS), key=lambda o: o["objectId"])
        if not candidates:
            raise SessionError("FAILED_PRECONDITION", f"{scene} has no object of a unique type to navigate to")
        target = candidates[rng.randrange(len(candidates))]
        tx, tz = target["position"]["x"], target["position"]["z"]
        reachable = self._step(action="GetReachablePositions").metadata["actionReturn"] or []
        far = [p for p in reachable if math.hypot(p["x"] - tx, p["z"] - tz) > self._min_start] or reachable
        if not far:
            raise SessionError("FAILED_PRECONDITION", f"{scene} has no reachable position")
        far = sorted(far, key=lambda p: (p["x"], p["z"]))
        start = far[rng.randrange(len(far))]
        self._step(action="Teleport", position=start, rotation={"x": 0, "y": 90 * rng.randrange(4), "z": 0},
                   horizon=self._start_horizon, standing=True)
        return Task(scene=scene, target_type=target["objectType"], target_xz=None, target_id=target["objectId"])

    def _load_file_task(self, t: dict) -> Task:
        self._reset_scene(t["scene"])
        pose = t["agentPose"]
        self._step(action="Teleport", position={k: pose["position"][k] for k in ("x", "y", "z")},
                   rotation={"x": 0, "y": pose["rotation"], "z": 0}, horizon=pose.get("horizon", self._start_horizon),
                   standing=True)
        tp = t["target_position"]
        return Task(scene=t["scene"], target_type=t["targetObjectType"], target_xz=(tp["x"], tp["z"]),
                    instruction=str(t.get("instruction", "")))

    def act(self, name: str, amount: float) -> bool:
        action, arg = THOR_ACTIONS[name]
        event = self._step(action=action, **{arg: amount})
        return bool(event.metadata.get("lastActionSuccess", False))

    def pose(self) -> Pose:
        agent = self.event.metadata["agent"]
        p = agent["position"]
        return Pose(float(p["x"]), float(p["y"]), float(p["z"]), float(agent["rotation"]["y"]) % 360.0,
                    float(agent.get("cameraHorizon", 0.0)))

    def objects(self) -> list[SceneObject]:
        return [SceneObject(o["objectType"], float(o["position"]["x"]), float(o["position"]["z"]),
                            bool(o.get("visible", False)), o.get("objectId", ""))
                for o in self.event.metadata["objects"]]

    def frame(self, size: int) -> np.ndarray:
        frame = np.asarray(self.event.frame, dtype=np.uint8)
        if frame.shape[0] == size and frame.shape[1] == size:
            return np.ascontiguousarray(frame)
        from PIL import Image
        return np.asarray(Image.fromarray(frame).resize((size, size), Image.BILINEAR))

    def close(self) -> None:
        controller, self.controller = getattr(self, "controller", None), None
        if controller is not None:
            POOL.release(self._key, controller, self._pool_cap, self._healthy and _controller_alive(controller),
                         _stop_controller)
