"""The four VAGEN primitive-skill tasks as ManiSkill3 environments, built only from primitives.

Every task is a Panda arm on ManiSkill's table scene (TableSceneBuilder, assets in the wheel).
VAGEN's PutAppleInDrawer loads a PartNet-Mobility cabinet and the YCB apple, both downloads; here
the drawer is an articulation made of boxes (a fixed cabinet and a tray on a prismatic joint) and
the apple is a red sphere.

Coordinates are world metres: the table top is z = 0, the robot base stands at x = -0.615 facing +x.
Each task defines its objects, targets, instruction, workspace and its stage predicates (VAGEN's
subgoals); the envserve Environment (env.py) turns those into text, rewards and ground truth.
"""
from __future__ import annotations

import os

os.environ.setdefault("MS_SKIP_ASSET_DOWNLOAD_PROMPT", "1")

import numpy as np  # noqa: E402
import sapien  # noqa: E402
import torch  # noqa: E402
from mani_skill.envs.sapien_env import BaseEnv  # noqa: E402
from mani_skill.sensors.camera import CameraConfig  # noqa: E402
from mani_skill.utils import sapien_utils  # noqa: E402
from mani_skill.utils.building import actors  # noqa: E402
from mani_skill.utils.registration import register_env  # noqa: E402
from mani_skill.utils.scene_builder.table import TableSceneBuilder  # noqa: E402
from mani_skill.utils.structs.pose import Pose  # noqa: E402

from .spaces import DEFAULT_WORKSPACES_MM, Workspace  # noqa: E402

ROBOT_BASE = (-0.615, 0.0, 0.0)
CUBE_HALF = 0.02
# The camera stands in front of the robot looking back at it, so the viewer faces -x with -y on
# the left, as VAGEN's prompt tells the model.
CAMERA_EYE = (0.3, 0.0, 0.6)
CAMERA_TARGET = (-0.1, 0.0, 0.1)

RED = (1.0, 0.0, 0.0, 1.0)
GREEN = (0.0, 1.0, 0.0, 1.0)
PURPLE = (1.0, 0.0, 1.0, 1.0)
WOOD = (0.55, 0.38, 0.22, 1.0)
DARK = (0.2, 0.2, 0.2, 1.0)


def _sample_xy(rng: np.random.Generator, region, taken: list, min_dist: float, avoid=()) -> np.ndarray:
    """A point of the region at least min_dist from the taken points and outside the avoid discs."""
    (x0, x1), (y0, y1) = region
    for _ in range(1000):
        p = np.array([rng.uniform(x0, x1), rng.uniform(y0, y1)])
        if all(np.linalg.norm(p - q) >= min_dist for q in taken) and \
                all(np.linalg.norm(p - np.asarray(c)) >= r for c, r in avoid):
            taken.append(p)
            return p
    raise RuntimeError("could not place an object without overlap")


