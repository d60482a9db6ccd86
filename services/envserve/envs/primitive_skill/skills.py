"""pick / place / push executed by real motion of the Panda arm.

ManiSkill 3.0.1's wheel has no motion-planning package, so each skill is a short sequence of
straight-line end-effector waypoints tracked in closed loop with the arm's `pd_ee_pose`
controller (inverse kinematics each control step) and the gripper's joint controller. Objects only
move when the simulated fingers or the gripper body touch them: nothing is teleported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

GRIPPER_OPEN, GRIPPER_CLOSED = 1.0, -1.0


@dataclass(frozen=True)
class MotionLimits:
    # Largest end-effector move per control step (20 Hz): 0.3 m/s.
    step_len: float = 0.015
    # Slower for the pushing stroke, so a pushed object is not flung.
    push_step_len: float = 0.008
    # A waypoint counts as reached within this distance of the tool centre point.
    tolerance: float = 0.004
    # Control steps allowed to settle at a waypoint after the interpolation.
    settle_steps: int = 25
    # Control steps for the fingers to close or open.
    gripper_steps: int = 12
    # The gripper travels between waypoints at least this high above the table.
    travel_height: float = 0.12
    # ... and this much above the highest target of the move.
    clearance: float = 0.07
    # The tool centre point never goes lower than this (the fingertips would hit the table).
    min_tcp_height: float = 0.012
    # pick aligns the fingers with an object whose centre lies this close to the pick point.
    align_radius: float = 0.03


def _yaw_of(q: np.ndarray) -> float:
    """The rotation about z of a (w, x, y, z) quaternion of an upright object."""
    w, x, y, z = q
    return math.atan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z))


class SkillRunner:
    def __init__(self, env, limits: MotionLimits = MotionLimits()):
        self.env = env
        self.limits = limits
        self.base = np.asarray(env.agent.robot.pose.p[0].cpu().numpy(), dtype=float)
        self.reset()

    def reset(self) -> None:
        self.base = np.asarray(self.env.agent.robot.pose.p[0].cpu().numpy(), dtype=float)
        self.yaw = 0.0
        self.gripper = GRIPPER_OPEN
        self.control_steps = 0

    # -- low level ---------------------------------------------------------------------
    def tcp(self) -> np.ndarray:
        return self.env.agent.tcp.pose.p[0].cpu().numpy().astype(float)

    def _command(self, target: np.ndarray) -> None:
        p = target - self.base
        # Fingers down (pi about x), turned about the vertical by the chosen yaw.
        action = np.array([p[0], p[1], p[2], math.pi, 0.0, self.yaw, self.gripper], dtype=np.float32)
        self.env.step(torch.from_numpy(action)[None])
        self.control_steps += 1

    def _move(self, target, step_len: float | None = None) -> None:
        target = np.asarray(target, dtype=float).copy()
        target[2] = max(target[2], self.limits.min_tcp_height)
        start = self.tcp()
        step = step_len or self.limits.step_len
        n = max(1, int(math.ceil(np.linalg.norm(target - start) / step)))
        for k in range(1, n + 1):
            self._command(start + (target - start) * (k / n))
        for _ in range(self.limits.settle_steps):
            if np.linalg.norm(self.tcp() - target) <= self.limits.tolerance:
                break
            self._command(target)

    def _grip(self, value: float) -> None:
        self.gripper = value
        hold = self.tcp()
        for _ in range(self.limits.gripper_steps):
            self._command(hold)

    def _travel_height(self, *zs: float) -> float:
        return max(self.limits.travel_height, *(z + self.limits.clearance for z in zs))

    def _go_over(self, xyz: np.ndarray, height: float) -> None:
        """Rise to the travel height, cross over, stop above xyz."""
        here = self.tcp()
        if here[2] < height - self.limits.tolerance:
            self._move([here[0], here[1], height])
        self._move([xyz[0], xyz[1], height])

    def _grasp_yaw(self, xyz: np.ndarray) -> float:
        """Align the fingers with the faces of an object centred at the pick point, as a grasp
        planner reading the object's pose would; keep the current yaw when there is none."""
        best, best_d = None, self.limits.align_radius
        for actor in self.env.objects.values():
            p = actor.pose.p[0].cpu().numpy()
            d = float(np.linalg.norm(p[:2] - xyz[:2]))
            if d <= best_d:
                best, best_d = actor, d
        if best is None:
            return self.yaw
        yaw = _yaw_of(best.pose.q[0].cpu().numpy())
        # A box looks the same every quarter turn: the smallest wrist turn that matches it.
        return -((yaw + math.pi / 4) % (math.pi / 2) - math.pi / 4)

    # -- the skills --------------------------------------------------------------------
    def pick(self, xyz) -> None:
        xyz = np.asarray(xyz, dtype=float)
        height = self._travel_height(xyz[2])
        self._go_over(xyz, height)
        self.yaw = self._grasp_yaw(xyz)
        self._grip(GRIPPER_OPEN)
        self._move(xyz)
        self._grip(GRIPPER_CLOSED)
        self._move([xyz[0], xyz[1], height])

    def place(self, xyz) -> None:
        xyz = np.asarray(xyz, dtype=float)
        height = self._travel_height(xyz[2], self.tcp()[2] - self.limits.clearance)
        self._go_over(xyz, height)
        self._move(xyz)
        self._grip(GRIPPER_OPEN)
        self._move([xyz[0], xyz[1], height])

    def push(self, start, end) -> None:
        start, end = np.asarray(start, dtype=float), np.asarray(end, dtype=float)
        height = self._travel_height(start[2], end[2])
        self._go_over(start, height)
        # A closed hand is a blunt pusher; the fingers stay aligned with the stroke.
        stroke = end[:2] - start[:2]
        if np.linalg.norm(stroke) > 1e-6:
            self.yaw = -((math.atan2(stroke[1], stroke[0]) + math.pi / 2) % math.pi - math.pi / 2)
        self._grip(GRIPPER_CLOSED)
        self._move(start)
        self._move(end, step_len=self.limits.push_step_len)
        self._move([end[0], end[1], height])
