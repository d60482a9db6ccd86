"""ALFWorld-format games from a seed, for machines without the official data download.

A game is what ALFWorld's own tooling reads: a folder with `traj_data.json` (task type and
its pddl_params), `initial_state.pddl` (the problem) and `game.tw-pddl` (domain, grammar,
problem, solvable flag and walkthrough), so the alfworld package's PddlEnv, demangler and
handcoded expert play it unchanged.

Rooms come from the package's own scene data (alfworld/gen/layouts): the object classes of
each of the 120 AI2-THOR floor plans and the ids of its receptacles with the agent pose that
reaches them. What goes where uses the package's affordance tables (gen/constants.py:
VAL_RECEPTACLE_OBJECTS, VAL_ACTION_OBJECTS, GOALS_VALID) and the goals and task wordings of
gen/goal_library.py. A seed draws the floor plan, the receptacles missing from the layout,
how many of each object and where each lies, the agent's start, and the task; a generated
game is kept only when the package's handcoded expert solves it (`solve`).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterable, Sequence

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
# The appliance a task type needs, and which receptacle class it may not end in (putting a hot
# apple back into the microwave would make the goal trivial).
_APPLIANCE = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
_ABILITY = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}
# Receptacles the layouts name but the text games never use as such.
_NOT_RECEPTACLES = {"Bowl", "Box", "Cup", "Mug", "Plate", "Pan", "Pot", "PaintingHanger"}
# Where a desk lamp may stand (lamps are in no canContain table: they are never moved).
_LAMP_STANDS = ("Desk", "SideTable", "Dresser", "Shelf", "Nightstand", "CoffeeTable", "TVStand")
# A generated game is kept when the expert needs at most this many steps: long searches through
# twenty cabinets would be games no agent solves in an RL episode's 30-50 steps.
MAX_EXPERT_STEPS = 50
# How many instances a receptacle class gets when the layout does not list it.
_EXTRA_COUNTS = {"StoveBurner": (2, 4), "CounterTop": (1, 3), "Shelf": (1, 3), "SideTable": (1, 2),
                 "Drawer": (1, 4), "Cabinet": (2, 6)}


def _alfworld_dir() -> str:
    import alfworld
    return os.path.dirname(os.path.abspath(alfworld.__file__))


def domain_path() -> str:
    return os.path.join(_alfworld_dir(), "data", "alfred.pddl")


def grammar_path() -> str:
    return os.path.join(_alfworld_dir(), "data", "alfred.twl2")


@lru_cache(maxsize=1)
def _tables():
    import alfworld.gen.constants as c
    import alfworld.gen.goal_library as goals
    return c, goals


@lru_cache(maxsize=None)
def floor_plan(number: int) -> tuple[tuple[str, ...], dict[str, list[float]]]:
    """(object classes, {receptacle id: agent pose}) of one floor plan, from the package."""
    base = os.path.join(_alfworld_dir(), "gen", "layouts", f"FloorPlan{number}")
    with open(base + "-objects.json") as f:
        classes = tuple(json.load(f))
    with open(base + "-openable.json") as f:
        poses = json.load(f)
    return classes, poses


def scene_type(number: int) -> str:
    c, _ = _tables()
    for name, numbers in c.SCENE_TYPE.items():
        if number in numbers:
            return name
    raise ValueError(f"FloorPlan{number} is not an ALFRED scene")


def all_floor_plans() -> list[int]:
    c, _ = _tables()
    return [n for numbers in c.SCENE_TYPE.values() for n in numbers]


def mangle(name: str) -> str:
    """An AI2-THOR id as a PDDL name, the way ALFRED's problems spell it (the demangler's inverse)."""
    for a, b in (("|", "_bar_"), ("-", "_minus_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        name = name.replace(a, b)
    return name


def _coord(rng: random.Random, lo: float = -3.0, hi: float = 3.0) -> str:
    v = rng.uniform(lo, hi)
    return f"{'+' if v >= 0 else '-'}{abs(v):05.2f}"


def _loc_name(pose: Sequence[float]) -> str:
    # ALFRED's location names are the agent pose on its 0.25 m grid: x, z, heading/90, horizon.
    x, z, rot, horizon = pose
    parts = [int(round(x / 0.25)), int(round(z / 0.25)), int(round(rot / 90)) % 4, int(round(horizon))]
    return mangle("loc|" + "|".join(str(p) for p in parts))


@dataclass
class Scene:
    floor_plan: int
    # receptacle PDDL name -> (class, location)
    receptacles: dict[str, tuple[str, str]] = field(default_factory=dict)
    # object PDDL name -> (class, receptacle PDDL name)
    objects: dict[str, tuple[str, str]] = field(default_factory=dict)
    agent_location: str = ""

    def receptacle_classes(self) -> set[str]:
        return {cls for cls, _ in self.receptacles.values()}

    def instances(self, cls: str) -> list[str]:
        return [name for name, (c, _) in self.objects.items() if c == cls]


def _receptacle_class(thor_id: str) -> str:
    parts = thor_id.split("|")
    # Sinks and bathtubs are reached through their basin: "Sink|x|y|z|SinkBasin".
    return parts[-1] if len(parts) > 4 else parts[0]


def build_scene(number: int, rng: random.Random, must_have: Iterable[str] = ()) -> Scene:
    """Receptacles from the layout (plus drawn ones for classes it names without a pose),
    then 1-3 of each object class the scene has, each in a receptacle that can hold it."""
    c, _ = _tables()
    classes, poses = floor_plan(number)
    scene = Scene(number)
    used_locs: set[str] = set()
    for thor_id, pose in poses.items():
        cls = _receptacle_class(thor_id)
        if cls not in c.RECEPTACLES or cls in _NOT_RECEPTACLES:
            continue
        loc = _loc_name(pose)
        scene.receptacles[mangle(thor_id)] = (cls, loc)
        used_locs.add(loc)
    have = scene.receptacle_classes()
    for cls in sorted(set(classes)):
        if cls not in c.RECEPTACLES or cls in _NOT_RECEPTACLES or cls in have:
            continue
        lo, hi = _EXTRA_COUNTS.get(cls, (1, 1))
        for _ in range(rng.randint(lo, hi)):
            thor_id = f"{cls}|{_coord(rng)}|{_coord(rng, 0, 2)}|{_coord(rng)}"
            if cls == "SinkBasin":
                thor_id = "Sink|" + thor_id.split("|", 1)[1] + "|SinkBasin"
            pose = [rng.randint(-20, 20) * 0.25, rng.randint(-20, 20) * 0.25, rng.randrange(4) * 90,
                    rng.choice((0, 15, 30, 45, 60))]
            loc = _loc_name(pose)
            scene.receptacles[mangle(thor_id)] = (cls, loc)
            used_locs.add(loc)
    # The agent starts where no receptacle is: "You are in the middle of a room."
    while True:
        start = _loc_name([rng.randint(-20, 20) * 0.25, rng.randint(-20, 20) * 0.25, rng.randrange(4) * 90, 30])
        if start not in used_locs:
            scene.agent_location = start
            break

    holders = _holders(scene)
    object_classes = sorted({cls for cls in classes if cls in holders} | set(must_have))
    for cls in object_classes:
        spots = holders.get(cls, [])
        if not spots:
            continue
        for _ in range(rng.randint(1, c.MAX_NUM_OF_OBJ_INSTANCES)):
            _add_object(scene, cls, rng.choice(spots), rng)
    if "DeskLamp" in classes or "DeskLamp" in must_have:
        stands = [r for r, (cls, _) in scene.receptacles.items() if cls in _LAMP_STANDS]
        if stands:
            _add_object(scene, "DeskLamp", rng.choice(stands), rng)
    return scene


def _holders(scene: Scene) -> dict[str, list[str]]:
    """Object class -> the scene's receptacles that can hold it."""
    c, _ = _tables()
    out: dict[str, list[str]] = {}
    for name, (rcls, _) in sorted(scene.receptacles.items()):
        for ocls in c.VAL_RECEPTACLE_OBJECTS.get(rcls, ()):
            if ocls in c.OBJECTS and not ocls.endswith("Sliced"):
                out.setdefault(ocls, []).append(name)
    return out