class PrimitiveTask(BaseEnv):
    """What the four tasks share: the Panda on the table, a render camera, objects by name."""

    SUPPORTED_ROBOTS = ["panda"]
    name = ""
    workspace: Workspace
    # Object names in the order of VAGEN's "object positions" list (targets included).
    position_order: tuple[str, ...] = ()

    def __init__(self, *args, robot_uids="panda", robot_init_qpos_noise=0.02, image_size=256,
                 workspace: Workspace | None = None, **kwargs):
        self.robot_init_qpos_noise = robot_init_qpos_noise
        self.workspace = workspace or Workspace.from_mm(DEFAULT_WORKSPACES_MM[self.name])
        self.image_size = int(image_size)
        self.objects: dict = {}
        self.targets: dict[str, np.ndarray] = {}
        super().__init__(*args, robot_uids=robot_uids, **kwargs)

    @property
    def _default_sensor_configs(self):
        # No agent cameras: observations are state only, images come from the render camera on demand.
        return []

    @property
    def _default_human_render_camera_configs(self):
        pose = sapien_utils.look_at(eye=list(CAMERA_EYE), target=list(CAMERA_TARGET))
        return CameraConfig("render_camera", pose, self.image_size, self.image_size, np.pi / 2, 0.01, 100)

    def _load_agent(self, options: dict):
        super()._load_agent(options, sapien.Pose(p=list(ROBOT_BASE)))

    def _load_scene(self, options: dict):
        self.table_scene = TableSceneBuilder(env=self, robot_init_qpos_noise=self.robot_init_qpos_noise)
        self.table_scene.build()
        self._build_objects()

    def _build_objects(self):
        raise NotImplementedError

    def _initialize_episode(self, env_idx: torch.Tensor, options: dict):
        self.table_scene.initialize(env_idx)
        # Our own generator from the episode seed: the layout depends on the seed only.
        rng = np.random.default_rng(int(self._episode_seed[0]))
        self._place_objects(rng)

    def _place_objects(self, rng: np.random.Generator):
        raise NotImplementedError

    def _spot(self) -> sapien.Pose:
        """A distinct build-time pose per object (ManiSkill warns when builders have none)."""
        self._spots = getattr(self, "_spots", 0) + 1
        return sapien.Pose(p=[0.3 + 0.1 * self._spots, 0.5, 0.05])

    @staticmethod
    def _set_actor(actor, xyz, yaw=0.0):
        q = [np.cos(yaw / 2), 0.0, 0.0, np.sin(yaw / 2)]
        actor.set_pose(Pose.create_from_pq(p=torch.tensor([list(map(float, xyz))]), q=torch.tensor([q])))

    # -- what the envserve env reads ----------------------------------------------------
    def instruction(self) -> str:
        raise NotImplementedError

    def positions(self) -> dict[str, np.ndarray]:
        """Every named position (objects and targets), world metres."""
        out = {name: actor.pose.p[0].cpu().numpy().astype(float) for name, actor in self.objects.items()}
        out.update({k: np.asarray(v, dtype=float) for k, v in self.target_positions().items()})
        return out

    def target_positions(self) -> dict[str, np.ndarray]:
        return dict(self.targets)

    def other_info(self) -> dict:
        return {}

    def grasped(self) -> dict[str, bool]:
        return {name: bool(self.agent.is_grasping(actor)[0]) for name, actor in self.objects.items()}

    def stages(self) -> list[bool]:
        """VAGEN's subgoal predicates now, in order; the last one is success."""
        raise NotImplementedError

    def relations(self) -> list[str]:
        return []

    def evaluate(self):
        # The envserve env evaluates stages itself after each skill; ManiSkill's per-step info
        # stays minimal so control steps stay cheap.
        return {"success": torch.zeros(1, dtype=torch.bool)}

    def compute_dense_reward(self, obs, action, info):
        return torch.zeros(1)

    def compute_normalized_dense_reward(self, obs, action, info):
        return torch.zeros(1)

    def _get_obs_extra(self, info):
        return {}


def _on_top(upper: np.ndarray, lower: np.ndarray) -> bool:
    return bool(np.linalg.norm(upper[:2] - lower[:2]) < CUBE_HALF and upper[2] > lower[2] + CUBE_HALF)


