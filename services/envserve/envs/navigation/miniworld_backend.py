"""The offline backend: Farama MiniWorld (a real 3D first-person simulator on OpenGL).

A task seed builds one rectangular room (size and wall, floor and ceiling textures drawn from the
seed), a target object whose type appears once, other objects of other types, and the agent
facing one of four directions. Everything is drawn from the env's seeded RNG, so the same seed
gives the same scene and the same frames in any process.

MiniWorld facts this module relies on (see BUILD-NOTES):
- headless rendering needs PYGLET_HEADLESS=1 before pyglet is first imported;
- MiniWorld compiles the static scene into GL display list 1, shared by every env in a process,
  so each world here allocates and uses its own list;
- with a level camera an object right in front of the agent is below the frame, so the camera
  starts tilted down (start_horizon).
Steps call MiniWorld's own move_agent/turn_agent (its collision checks) without rendering; a frame
is rendered only when an image is asked for.
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping

import numpy as np

from .env import Pose, SceneObject, Task
from .pool import WarmPool

if "pyglet" not in __import__("sys").modules:
    os.environ["PYGLET_HEADLESS"] = "1"
import pyglet  # noqa: E402

if not pyglet.options.get("headless"):
    raise ImportError("pyglet was imported without PYGLET_HEADLESS=1 before envserve's navigation env; "
                      "set PYGLET_HEADLESS=1 in the server's environment")

from miniworld.entity import COLOR_NAMES, Ball, Box, Key, MeshEnt  # noqa: E402
from miniworld.miniworld import MiniWorldEnv  # noqa: E402
from miniworld.opengl import FrameBuffer  # noqa: E402
from pyglet import gl  # noqa: E402

# Object types and how to build them: the meshes and shapes shipped in the miniworld wheel. Sizes keep
# every radius under 0.5 m, so an agent (radius 0.4) can always stop within 1.5 m with 0.5 m steps.
OBJECT_TYPES: dict[str, Any] = {
    "Barrel": lambda rng: MeshEnt("barrel", 1.0),
    "Cone": lambda rng: MeshEnt("cone", 0.7),
    "Duckie": lambda rng: MeshEnt("duckie", 0.6),
    "Medkit": lambda rng: MeshEnt("medkit", 0.45),
    "OfficeChair": lambda rng: MeshEnt("office_chair", 1.0),
    "Potion": lambda rng: MeshEnt("potion", 0.5),
    "Tree": lambda rng: MeshEnt("tree_pine", 1.2),
    "Box": lambda rng: Box(color=COLOR_NAMES[int(rng.integers(len(COLOR_NAMES)))], size=0.7),
    "Ball": lambda rng: Ball(color=COLOR_NAMES[int(rng.integers(len(COLOR_NAMES)))], size=0.6),
    "Key": lambda rng: Key(color=COLOR_NAMES[int(rng.integers(len(COLOR_NAMES)))]),
}
# Textures of 512 px or less: a 1024 px one takes over a second to load (mipmaps on the CPU).
WALL_TEXTURES = ("concrete", "drywall", "stucco", "marble", "wood")
FLOOR_TEXTURES = ("floor_tiles_bw", "wood", "asphalt", "marble", "cardboard")
CEILING_TEXTURES = ("ceiling_tiles", "white", "concrete")

# Idle worlds per process, keyed by frame size (the world's frame buffer is built for it).
POOL = WarmPool("miniworld")


class NavigationWorld(MiniWorldEnv):
    """A MiniWorld env whose world is planned by `plan` (set before each reset)."""

    def __init__(self, frame_size: int):
        self._list_id = None
        self._rendering = False
        self.plan: dict[str, Any] | None = None
        self.named: list[tuple[str, Any]] = []
        self.target = None
        self.frame_size = frame_size
        # The window buffer is unused (never shown): keep it tiny.
        super().__init__(max_episode_steps=1 << 30, obs_width=frame_size, obs_height=frame_size,
                         window_width=8, window_height=8)
        self._buffers = {frame_size: self.obs_fb}
        _preload_assets()

    # -- world generation ----------------------------------------------------------------------
    def _gen_world(self):
        plan = self.plan or {"num_objects": 0, "min_room": 4.0, "max_room": 4.0, "min_start_distance": 0.0}
        rng = self.np_random
        sx = _half_metres(rng.uniform(plan["min_room"], plan["max_room"]))
        sz = _half_metres(rng.uniform(plan["min_room"], plan["max_room"]))
        self.add_rect_room(
            min_x=0, max_x=sx, min_z=0, max_z=sz,
            wall_tex=WALL_TEXTURES[int(rng.integers(len(WALL_TEXTURES)))],
            floor_tex=FLOOR_TEXTURES[int(rng.integers(len(FLOOR_TEXTURES)))],
            ceil_tex=CEILING_TEXTURES[int(rng.integers(len(CEILING_TEXTURES)))],
        )
        types = sorted(OBJECT_TYPES)
        target_type = types[int(rng.integers(len(types)))]
        others = [t for t in types if t != target_type]
        self.named = []
        self.target = self._place(target_type, rng)
        for _ in range(int(plan["num_objects"])):
            self._place(others[int(rng.integers(len(others)))], rng)
        # The agent faces one of four directions and starts out of reach of the target.
        for _ in range(200):
            self.place_agent(dir=float(rng.integers(4)) * math.pi / 2)
            if _dist_xz(self.agent.pos, self.target.pos) > plan["min_start_distance"]:
                break
            self.entities.remove(self.agent)

    def _place(self, object_type: str, rng):
        ent = self.place_entity(OBJECT_TYPES[object_type](rng))
        self.named.append((object_type, ent))
        return ent

    # -- rendering: a display list of our own ----------------------------------------------------
    def _render_static(self):
        # MiniWorld's own version compiles into the fixed list 1, which every world of the process
        # shares; this one compiles the same scene (light, rooms, static entities) into its own.
        self.shadow_window.switch_to()
        if self._list_id is None:
            self._list_id = gl.glGenLists(1)
        gl.glNewList(self._list_id, gl.GL_COMPILE)
        gl.glLightfv(gl.GL_LIGHT0, gl.GL_POSITION, (gl.GLfloat * 4)(*self.light_pos, 1))
        gl.glLightfv(gl.GL_LIGHT0, gl.GL_AMBIENT, (gl.GLfloat * 4)(*self.light_ambient))
        gl.glLightfv(gl.GL_LIGHT0, gl.GL_DIFFUSE, (gl.GLfloat * 4)(*self.light_color))
        gl.glEnable(gl.GL_LIGHTING)
        gl.glEnable(gl.GL_LIGHT0)
        gl.glShadeModel(gl.GL_SMOOTH)
        gl.glEnable(gl.GL_COLOR_MATERIAL)
        gl.glColorMaterial(gl.GL_FRONT_AND_BACK, gl.GL_AMBIENT_AND_DIFFUSE)
        gl.glEnable(gl.GL_TEXTURE_2D)
        for room in self.rooms:
            room._render()
        for ent in self.entities:
            if ent.is_static:
                ent.render()
        gl.glEndList()

    def _render_world(self, frame_buffer, render_agent):
        gl.glCallList(self._list_id)
        for ent in self.entities:
            if not ent.is_static and ent is not self.agent:
                ent.render()
        return frame_buffer.resolve()

    def render_obs(self, frame_buffer=None):
        # MiniWorld renders on every reset; frames are drawn only when asked for.
        if not self._rendering:
            return None
        return super().render_obs(frame_buffer)

    def frame(self, size: int) -> np.ndarray:
        fb = self._buffers.get(size)
        if fb is None:
            self.shadow_window.switch_to()
            fb = self._buffers[size] = FrameBuffer(size, size, 8)
        self._rendering = True
        try:
            return np.ascontiguousarray(self.render_obs(fb))
        finally:
            self._rendering = False


_ASSETS_LOADED = False


def _preload_assets() -> None:
    """Loads every texture and mesh a task can use (cached per process by MiniWorld), so the first
    world of a process pays for them instead of the first reset that meets each one."""
    global _ASSETS_LOADED
    if _ASSETS_LOADED:
        return
    from miniworld.opengl import Texture
    for name in {*WALL_TEXTURES, *FLOOR_TEXTURES, *CEILING_TEXTURES}:
        Texture.get(name)
    rng = np.random.default_rng(0)
    for make in OBJECT_TYPES.values():
        make(rng)
    for color in COLOR_NAMES:  # one mesh file per color
        Ball(color)
        Key(color)
    _ASSETS_LOADED = True


def _half_metres(v: float) -> float:
    return round(v * 2) / 2


def _dist_xz(a, b) -> float:
    return math.hypot(float(a[0]) - float(b[0]), float(a[2]) - float(b[2]))


class MiniWorldBackend:
    def __init__(self, config: Mapping[str, Any]):
        c = config
        self._num_objects = int(c["miniworld_num_objects"])
        self._min_room, self._max_room = float(c["miniworld_min_room"]), float(c["miniworld_max_room"])
        if self._min_room > self._max_room:  # each within [3, 30]: the config schema (env.py)
            raise ValueError("need miniworld_min_room <= miniworld_max_room")
        self._min_start = float(c["success_distance"]) + 1.0
        self._fov = float(c["field_of_view"])
        self._start_pitch = -float(c["start_horizon"])
        self._min_pitch, self._max_pitch = -float(c["max_horizon"]), -float(c["min_horizon"])
        self._pool_cap = int(c["miniworld_pool_size"])
        self._key = int(c["image_size"])
        self.world: NavigationWorld = POOL.acquire(self._key, lambda: NavigationWorld(self._key),
                                                   _world_alive, _close_world)
        self._objects: list[SceneObject] | None = None

    def load_task(self, seed: int, options: dict) -> Task:
        w = self.world
        w.plan = {"num_objects": self._num_objects, "min_room": self._min_room, "max_room": self._max_room,
                  "min_start_distance": self._min_start}
        # gymnasium seeds must be non-negative.
        w.reset(seed=seed % (2 ** 63))
        a = w.agent
        # MiniWorld's reset samples camera parameters after building the world: set ours after it.
        a.cam_fov_y = self._fov
        a.cam_pitch = self._start_pitch
        a.cam_fwd_disp = 0.0
        self._objects = None
        target_type = next(t for t, e in w.named if e is w.target)
        return Task(scene=f"miniworld-room-{w.max_x:g}x{w.max_z:g}", target_type=target_type,
                    target_xz=(float(w.target.pos[0]), -float(w.target.pos[2])))

    def act(self, name: str, amount: float) -> bool:
        w, a = self.world, self.world.agent
        self._objects = None
        if name == "moveahead":
            return bool(w.move_agent(amount, 0.0))
        if name == "moveback":
            return bool(w.move_agent(-amount, 0.0))
        if name == "moveright":
            return bool(w.move_agent(0.0, amount))
        if name == "moveleft":
            return bool(w.move_agent(0.0, -amount))
        if name == "rotateright":
            return bool(w.turn_agent(-amount))
        if name == "rotateleft":
            return bool(w.turn_agent(amount))
        pitch = a.cam_pitch + (amount if name == "lookup" else -amount)
        if not self._min_pitch - 1e-6 <= pitch <= self._max_pitch + 1e-6:
            return False
        a.cam_pitch = pitch
        return True

    def pose(self) -> Pose:
        a = self.world.agent
        # MiniWorld: forward is (cos d, -sin d) in (x, z) and turning left grows d. Mirroring z
        # gives the AI2-THOR frame, where yaw 0 faces +z and turning right grows yaw.
        yaw = (90.0 - math.degrees(a.dir)) % 360.0
        return Pose(float(a.pos[0]), float(a.pos[1]), -float(a.pos[2]), round(yaw, 6), -float(a.cam_pitch))

    def objects(self) -> list[SceneObject]:
        if self._objects is None:
            w = self.world
            view = _View(w.agent, self._fov)
            self._objects = [SceneObject(t, float(e.pos[0]), -float(e.pos[2]), view.sees(e), f"{t}|{i}")
                             for i, (t, e) in enumerate(w.named)]
        return self._objects

    def frame(self, size: int) -> np.ndarray:
        return self.world.frame(size)

    def close(self) -> None:
        world, self.world = self.world, None
        if world is not None:
            POOL.release(self._key, world, self._pool_cap, True, _close_world)


class _View:
    """The camera's view frustum: an object is visible when a point of its axis is inside it.
    The room is convex, so walls never hide an object; objects hiding each other is ignored."""

    def __init__(self, agent, fov_degrees: float):
        self.eye = np.asarray(agent.cam_pos, dtype=float)
        self.fwd = np.asarray(agent.cam_dir, dtype=float)
        self.right = np.asarray(agent.right_vec, dtype=float)
        self.up = np.cross(self.right, self.fwd)
        self.tan = math.tan(math.radians(fov_degrees) / 2)

    def sees(self, ent) -> bool:
        base = np.asarray(ent.pos, dtype=float)
        for frac in (0.1, 0.5, 0.9):
            d = base + np.array([0.0, ent.height * frac, 0.0]) - self.eye
            depth = float(d @ self.fwd)
            if depth <= 0.05:
                continue
            if abs(float(d @ self.right)) <= depth * self.tan and abs(float(d @ self.up)) <= depth * self.tan:
                return True
        return False


def _world_alive(world: NavigationWorld) -> bool:
    return world is not None and world.shadow_window is not None


def _close_world(world: NavigationWorld) -> None:
    world.close()
    if world._list_id is not None:
        world.shadow_window.switch_to()
        gl.glDeleteLists(world._list_id, 1)
    world.shadow_window.close()