def _add_object(scene: Scene, cls: str, receptacle: str, rng: random.Random) -> str:
    while True:
        name = mangle(f"{cls}|{_coord(rng)}|{_coord(rng, 0, 2)}|{_coord(rng)}")
        if name not in scene.objects:
            scene.objects[name] = (cls, receptacle)
            return name


@dataclass
class Task:
    task_type: str
    object_target: str
    parent_target: str = ""
    toggle_target: str = ""

    def pddl_params(self) -> dict:
        return {"object_target": self.object_target, "parent_target": self.parent_target,
                "toggle_target": self.toggle_target, "mrecep_target": "", "object_sliced": False}


def choose_task(task_type: str, scene: Scene, rng: random.Random) -> Task | None:
    """A task of this type the scene affords, with its goal not already met; None if none."""
    c, _ = _tables()
    holders = _holders(scene)
    present = {cls for cls, _ in scene.objects.values()}
    if task_type == "look_at_obj_in_light":
        if "DeskLamp" not in present:
            return None
        candidates = sorted(cls for cls in present if cls in holders and cls != "DeskLamp")
        return Task(task_type, rng.choice(candidates), toggle_target="DeskLamp") if candidates else None
    appliance = _APPLIANCE.get(task_type)
    if appliance and appliance not in scene.receptacle_classes():
        return None
    pairs = []
    for ocls in sorted(present):
        if ocls not in holders:
            continue
        if task_type in _ABILITY and ocls not in c.VAL_ACTION_OBJECTS[_ABILITY[task_type]]:
            continue
        if task_type == "pick_two_obj_and_place" and len(scene.instances(ocls)) < 2:
            continue
        for rcls in sorted({scene.receptacles[r][0] for r in holders[ocls]}):
            if rcls != appliance:
                pairs.append((ocls, rcls))
    rng.shuffle(pairs)
    for ocls, rcls in pairs:
        # Move targets already in a goal receptacle elsewhere, so the goal is not met at the start.
        elsewhere = [r for r in holders[ocls] if scene.receptacles[r][0] != rcls]
        if not elsewhere:
            continue
        for name in scene.instances(ocls):
            if scene.receptacles[scene.objects[name][1]][0] == rcls:
                scene.objects[name] = (ocls, rng.choice(elsewhere))
        return Task(task_type, ocls, parent_target=rcls)
    return None


