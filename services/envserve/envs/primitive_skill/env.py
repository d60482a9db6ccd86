"""primitive_skill: VAGEN's pick / place / push tasks on a simulated Panda arm (ManiSkill3 + SAPIEN).

The agent answers with up to two skills per turn, e.g. `pick(62,-55,20)|place(75,33,50)`, in
millimetres. Each skill is executed by closed-loop motion of the simulated arm (skills.py); the
tasks (tasks.py) are ManiSkill environments built from primitives. The observation is the
instruction, the workspace limits and VAGEN's object-position list, plus a third-person image
rendered only when asked for.
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping

from envserve.core.env import REWARD_BOUNDS, ActionOutcome, Environment, EnvSpec, GroundTruth, seeded_splits

from .spaces import DEFAULT_WORKSPACES_MM, TASK_NAMES, Workspace, parse_workspace_mm

# Before ManiSkill is imported anywhere in this process: never prompt on stdin for assets.
os.environ.setdefault("MS_SKIP_ASSET_DOWNLOAD_PROMPT", "1")

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_ACTION = re.compile(r"^\s*(pick|place|push)\s*\(\s*(" + _NUMBER + r"(?:\s*,\s*" + _NUMBER + r")*)\s*,?\s*\)\s*$",
                     re.IGNORECASE)
_ARITY = {"pick": 3, "place": 3, "push": 6}
_USAGE = "Valid actions: pick(x,y,z), place(x,y,z), push(x1,y1,z1,x2,y2,z2), coordinates in millimetres."
# ManiSkill seeds numpy RandomState, which takes seeds below 2**32.
_SEED_MOD = 2 ** 31

SYSTEM_PROMPT = """You are controlling a Franka Emika Panda robot arm on a table. Follow the human instruction using the image of the scene and the object positions you are given.

Actions:
1. pick(x, y, z): move the open gripper to position (x, y, z), close it and lift whatever it grasped.
2. place(x, y, z): carry what the gripper holds to position (x, y, z) and open the gripper there.
3. push(x1, y1, z1, x2, y2, z2): with the gripper closed, go down at (x1, y1, z1) and move in a straight line to (x2, y2, z2), pushing whatever is in the way.

Hints:
1. Coordinates are in millimetres (integers) in the table frame; the table top is z = 0.
2. Every coordinate must lie inside the workspace limits given with each observation; an action outside them is invalid and nothing moves.
3. A position is the centre of an object. When placing, allow for the object's size: it is fine to place higher than needed, the object drops from there.
4. The object positions come as a list without names: match them to the objects in the image yourself. In the image you face the negative x-axis: the negative y-axis is on your left, the positive y-axis on your right, and z points up.
5. The arm really moves: a grasp can miss, and a moving arm can knock other objects.