@register_env("EnvservePlaceTwoCube-v0", max_episode_steps=100_000)
class PlaceTwoCube(PrimitiveTask):
    name = "place"
    position_order = ("goalA", "goalB", "cubeA", "cubeB")
    goal_radius = 0.05
    goals = {"goalA": (0.1, 0.1, 0.0), "goalB": (-0.1, 0.1, 0.0)}

    def _build_objects(self):
        self.objects = {
            "cubeA": actors.build_cube(self.scene, half_size=CUBE_HALF, color=list(RED), name="cubeA", initial_pose=self._spot()),
            "cubeB": actors.build_cube(self.scene, half_size=CUBE_HALF, color=list(GREEN), name="cubeB", initial_pose=self._spot()),
        }
        self.goal_markers = {
            name: actors.build_red_white_target(self.scene, radius=self.goal_radius, thickness=1e-5, name=name,
                                                add_collision=False, body_type="kinematic",
                                                initial_pose=self._spot())
            for name in self.goals
        }

    def _place_objects(self, rng):
        self.targets = {k: np.array(v) for k, v in self.goals.items()}
        for name, marker in self.goal_markers.items():
            # The target disc lies flat: its cylinder axis (x) turned to point up.
            marker.set_pose(Pose.create_from_pq(p=torch.tensor([list(self.goals[name])]),
                                                q=torch.tensor([[np.cos(np.pi / 4), 0.0, np.sin(np.pi / 4), 0.0]])))
        taken: list = []
        # Unlike VAGEN, no cube starts inside a goal: every episode needs both moves.
        avoid = [(v[:2], self.goal_radius + 0.03) for v in self.goals.values()]
        region = (self.workspace.x, self.workspace.y)
        for name, actor in self.objects.items():
            xy = _sample_xy(rng, region, taken, 0.07, avoid)
            self._set_actor(actor, (xy[0], xy[1], CUBE_HALF), rng.uniform(0, np.pi / 2))

    def instruction(self):
        return "Please place cubeA (the red cube) at goalA and cubeB (the green cube) at goalB."

    def _in_goal(self, pos, goal):
        return bool(np.linalg.norm(pos[:2] - self.targets[goal][:2]) <= self.goal_radius)

    def other_info(self):
        return {"goal_radius": round(self.goal_radius * 1000)}

    def stages(self):
        p, g = self.positions(), self.grasped()
        a_in, b_in = self._in_goal(p["cubeA"], "goalA"), self._in_goal(p["cubeB"], "goalB")
        return [g["cubeA"],
                a_in and not g["cubeA"],
                a_in and g["cubeB"],
                a_in and b_in and not g["cubeA"] and not g["cubeB"]]

    def relations(self):
        p = self.positions()
        return [f"{c} is {'inside' if self._in_goal(p[c], goal) else 'outside'} {goal}"
                for c, goal in (("cubeA", "goalA"), ("cubeB", "goalB"))]


@register_env("EnvserveStackThreeCube-v0", max_episode_steps=100_000)
class StackThreeCube(PrimitiveTask):
    name = "stack"
    position_order = ("red_cube", "green_cube", "purple_cube")

    def _build_objects(self):
        self.objects = {
            name: actors.build_cube(self.scene, half_size=CUBE_HALF, color=list(color), name=name,
                                       initial_pose=self._spot())
            for name, color in (("red_cube", RED), ("green_cube", GREEN), ("purple_cube", PURPLE))
        }

    def _place_objects(self, rng):
        taken: list = []
        for actor in self.objects.values():
            xy = _sample_xy(rng, (self.workspace.x, self.workspace.y), taken, 0.07)
            self._set_actor(actor, (xy[0], xy[1], CUBE_HALF), rng.uniform(0, np.pi / 2))

    def instruction(self):
        return "Please stack the red cube on top of the green cube, and then stack the purple cube on top of the red cube."

    def other_info(self):
        return {"cube_size": (40, 40, 40)}

    def stages(self):
        p, g = self.positions(), self.grasped()
        red_on_green = _on_top(p["red_cube"], p["green_cube"])
        purple_on_red = _on_top(p["purple_cube"], p["red_cube"])
        return [g["red_cube"],
                red_on_green and not g["red_cube"],
                red_on_green and g["purple_cube"],
                red_on_green and purple_on_red and not any(g.values())]

    def relations(self):
        p = self.positions()
        out = []
        for a, b in (("red_cube", "green_cube"), ("purple_cube", "red_cube")):
            out.append(f"{a} is {'on' if _on_top(p[a], p[b]) else 'not on'} {b}")
        return out