def problem_pddl(scene: Scene, task: Task, name: str) -> str:
    """The PDDL problem in the shape of ALFRED's initial_state.pddl."""
    c, goals = _tables()
    rtypes = sorted(set(c.RECEPTACLES) - _NOT_RECEPTACLES)
    otypes = sorted((set(c.OBJECTS) | {cls for cls, _ in scene.objects.values()}) - set(rtypes))
    locations = sorted({loc for _, loc in scene.receptacles.values()} | {scene.agent_location})
    decl = ["agent1 - agent"]
    decl += [f"{t}Type - otype" for t in otypes] + [f"{t}Type - rtype" for t in rtypes]
    decl += [f"{o} - object" for o in sorted(scene.objects)]
    decl += [f"{r} - receptacle" for r in sorted(scene.receptacles)]
    decl += [f"{loc} - location" for loc in locations]
    init = [f"(atLocation agent1 {scene.agent_location})"]
    for r, (cls, loc) in sorted(scene.receptacles.items()):
        init.append(f"(receptacleType {r} {cls}Type)")
        init.append(f"(receptacleAtLocation {r} {loc})")
        if cls in c.OPENABLE_CLASS_SET:
            init.append(f"(openable {r})")
    abilities = {"Cleanable": "cleanable", "Heatable": "heatable", "Coolable": "coolable",
                 "Sliceable": "sliceable", "Toggleable": "toggleable"}
    for o, (cls, r) in sorted(scene.objects.items()):
        init.append(f"(objectType {o} {cls}Type)")
        init.append(f"(inReceptacle {o} {r})")
        init.append(f"(objectAtLocation {o} {scene.receptacles[r][1]})")
        if cls != "DeskLamp":
            init.append(f"(pickupable {o})")
        for table, predicate in abilities.items():
            if cls in c.VAL_ACTION_OBJECTS[table]:
                init.append(f"({predicate} {o})")
    present_o = sorted({cls for cls, _ in scene.objects.values()})
    for rcls in sorted(scene.receptacle_classes()):
        for ocls in present_o:
            if ocls in c.VAL_RECEPTACLE_OBJECTS.get(rcls, ()):
                init.append(f"(canContain {rcls}Type {ocls}Type)")
    goal = goals.gdict[task.task_type]["pddl"].replace("#", "-").format(
        obj=task.object_target, recep=task.parent_target, toggle=task.toggle_target, mrecep="")
    return ("(define (problem {})\n(:domain alfred)\n(:objects\n    {}\n)\n(:init\n    {}\n)\n{}".format(
        name, "\n    ".join(decl), "\n    ".join(init), goal.strip()))