Rewards (defaults): -0.1 per executed action, (stage + 1) x 2 the first time a subgoal stage is reached, +10 when the task is done."""


# SAPIEN drops its Vulkan context with the last render system, and the next env recompiles its
# shaders (about 6 s on lavapipe): the worker keeps the first render system for its lifetime.
_RENDER_KEEPALIVE: list = []


def _keep_render_context(sim) -> None:
    if not _RENDER_KEEPALIVE:
        _RENDER_KEEPALIVE.append(sim.scene.sub_scenes[0].render_system)


class PrimitiveSkillEnv(Environment):
    spec = EnvSpec(
        env_id="primitive_skill",
        description=("VAGEN's primitive-skill manipulation: pick/place/push in millimetres on a simulated Panda arm "
                     "(ManiSkill3 + SAPIEN), tasks align, place, stack and drawer built from primitives."),
        system_prompt=SYSTEM_PROMPT,
        action_space="pick(x,y,z) | place(x,y,z) | push(x1,y1,z1,x2,y2,z2), integers in millimetres",
        # VAGEN's skill wrapper ends an episode after 10 skills; at 1 skill a turn that is 10 turns.
        max_turns=10,
        max_actions_per_turn=2,
        modalities=("text", "image"),
        difficulty_keys=("task", "robot_init_qpos_noise"),
        config_defaults={
            "task": "align",
            "render_image": True,
            # VAGEN's AlignTwoCube render camera is 300 x 300.
            "image_size": 300,
            # The actions contain commas, so VAGEN separates them with '|'.
            "action_separator": "|",
            "success_reward": 10.0,
            "stage_reward": 2.0,
            "step_penalty": -0.1,
            "max_skills": 10,
            "clip_to_workspace": False,
            "robot_init_qpos_noise": 0.02,
            **{f"workspace_{name}": ",".join(map(str, DEFAULT_WORKSPACES_MM[name])) for name in TASK_NAMES},
        },
        config_bounds={
            "task": {"enum": [*TASK_NAMES, "random"]},
            # Each skill runs the arm's controller for up to a few hundred physics steps: a turn's
            # work is bounded by its skills (VAGEN: 10 an episode).
            "max_actions_per_turn": {"maximum": 10},
            "success_reward": REWARD_BOUNDS,
            "stage_reward": REWARD_BOUNDS,
            "step_penalty": REWARD_BOUNDS,
            "max_skills": {"minimum": 0, "maximum": 100},
            "robot_init_qpos_noise": {"minimum": 0.0, "maximum": 0.5},
            **{f"workspace_{name}": {"maxLength": 128, "pattern": "^[-0-9., ]*$"} for name in TASK_NAMES},
        },
        config_docs={
            "task": f"one of {', '.join(TASK_NAMES)}, or 'random' (the seed chooses the task)",
            "success_reward": "reward when the task is done (the episode ends with success)",
            "stage_reward": "a subgoal stage s reached for the first time in the episode pays (s + 1) x this",
            "step_penalty": "reward of every executed skill",
            "max_skills": "the episode ends (no success) after this many executed skills; 0 = no limit (VAGEN: 10)",
            "clip_to_workspace": "clip out-of-workspace coordinates into the workspace as VAGEN does, instead of "
                                 "rejecting the action as invalid",
            "robot_init_qpos_noise": "std of the seeded noise on the arm's initial joint angles (radians)",
            **{f"workspace_{name}": f"workspace limits of the {name} task, 'x0,x1,y0,y1,z0,z1' in mm"
               for name in TASK_NAMES},
        },
        splits=seeded_splits("random object layouts"),
        default_action_format="free_think",
        # The simulator state lives in PhysX; forks replay (seed, actions), which is deterministic.
        supports_snapshot=False,
        # SAPIEN's scene and its Vulkan renderer are not left part way through a call.
        interruptible=False,
    )

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        c = self.config
        task = str(c["task"])
        self._workspaces = {name: Workspace.from_mm(parse_workspace_mm(str(c[f"workspace_{name}"])))
                            for name in TASK_NAMES}
        self._task_choice = task
        self._r_success = float(c["success_reward"])
        self._r_stage = float(c["stage_reward"])
        self._r_step = float(c["step_penalty"])
        self._max_skills = int(c["max_skills"])
        self._clip = bool(c["clip_to_workspace"])
        self._sims: dict[str, Any] = {}
        self._sim = None
        self._runner = None
        self._task = ""
        self._seed: int | None = None
        self._reset_episode_fields()

    def _reset_episode_fields(self):
        self._best_stage = -1
        self._skills = 0
        self._done = False
        self._success = False
        self._truth_cache = None

    # -- setup --------------------------------------------------------------------------
    def _get_sim(self, task: str):
        """One ManiSkill env per task, built on first use and kept for later episodes."""
        if task not in self._sims:
            from .skills import SkillRunner
            from .tasks import TASKS
            sim = TASKS[task](obs_mode="state", control_mode="pd_ee_pose", render_mode="rgb_array",
                              sim_backend="cpu", image_size=int(self.config["image_size"]),
                              robot_init_qpos_noise=float(self.config["robot_init_qpos_noise"]),
                              workspace=self._workspaces[task])
            self._sims[task] = (sim, SkillRunner(sim))
            _keep_render_context(sim)
        return self._sims[task]

    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        self._seed = int(seed) if seed is not None else 0
        task = self._task_choice
        if task == "random":
            task = TASK_NAMES[self._seed % len(TASK_NAMES)]
        self._task = task
        self._sim, self._runner = self._get_sim(task)
        # Rebuilding the PhysX scene each episode makes an episode independent of the ones before
        # it in this instance, so a replayed fork in a fresh process steps exactly alike.
        self._sim.reset(seed=self._seed % _SEED_MOD, options={"reconfigure": True})
        self._runner.reset()
        self._reset_episode_fields()

    # -- the step -----------------------------------------------------------------------
    def _parse(self, action: str):
        if not isinstance(action, str):
            return None, f"Invalid action {action!r}. {_USAGE}"
        m = _ACTION.match(action)
        if not m:
            return None, f"Invalid action {action.strip()[:200]!r}. {_USAGE}"
        name = m.group(1).lower()
        values = [float(v) for v in m.group(2).split(",")]
        if len(values) != _ARITY[name]:
            return None, f"Invalid action {action.strip()!r}: {name} takes {_ARITY[name]} coordinates, got {len(values)}."
        ws = self._sim.workspace
        points = [values[i:i + 3] for i in range(0, len(values), 3)]
        metres = []
        for p in points:
            m_p = [v / 1000.0 for v in p]
            if not ws.contains(m_p):
                if not self._clip:
                    (x0, x1), (y0, y1), (z0, z1) = ws.mm()
                    return None, (f"Invalid action {action.strip()!r}: ({', '.join(f'{v:g}' for v in p)}) is outside "
                                  f"the workspace x in [{x0}, {x1}], y in [{y0}, {y1}], z in [{z0}, {z1}] (mm).")
                m_p = ws.clip(m_p)
            metres.append(m_p)
        return (name, metres), ""

    def step(self, action: str) -> ActionOutcome:
        if self._sim is None:
            return ActionOutcome(valid=False, feedback="The environment has not been reset.")
        if self._done:
            return ActionOutcome(valid=False, feedback="The episode is over; reset the environment.")
        parsed, error = self._parse(action)
        if parsed is None:
            return ActionOutcome(valid=False, feedback=error)
        name, points = parsed
        if name == "pick":
            self._runner.pick(points[0])
        elif name == "place":
            self._runner.place(points[0])
        else:
            self._runner.push(points[0], points[1])
        self._skills += 1
        self._truth_cache = None
        components = {"step": self._r_step}
        stages = self._sim.stages()
        feedback = ""
        if stages[-1]:
            self._done = self._success = True
            components["success"] = self._r_success
            feedback = "The task is complete."
        else:
            reached = max((i for i, ok in enumerate(stages[:-1]) if ok), default=-1)
            if reached > self._best_stage:
                components["stage"] = (reached + 1) * self._r_stage
                self._best_stage = reached
            if self._max_skills and self._skills >= self._max_skills:
                self._done = True
                feedback = f"The episode ended after {self._skills} actions without completing the task."
        return ActionOutcome(reward=sum(components.values()), done=self._done, success=self._success,
                             feedback=feedback, components=components,
                             info={"skill": name, "control_steps": self._runner.control_steps})

    # -- observations -------------------------------------------------------------------
    def _positions_mm(self) -> dict[str, list[int]]:
        return {k: [int(round(v * 1000)) for v in p] for k, p in self._sim.positions().items()}

    def render_text(self) -> str:
        sim = self._sim
        pos = self._positions_mm()
        listed = [tuple(pos[name]) for name in sim.position_order]
        x, y, z = sim.workspace.mm()
        return (f"Human Instruction: {sim.instruction()}\n"
                f"x_workspace_limit: {x}\n"
                f"y_workspace_limit: {y}\n"
                f"z_workspace_limit: {z}\n"
                f"Object positions: \n{listed}\n"
                f"Other information:\n{sim.other_info()}\n"
                f"Decide your next action(s).")

    def ground_truth(self) -> GroundTruth:
        if self._truth_cache is not None:
            return self._truth_cache
        sim = self._sim
        pos = self._positions_mm()
        grasped = sim.grasped()
        holding = [name for name, g in grasped.items() if g]
        stages = sim.stages()
        current = max((i for i, ok in enumerate(stages[:-1]) if ok), default=-1)
        tcp = [int(round(v * 1000)) for v in self._runner.tcp()]
        x, y, z = sim.workspace.mm()
        state = {
            "task": self._task,
            "instruction": sim.instruction(),
            "objects": {name: pos[name] for name in sim.objects},
            "targets": {name: pos[name] for name in sim.target_positions()},
            "position_order": list(sim.position_order),
            "gripper": {"position": tcp, "closed": self._runner.gripper < 0,
                        "holding": holding[0] if holding else None},
            "stage": len(stages) - 1 if stages[-1] else current,
            "best_stage": self._best_stage,
            "num_stages": len(stages) - 1,
            "success": bool(stages[-1]),
            "skills_executed": self._skills,
            "workspace": {"x": list(x), "y": list(y), "z": list(z)},
            "other": {k: list(v) if isinstance(v, tuple) else v for k, v in sim.other_info().items()},
        }
        relations = list(sim.relations())
        relations.append(f"the gripper holds {holding[0]}" if holding else "the gripper holds nothing")
        self._truth_cache = GroundTruth(state, relations)
        return self._truth_cache

    def valid_actions(self) -> list[str]:
        """Concrete legal actions: pick each object where it is; with something in hand, place it
        on each target and on top of each other object; and one push."""
        if self._done or self._sim is None:
            return []
        sim = self._sim
        ws = sim.workspace
        pos = self._positions_mm()
        out: list[str] = []
        truth = self.ground_truth().state
        held = truth["gripper"]["holding"]

        def add(name, *points):
            flat = [int(v) for p in points for v in p]
            if all(ws.contains([v / 1000.0 for v in p]) for p in points):
                out.append(f"{name}({','.join(map(str, flat))})")

        if held:
            for name in sim.target_positions():
                p = pos[name]
                add("place", (p[0], p[1], p[2] + 30))
            for name in sim.objects:
                if name != held:
                    p = pos[name]
                    add("place", (p[0], p[1], p[2] + 45))
        for name in sim.objects:
            add("pick", pos[name])
        first = pos[next(iter(sim.objects))]
        add("push", (first[0] - 40, first[1], first[2]), (first[0] + 10, first[1], first[2]))
        return out

    def render_image(self, size: int):
        import numpy as np
        image = self._sim.render()[0].cpu().numpy().astype(np.uint8)
        if image.shape[0] != size:
            from PIL import Image
            image = np.asarray(Image.fromarray(image).resize((size, size), Image.BILINEAR))
        return image

    def close(self) -> None:
        for sim, _ in self._sims.values():
            sim.close()
        self._sims.clear()
        self._sim = self._runner = None