@register_env("EnvserveAlignTwoCube-v0", max_episode_steps=100_000)
class AlignTwoCube(PrimitiveTask):
    name = "align"
    position_order = ("red_cube", "green_cube")
    x_tolerance = 0.01
    max_height = 0.05

    def _build_objects(self):
        self.objects = {
            "red_cube": actors.build_cube(self.scene, half_size=CUBE_HALF, color=list(RED), name="red_cube", initial_pose=self._spot()),
            "green_cube": actors.build_cube(self.scene, half_size=CUBE_HALF, color=list(GREEN), name="green_cube", initial_pose=self._spot()),
        }

    def _place_objects(self, rng):
        taken: list = []
        # As in VAGEN: red starts on the robot's side of x = 0, green on the far side.
        regions = {"red_cube": ((self.workspace.x[0], self.workspace.x[0] + 0.05), self.workspace.y),
                   "green_cube": ((0.05, self.workspace.x[1]), self.workspace.y)}
        for name, actor in self.objects.items():
            xy = _sample_xy(rng, regions[name], taken, 0.07)
            self._set_actor(actor, (xy[0], xy[1], CUBE_HALF), rng.uniform(0, np.pi / 2))

    def instruction(self):
        return ("Please align the cubes along the y-axis: the x-coordinates of both cubes should be 0 "
                f"(+-{round(self.x_tolerance * 1000)}mm), with both cubes on the table.")

    def _aligned(self, pos):
        return bool(abs(pos[0]) <= self.x_tolerance and pos[2] <= self.max_height)

    def stages(self):
        p = self.positions()
        red, green = self._aligned(p["red_cube"]), self._aligned(p["green_cube"])
        return [red, green, red and green]

    def relations(self):
        p = self.positions()
        return [f"{c} is {'aligned' if self._aligned(p[c]) else 'not aligned'} at x=0" for c in self.objects]


# Drawer geometry (metres). The cabinet stands at the robot's left (-y) with its opening facing +y;
# the tray slides out along +y on a prismatic joint.
CAB_CENTER = (0.0, -0.30)
CAB_HALF = (0.08, 0.07, 0.05)   # outer half extents x, y, z
TRAY_HALF_IN = (0.06, 0.06)     # inner half extents of the tray floor
TRAY_FLOOR_Z = 0.02             # top of the tray floor
DRAWER_TRAVEL = 0.15
APPLE_RADIUS = 0.025


