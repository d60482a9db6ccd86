"""Navigation (VAGEN's embodied navigation task): follow an instruction to reach a target object
from a first-person view.

The task logic lives here and only here: the instruction, the eight actions and their magnitudes,
step and success rewards, the success test, and the ground truth (target type, distance and
direction from the agent's yaw, visible objects) in VAGEN's format. A backend only supplies the
simulator: it builds a task's scene, executes a primitive action, and reports the agent's pose,
the objects (with visibility) and a camera frame. Two backends are chosen by config:
- "ai2thor" (production): the real AI2-THOR Controller; needs a Unity build on disk
  (thor_backend.py says how to provide one).
- "miniworld" (default, offline): Farama MiniWorld rooms with named mesh objects, rendered
  headless through EGL, so the task runs and is tested on any machine.

Poses use one frame for both backends (AI2-THOR's): x and z on the floor, yaw in degrees with 0
facing +z and growing when turning right, horizon in degrees with positive looking down.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from envserve.core.env import (REWARD_BOUNDS, SERVER_PATH_BOUNDS, ActionOutcome, Environment, EnvSpec, GroundTruth,
                               seeded_splits)

ACTIONS = ("moveahead", "moveback", "moveright", "moveleft", "rotateright", "rotateleft", "lookup", "lookdown")
BACKENDS = ("miniworld", "ai2thor")
_INVALID = "Invalid action {!r}. Valid actions: " + ", ".join(ACTIONS) + "."
_NORMALIZE = re.compile(r"[\s_\-]+")

# VAGEN (vagen/env/navigation: env_config.py, env.py, prompt.py): 0.5 m moves, 90 degree turns,
# 30 degree camera tilts, success within 1.5 m, +10 on success, -0.1 per action, format reward
# 0.5, up to 5 actions per turn, an episode capped at 30 actions, 5 objects in the state,
# field of view 100, visibility distance 10 m, 300 px frames.
DEFAULTS: dict[str, Any] = {
    "backend": "miniworld",
    "success_distance": 1.5,
    "step_length": 0.5,
    "rotate_degrees": 90.0,
    "look_degrees": 30.0,
    "start_horizon": 30.0,
    "min_horizon": -30.0,
    "max_horizon": 60.0,
    "field_of_view": 100.0,
    "visibility_distance": 10.0,
    "success_reward": 10.0,
    "step_penalty": -0.1,
    "max_env_steps": 30,
    "max_objects_in_state": 5,
    "instruction_template": "Navigate to the {target} in the room and get as close to it as you can.",
    "describe_in_text": False,
    # Offline backend.
    "miniworld_num_objects": 5,
    "miniworld_min_room": 6.0,
    "miniworld_max_room": 10.0,
    "miniworld_pool_size": 8,
    # AI2-THOR backend.
    "thor_local_executable_path": "",
    "thor_scenes": "FloorPlan1-30,FloorPlan201-230,FloorPlan301-330,FloorPlan401-430",
    "thor_task_file": "",
    "thor_width": 300,
    "thor_height": 300,
    "thor_grid_size": 0.1,
    "thor_platform": "",
    "thor_x_display": "",
    "thor_gpu_device": -1,
    "thor_server_timeout": 300.0,
    "thor_pool_size": 4,
}

_HORIZON = {"minimum": -90.0, "maximum": 90.0}
BOUNDS: dict[str, dict[str, Any]] = {
    "backend": {"enum": list(BACKENDS)},
    "success_distance": {"exclusiveMinimum": 0.0, "maximum": 30.0},
    "step_length": {"exclusiveMinimum": 0.0, "maximum": 5.0},
    "rotate_degrees": {"exclusiveMinimum": 0.0, "maximum": 360.0},
    "look_degrees": {"exclusiveMinimum": 0.0, "maximum": 90.0},
    # Ordered min_horizon <= start_horizon <= max_horizon as well (the env's own check).
    "start_horizon": _HORIZON, "min_horizon": _HORIZON, "max_horizon": _HORIZON,
    "field_of_view": {"exclusiveMinimum": 0.0, "exclusiveMaximum": 180.0},
    "visibility_distance": {"exclusiveMinimum": 0.0, "maximum": 100.0},
    "success_reward": REWARD_BOUNDS,
    "step_penalty": REWARD_BOUNDS,
    "max_env_steps": {"minimum": 0, "maximum": 10_000},
    "max_objects_in_state": {"minimum": 0, "maximum": 100},
    "instruction_template": {"maxLength": 512},
    "miniworld_num_objects": {"minimum": 0, "maximum": 20},
    # MiniWorld rooms' sides (m); min <= max as well (the backend's check).
    "miniworld_min_room": {"minimum": 3.0, "maximum": 30.0},
    "miniworld_max_room": {"minimum": 3.0, "maximum": 30.0},
    # Idle simulators a worker keeps (each a GL context or a Unity process): a caller may keep fewer.
    "miniworld_pool_size": {"minimum": 0, "maximum": DEFAULTS["miniworld_pool_size"]},
    "thor_pool_size": {"minimum": 0, "maximum": DEFAULTS["thor_pool_size"]},
    # The Unity build and the task list are files on the server, the X display a server of the
    # machine's: the operator's allow-list only.
    "thor_local_executable_path": SERVER_PATH_BOUNDS,
    "thor_task_file": SERVER_PATH_BOUNDS,
    "thor_x_display": SERVER_PATH_BOUNDS,
    # Scene names and ranges (at most 1,000 scenes: thor_backend.parse_scenes).
    "thor_scenes": {"maxLength": 1024, "pattern": "^[A-Za-z0-9_, -]*$"},
    # Unity renders every frame at this size: as the session's image_size.
    "thor_width": {"minimum": 16, "maximum": 1024},
    "thor_height": {"minimum": 16, "maximum": 1024},
    "thor_grid_size": {"minimum": 0.01, "maximum": 1.0},
    "thor_platform": {"enum": ["", "CloudRendering"]},
    "thor_gpu_device": {"minimum": -1, "maximum": 15},
    # How long a step may wait for Unity: a caller may wait less, never more.
    "thor_server_timeout": {"exclusiveMinimum": 0.0, "maximum": DEFAULTS["thor_server_timeout"]},
}

DOCS = {
    "backend": "simulator: 'miniworld' (offline MiniWorld rooms, default) or 'ai2thor' (needs a Unity build)",
    "success_distance": "success when the agent is within this floor distance (m) of the target",
    "step_length": "metres moved by moveahead, moveback, moveright, moveleft",
    "rotate_degrees": "degrees turned by rotateright, rotateleft",
    "look_degrees": "degrees the camera tilts for lookup, lookdown",
    "start_horizon": "camera tilt at the start of an episode, degrees below level (generated tasks)",
    "min_horizon": "highest camera tilt (degrees, negative looks up); lookup beyond it fails",
    "max_horizon": "lowest camera tilt (degrees below level); lookdown beyond it fails",
    "field_of_view": "camera field of view in degrees",
    "visibility_distance": "objects farther than this (m) are never listed as visible",
    "success_reward": "reward for reaching the target (episode ends, success)",
    "step_penalty": "reward of every executed action",
    "max_env_steps": "actions per episode before it ends in failure (0: no cap; VAGEN uses 30)",
    "max_objects_in_state": "visible objects listed in the ground truth, nearest first",
    "instruction_template": "the instruction; {target} is replaced by the target's name",
    "describe_in_text": "also state the target's direction and distance and the visible objects in the text observation (for text-only agents)",
    "miniworld_num_objects": "objects in a MiniWorld room besides the target",
    "miniworld_min_room": "smallest side of a MiniWorld room (m)",
    "miniworld_max_room": "largest side of a MiniWorld room (m)",
    "miniworld_pool_size": "idle MiniWorld instances a worker keeps for reuse",
    "thor_local_executable_path": "AI2-THOR Unity build (the executable); empty: the AI2THOR_LOCAL_EXECUTABLE_PATH environment variable",
    "thor_scenes": "AI2-THOR scenes the seeds draw from: names and ranges, e.g. 'FloorPlan1-30,FloorPlan201'",
    "thor_task_file": "a JSON task list in VAGEN's navigation dataset format ({'tasks': [{scene, agentPose, targetObjectType, target_position, instruction}]}), e.g. VAGEN's base or common_sense eval sets; the seed picks task seed mod count",
    "thor_width": "AI2-THOR frame width (px)",
    "thor_height": "AI2-THOR frame height (px)",
    "thor_grid_size": "AI2-THOR gridSize (m)",
    "thor_platform": "'' (Linux64 build on an X display) or 'CloudRendering' (Vulkan, no X)",
    "thor_x_display": "X display for the Linux64 build, e.g. '0' or '0.0' (empty: $DISPLAY)",
    "thor_gpu_device": "GPU index for CloudRendering (-1: default)",
    "thor_server_timeout": "seconds AI2-THOR waits for its Unity process per step",
    "thor_pool_size": "idle AI2-THOR controllers a worker keeps for reuse",
}

SYSTEM_PROMPT = """You are a home robot and perform navigation tasks according to instructions.
Each observation is an image of what you see in front of you and the instruction naming a target object.
Actions you can take: moveahead, moveback, moveright, moveleft, rotateright, rotateleft, lookup, lookdown.
moveahead: move forward by 0.5 meter
moveback: move backward by 0.5 meter
moveright: move rightward by 0.5 meter
moveleft: move leftward by 0.5 meter
rotateright: rotate to the right by 90 degrees
rotateleft: rotate to the left by 90 degrees
lookup: tilt the camera upward by 30 degrees
lookdown: tilt the camera downward by 30 degrees
A move into a wall or an object is not executed.
Goal: get within 1.5 meters of the target object named in the instruction.
Rewards (defaults): +10 for reaching the target (the episode ends), -0.1 per action.
Hints: if the target is not in view, rotate to look around. Describe where the target is relative to you with the same words as the actions (ahead, left, right, back)."""


@dataclass(frozen=True)
class Pose:
    x: float
    y: float
    z: float
    yaw: float       # degrees, 0 faces +z, grows turning right
    horizon: float   # degrees, positive looks down


@dataclass(frozen=True)
class SceneObject:
    object_type: str
    x: float
    z: float
    visible: bool
    object_id: str = ""


@dataclass
class Task:
    scene: str
    target_type: str
    # The target's floor position, or None to read it from the object `target_id` every step.
    target_xz: tuple[float, float] | None
    target_id: str = ""
    instruction: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# -- geometry shared by both backends -------------------------------------------------------
def relative_angle(pose: Pose, x: float, z: float) -> float:
    """Angle of (x, z) from the agent's heading in degrees, in (-180, 180], positive to the right."""
    angle = math.degrees(math.atan2(x - pose.x, z - pose.z))
    rel = (angle - pose.yaw) % 360.0
    return rel - 360.0 if rel > 180.0 else rel