def task_description(task: Task, rng: random.Random) -> str:
    """One of the package's templated wordings of the goal (its goal_library)."""
    _, goals = _tables()
    template = rng.choice(goals.gdict[task.task_type]["templates"])
    return template.format(obj=task.object_target.lower(), recep=task.parent_target.lower(),
                           toggle=task.toggle_target.lower(), mrecep="")


@dataclass
class Game:
    """One generated game, as the three files of an ALFWorld game folder."""
    key: str                 # the folder name, in json_2.1.1's "type-obj-mrecep-recep-scene" style
    traj_data: dict
    problem: str
    game: dict               # game.tw-pddl


def generate(seed: int, task_type: str, floor_plans: Sequence[int], attempt: int = 0) -> Game | None:
    """A game of `task_type` in one of `floor_plans`, drawn from (seed, attempt); None when the
    drawn scene cannot host the task (callers try the next attempt)."""
    c, _ = _tables()
    rng = random.Random(f"alfworld-gen:{task_type}:{seed}:{attempt}")
    valid_types = c.GOALS_VALID[task_type]
    plans = [n for n in floor_plans if scene_type(n) in valid_types]
    if not plans:
        raise ValueError(f"no floor plan among {list(floor_plans)[:8]}... can host {task_type}")
    number = rng.choice(plans)
    must = ("DeskLamp",) if task_type == "look_at_obj_in_light" else ()
    scene = build_scene(number, rng, must_have=must if "DeskLamp" in floor_plan(number)[0] else ())
    task = choose_task(task_type, scene, rng)
    if task is None:
        return None
    trial = f"trial_G{seed:010d}"
    problem = problem_pddl(scene, task, f"plan_{trial}")
    desc = task_description(task, rng)
    with open(grammar_path()) as f:
        grammar = f.read().replace("UNKNOWN GOAL", desc)
    with open(domain_path()) as f:
        domain = f.read()
    params = task.pddl_params()
    traj = {
        "task_type": task_type, "task_id": trial, "pddl_params": params,
        "scene": {"floor_plan": f"FloorPlan{number}", "scene_num": number, "random_seed": seed,
                  "attempt": attempt},
        "turk_annotations": {"anns": [{"task_desc": desc[0].upper() + desc[1:] + "."}]},
        "generator": "envserve.envs.alfworld.generate",
    }
    key = "{}-{}-{}-{}-{}".format(task_type, params["object_target"], "None",
                                  params["parent_target"] or params["toggle_target"], number)
    game = {"pddl_domain": domain, "grammar": grammar, "pddl_problem": problem,
            "solvable": None, "walkthrough": None}
    return Game(key=f"{key}/{trial}", traj_data=traj, problem=problem, game=game)