@register_env("EnvservePutAppleInDrawer-v0", max_episode_steps=100_000)
class PutAppleInDrawer(PrimitiveTask):
    name = "drawer"
    position_order = ("apple", "drawer", "drawer_handle")
    initial_open = 0.14
    closed_below = 0.015

    def _build_objects(self):
        self.apple = actors.build_sphere(self.scene, radius=APPLE_RADIUS, color=list(RED), name="apple", initial_pose=self._spot())
        self.objects = {"apple": self.apple}
        self.drawer = self._build_drawer()
        self.drawer_joint = self.drawer.active_joints[0]

    def _build_drawer(self):
        wood = sapien.render.RenderMaterial(base_color=list(WOOD))
        dark = sapien.render.RenderMaterial(base_color=list(DARK))
        hx, hy, hz = CAB_HALF
        t = 0.005
        b = self.scene.create_articulation_builder()
        cabinet = b.create_link_builder()
        cabinet.set_name("cabinet")
        panels = [
            ((0, 0, t), (hx, hy, t)),                              # bottom
            ((0, 0, 2 * hz - t), (hx, hy, t)),                     # top
            ((-hx + t, 0, hz), (t, hy, hz)),                       # side at -x
            ((hx - t, 0, hz), (t, hy, hz)),                        # side at +x
            ((0, -hy + t, hz), (hx, t, hz)),                       # back
        ]
        for p, h in panels:
            cabinet.add_box_collision(sapien.Pose(p), h)
            cabinet.add_box_visual(sapien.Pose(p), h, material=wood)
        tray = b.create_link_builder(cabinet)
        tray.set_name("drawer")
        ix, iy = TRAY_HALF_IN
        wall_h = 0.03
        tray_parts = [
            ((0, 0, TRAY_FLOOR_Z - 0.004), (ix + t, iy + t, 0.004)),          # floor
            ((-ix - t / 2, 0, TRAY_FLOOR_Z + wall_h), (t / 2, iy, wall_h)),   # side walls
            ((ix + t / 2, 0, TRAY_FLOOR_Z + wall_h), (t / 2, iy, wall_h)),
            ((0, -iy - t / 2, TRAY_FLOOR_Z + wall_h), (ix + t, t / 2, wall_h)),  # back wall
            ((0, iy + t, hz), (hx - 2 * t, t, hz - 2 * t)),                  # front panel
        ]
        for p, h in tray_parts:
            tray.add_box_collision(sapien.Pose(p), h, density=300)
            tray.add_box_visual(sapien.Pose(p), h, material=wood)
        handle = ((0, iy + 2 * t + 0.01, hz), (0.03, 0.01, 0.008))
        tray.add_box_collision(sapien.Pose(handle[0]), handle[1], density=300)
        tray.add_box_visual(sapien.Pose(handle[0]), handle[1], material=dark)
        # The joint's x axis slides the tray along +y; closed at 0, so the front panel is flush.
        along_y = sapien.Pose([0, 0, 0], [np.cos(np.pi / 4), 0, 0, np.sin(np.pi / 4)])
        tray.set_joint_properties("prismatic", limits=[[0.0, DRAWER_TRAVEL]], pose_in_parent=along_y,
                                  pose_in_child=along_y, friction=0.2, damping=20.0)
        tray.set_joint_name("drawer_slide")
        b.initial_pose = sapien.Pose([CAB_CENTER[0], CAB_CENTER[1], 0.0])
        return b.build(name="cabinet", fix_root_link=True)

    def _place_objects(self, rng):
        self.drawer.set_pose(Pose.create_from_pq(p=torch.tensor([[CAB_CENTER[0], CAB_CENTER[1], 0.0]])))
        self.drawer.set_qpos(torch.tensor([[self.initial_open]]))
        self.drawer.set_qvel(torch.zeros((1, 1)))
        taken: list = []
        xy = _sample_xy(rng, ((-0.08, 0.10), (0.0, 0.15)), taken, 0.0)
        self._set_actor(self.apple, (xy[0], xy[1], APPLE_RADIUS))

    def opening(self) -> float:
        return float(self.drawer.get_qpos()[0, 0])

    def _tray_origin(self) -> np.ndarray:
        return np.array([CAB_CENTER[0], CAB_CENTER[1] + self.opening(), 0.0])

    def target_positions(self):
        o = self._tray_origin()
        return {
            # Where an object dropped into the tray comes to rest: the floor centre, one apple up.
            "drawer": o + np.array([0.0, 0.0, TRAY_FLOOR_Z + APPLE_RADIUS]),
            "drawer_handle": o + np.array([0.0, TRAY_HALF_IN[1] + 0.025, CAB_HALF[2]]),
        }

    def instruction(self):
        return "Please put the apple (the red ball) in the drawer and close the drawer."

    def other_info(self):
        return {"drawer_open_value": round(self.opening() * 1000)}

    def apple_in_drawer(self) -> bool:
        rel = self.positions()["apple"] - self._tray_origin()
        ix, iy = TRAY_HALF_IN
        return bool(abs(rel[0]) <= ix and abs(rel[1]) <= iy and TRAY_FLOOR_Z <= rel[2] <= TRAY_FLOOR_Z + 0.06)

    def stages(self):
        g = self.grasped()["apple"]
        inside = self.apple_in_drawer()
        return [g, inside and not g, inside and self.opening() <= self.closed_below and not g]

    def relations(self):
        return [f"apple is {'inside' if self.apple_in_drawer() else 'outside'} the drawer",
                f"the drawer is {'closed' if self.opening() <= self.closed_below else 'open'}"]


TASKS = {cls.name: cls for cls in (PlaceTwoCube, StackThreeCube, AlignTwoCube, PutAppleInDrawer)}