def direction_name(angle: float) -> str:
    """VAGEN's four sectors: ahead within 45 degrees of the heading, then right, left, back."""
    if -45.0 <= angle <= 45.0:
        return "ahead"
    if 45.0 < angle <= 135.0:
        return "right"
    if -135.0 <= angle < -45.0:
        return "left"
    return "back"


def floor_distance(pose: Pose, x: float, z: float) -> float:
    return math.hypot(x - pose.x, z - pose.z)


def display_name(object_type: str) -> str:
    """'OfficeChair' -> 'office chair', for instructions."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", object_type).lower()


def normalize_action(action: Any) -> str | None:
    """'Move Ahead', 'move_ahead', 'MOVEAHEAD' -> 'moveahead'; None when it is not an action."""
    if not isinstance(action, str):
        return None
    name = _NORMALIZE.sub("", action.strip().lower())
    return name if name in ACTIONS else None


def action_amount(config: Mapping[str, Any], name: str) -> float:
    if name.startswith("move"):
        return float(config["step_length"])
    if name.startswith("rotate"):
        return float(config["rotate_degrees"])
    return float(config["look_degrees"])


class NavigationEnv(Environment):
    spec = EnvSpec(
        env_id="navigation",
        description="VAGEN embodied navigation: reach the object named in the instruction from a first-person "
                    "view. Backends: AI2-THOR (production, needs a Unity build) or MiniWorld (offline, default).",
        system_prompt=SYSTEM_PROMPT,
        action_space=", ".join(ACTIONS),
        # VAGEN: up to 5 actions per turn and 30 actions per episode; 10 turns leave room for
        # turns that are partly invalid.
        max_turns=10,
        max_actions_per_turn=5,
        modalities=("text", "image"),
        config_defaults={**DEFAULTS, "render_image": True, "format_reward": 0.5},
        difficulty_keys=("backend", "success_distance", "max_env_steps", "miniworld_num_objects",
                         "miniworld_min_room", "miniworld_max_room"),
        config_docs=DOCS,
        config_bounds=BOUNDS,
        splits=seeded_splits("generated navigation tasks (AI2-THOR with thor_task_file: task seed mod count)"),
        default_action_format="free_think",
        # The simulators hold GL contexts and Unity processes: forks replay (seed, actions).
        supports_snapshot=False,
        # A call stopped part way could leave THOR's socket or a GL context out of step.
        interruptible=False,
    )

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        c = self.config
        backend = str(c["backend"])
        if not float(c["min_horizon"]) <= float(c["start_horizon"]) <= float(c["max_horizon"]):
            raise ValueError("need min_horizon <= start_horizon <= max_horizon")
        try:
            c["instruction_template"].format(target="x")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"instruction_template may only use {{target}}: {e}") from None
        self.backend_name = backend
        if backend == "miniworld":
            from .miniworld_backend import MiniWorldBackend
            self._backend = MiniWorldBackend(c)
        else:
            from .thor_backend import ThorBackend
            self._backend = ThorBackend(c)
        self._task: Task | None = None
        self._steps = 0
        self._done = False
        self._success = False
        self._truth: GroundTruth | None = None

    # -- the five methods -----------------------------------------------------------------
    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        self._task = self._backend.load_task(int(seed), dict(options or {}))
        if not self._task.instruction:
            self._task.instruction = self.config["instruction_template"].format(
                target=display_name(self._task.target_type))
        self._steps = 0
        self._done = self._success = False
        self._truth = None

    def step(self, action: str) -> ActionOutcome:
        name = normalize_action(action)
        if name is None:
            return ActionOutcome(valid=False, feedback=_INVALID.format(action))
        if self._task is None or self._done:
            return ActionOutcome(valid=False, feedback="The episode is over; reset the environment.")
        executed = self._backend.act(name, action_amount(self.config, name))
        self._steps += 1
        self._truth = None
        c = self.config
        components = {"step": float(c["step_penalty"])}
        distance = self.target_distance()
        notes = [] if executed else [f"Last action {name} is not executed successfully."]
        if distance <= float(c["success_distance"]):
            self._done = self._success = True
            components["success"] = float(c["success_reward"])
            notes.append("Success: you reached the target.")
        elif int(c["max_env_steps"]) and self._steps >= int(c["max_env_steps"]):
            self._done = True
            notes.append(f"The episode ended after {self._steps} actions without reaching the target.")
        return ActionOutcome(reward=sum(components.values()), done=self._done, success=self._success,
                             feedback=" ".join(notes), components=components,
                             info={"last_action_success": executed, "distance": round(distance, 3),
                                   "env_steps": self._steps})

    def render_text(self) -> str:
        lines = [f"Human Instruction: {self._task.instruction}" if self._task else "No task; reset the environment."]
        if self.config["describe_in_text"] and self._task:
            s = self.ground_truth().state
            where = {"ahead": "ahead of you", "back": "behind you", "left": "to your left",
                     "right": "to your right"}[s["target_relative_direction"]]
            lines.append(f"The {s['target_obj_type']} is {s['distance_to_target']:.2f} m away, {where}.")
            seen = ", ".join(f"{o['type']} ({o['relative_direction']}, {o['distance']:.2f} m)"
                             for o in s["visible_objects"])
            lines.append(f"Visible objects: {seen or 'none'}.")
        return "\n".join(lines)

    def ground_truth(self) -> GroundTruth:
        if self._truth is None:
            self._truth = self._compute_truth()
        return self._truth

    def close(self) -> None:
        backend, self._backend = getattr(self, "_backend", None), None
        if backend is not None:
            backend.close()

    # -- optional -------------------------------------------------------------------------
    def valid_actions(self) -> list[str]:
        return [] if self._done else list(ACTIONS)

    def render_image(self, size: int):
        return self._backend.frame(int(size))

    # -- shared task logic --------------------------------------------------------------------
    def target_xz(self) -> tuple[float, float]:
        task = self._task
        if task.target_xz is not None:
            return task.target_xz
        for o in self._backend.objects():
            if o.object_id == task.target_id:
                return (o.x, o.z)
        raise RuntimeError(f"target {task.target_id} is not in the scene")

    def target_distance(self) -> float:
        return floor_distance(self._backend.pose(), *self.target_xz())

    def _compute_truth(self) -> GroundTruth:
        task = self._task
        if task is None:
            return GroundTruth({"status": "not reset"})
        pose = self._backend.pose()
        tx, tz = self.target_xz()
        distance = floor_distance(pose, tx, tz)
        direction = direction_name(relative_angle(pose, tx, tz))
        limit = float(self.config["visibility_distance"])
        visible = []
        for o in self._backend.objects():
            if not o.visible:
                continue
            d = floor_distance(pose, o.x, o.z)
            if d > limit:
                continue
            visible.append({"type": o.object_type, "distance": round(d, 2),
                            "relative_direction": direction_name(relative_angle(pose, o.x, o.z))})
        visible.sort(key=lambda v: (v["distance"], v["type"]))
        visible = visible[: int(self.config["max_objects_in_state"])]
        state = {
            # VAGEN's ground-truth keys.
            "target_obj_type": task.target_type,
            "target_obj_distance": round(distance, 4),
            "distance_to_target": round(distance, 2),
            "target_relative_direction": direction,
            "visible_objects": visible,
            # Beyond VAGEN: the pose and the task, for judges and debugging.
            "instruction": task.instruction,
            "scene": task.scene,
            "backend": self.backend_name,
            "agent": {"position": {"x": round(pose.x, 4), "y": round(pose.y, 4), "z": round(pose.z, 4)},
                      "yaw": round(pose.yaw % 360.0, 3), "horizon": round(pose.horizon, 3)},
            "target_position": {"x": round(tx, 4), "z": round(tz, 4)},
            "status": "success" if self._success else "failed" if self._done else "navigating",
        }
        relations = [f"the {task.target_type} (target) is {direction} of the agent, {distance:.2f} m away"]
        relations += [f"the {v['type']} is {v['relative_direction']} of the agent, {v['distance']:.2f} m away"
                      for v in visible]
        return GroundTruth(state, relations)