def write_game(game: Game, root: str) -> str:
    """Write the game folder under root; returns the game.tw-pddl path. Readers never see it
    half written: generate_solvable writes into a private folder and renames the whole game."""
    folder = os.path.join(root, game.key)
    os.makedirs(folder, exist_ok=True)
    for fname, text in (("traj_data.json", json.dumps(game.traj_data, indent=1)),
                        ("initial_state.pddl", game.problem),
                        ("game.tw-pddl", json.dumps(game.game))):
        with open(os.path.join(folder, fname), "w") as f:
            f.write(text)
    return os.path.join(folder, "game.tw-pddl")


def expert_seed(game_file: str) -> str:
    """The handcoded expert's random seed for a game: its task and trial folder names, the same on
    every machine (a path would not be), and the same when generating and when serving, so the
    expert of a session repeats the walkthrough that made the game pass."""
    return "/".join(os.path.abspath(game_file).replace("\\", "/").split("/")[-3:-1])


@contextlib.contextmanager
def _seeded_global_random(seed: str):
    # The package's handcoded expert draws from the global `random`: seed it for a reproducible
    # walkthrough, and give callers their RNG state back.
    state = random.getstate()
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)


def solve(game_file: str, max_steps: int = 150) -> list[str] | None:
    """The handcoded expert's walkthrough of a game file, or None when it does not reach the goal
    in max_steps (the check alfworld-generate runs before it marks a game solvable)."""
    from .engine import Engine

    engine = Engine()
    walkthrough: list[str] = []
    with _seeded_global_random(expert_seed(game_file)):
        try:
            state = engine.load(game_file, True)
            for _ in range(max_steps):
                command = state["expert_action"]
                if not command:
                    return None
                state = engine.step(command)
                walkthrough.append(command)
                if state["won"]:
                    return walkthrough
        except Exception:  # noqa: BLE001 - an engine error makes the game unusable, not the caller
            return None
        finally:
            engine.close()
    return None


def _close_engine(env) -> None:
    """Free the planner state of the fast-downward library copy a PddlEnv dlopen()ed. The copy
    stays mapped (about 1 MB resident): dlclose() of one copy while others stay loaded crashed
    the process after a few dozen games, and engine processes live for one session anyway."""
    inner = env
    while inner is not None and not hasattr(inner, "downward_lib"):
        inner = getattr(inner, "_wrapped_env", None)
    if inner is not None and inner.downward_lib is not None:
        from .engine import release_planner
        with contextlib.suppress(Exception):
            inner.downward_lib.cleanup()
        release_planner(inner.downward_lib)
        inner.downward_lib = None


def generate_solvable(seed: int, task_type: str, floor_plans: Sequence[int], root: str,
                      attempts: int = 64) -> tuple[str, Game]:
    """The first game of attempts 0, 1, ... of seed that the expert solves within
    MAX_EXPERT_STEPS, written under root with its walkthrough. Deterministic: every process
    finds the same game for a seed. Games are made in a private folder and renamed into
    place, so a reader never sees one half written or not yet checked."""
    import shutil
    import tempfile

    os.makedirs(root, exist_ok=True)
    for k in range(attempts):
        game = generate(seed, task_type, floor_plans, attempt=k)
        if game is None:
            continue
        with tempfile.TemporaryDirectory(dir=root, prefix=".gen-") as scratch:
            walkthrough = solve(write_game(game, scratch), MAX_EXPERT_STEPS)
            if walkthrough is None:
                continue
            game.game["solvable"], game.game["walkthrough"] = True, walkthrough
            write_game(game, scratch)
            final = os.path.join(root, game.key)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            with contextlib.suppress(OSError):  # another process put the same game there first
                os.rename(os.path.join(scratch, game.key), final)
            if not os.path.exists(os.path.join(final, "game.tw-pddl")):
                shutil.copytree(os.path.join(scratch, game.key), final, dirs_exist_ok=True)
        return os.path.join(final, "game.tw-pddl"), game
    raise RuntimeError(f"no solvable {task_type} game in {attempts} draws from seed {seed}")
