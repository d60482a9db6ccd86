"""ALFWorld (Shridhar et al. 2021), text version: household tasks in AI2-THOR rooms played
through TextWorld's PDDL engine with the alfworld package's domain, grammar and expert.

Seeds map to games through splits (split k owns seeds [k * SPLIT_STRIDE, ...)): ALFWorld's
own train / valid_seen / valid_unseen, RLVMR's L0 (seen task types, seen rooms), L1 (seen
types, unseen rooms) and L2 (held-out types, by default Cool and Pick Two), their training
set train_seen, and LaMer's id / ood (in- and out-of-distribution task types). Games are
the official json_2.1.1 data where $ALFWORLD_DATA has it, else generated (games.py).

Two choices differ from the alfworld package's own text environment, each behind a config key:
- goal_in_observations (default on): every observation after the first starts with the task line
  "Your task is to: ...", as verl-agent's ALFWorld prompt (GiGPO's code) repeats the task each
  turn; the package states it in the first observation only (off: its observations as they are).
- invalid_action_penalty (default -0.1, the session's common key, set here explicitly): added for
  a command the game cannot carry out ("Nothing happens."), where the package's reward is 0 (set
  it to 0.0 for the package's rewards).

The engine runs in a child process per instance (engine.py): close() ends it.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

from envserve.core.env import (REWARD_BOUNDS, SERVER_PATH_BOUNDS, ActionOutcome, Environment, EnvSpec, GroundTruth, Split,
                               TaskDescription)
from envserve.core.session import SessionError

from . import games as game_index
from .engine import NOTHING_HAPPENS, Engine, EngineClient, EngineGone
from .generate import TASK_TYPES

SPLIT_STRIDE = 1_000_000
# What each of ALFWorld's six task types asks, said in ListTasks before a game names its objects.
TASK_GOALS = {
    "pick_and_place_simple": "put an object in or on a receptacle",
    "look_at_obj_in_light": "examine an object under a desk lamp",
    "pick_clean_then_place_in_recep": "clean an object in the sink, then put it in or on a receptacle",
    "pick_heat_then_place_in_recep": "heat an object in the microwave, then put it in or on a receptacle",
    "pick_cool_then_place_in_recep": "cool an object in the fridge, then put it in or on a receptacle",
    "pick_two_obj_and_place": "put two objects of one kind in or on a receptacle",
}
# Facts about what the agent looked at, not about the world: left out of the state key.
_LOOK_FACTS = ("checked", "examined")

SYSTEM_PROMPT = """You are an agent in ALFWorld, a text-based household: a kitchen, living room, bedroom or bathroom with receptacles (cabinets, drawers, countertops, a fridge, a microwave, a sink...) and objects in them.
Each observation says what your last action did; the first one lists the receptacles around you and your task.
Actions are short commands, one per answer:
go to RECEPTACLE | open RECEPTACLE | close RECEPTACLE | take OBJECT from RECEPTACLE | move OBJECT to RECEPTACLE | examine SOMETHING | use OBJECT | heat OBJECT with microwave | cool OBJECT with fridge | clean OBJECT with sinkbasin | inventory | look
Objects and receptacles carry numbers, e.g. "take apple 1 from countertop 2". An action that is not possible now answers "Nothing happens.".
The episode succeeds when the task is done."""

_DEFAULTS = {
    "data_source": "auto",
    "data_dir": "",
    "games_dir": "",
    # RLVMR's held-out categories (L2) and LaMer's out-of-distribution ones: Cool and Pick Two.
    "heldout_task_types": "pick_cool_then_place_in_recep,pick_two_obj_and_place",
    "ood_task_types": "pick_cool_then_place_in_recep,pick_two_obj_and_place",
    # ALFWorld's split sizes (json_2.1.1, solvable text games), for generated data.
    "generated_train_games": 3553,
    "generated_valid_seen_games": 140,
    "generated_valid_unseen_games": 134,
    # ALFRED's unseen validation scenes, one per room type.
    "unseen_floor_plans": "10,219,308,424",
    "success_reward": 10.0,
    "goal_in_observations": True,
    # The session's common key, here for its ALFWorld meaning; the alfworld package gives 0.
    "invalid_action_penalty": -0.1,
    "expert": False,
    "isolation": "process",
    "engine_caches": True,
    "engine_template": True,
    "fork_copies": True,
    "fork_copy_ttl_s": 30.0,
}
_DOCS = {
    "data_source": "auto (official data if found, else generated), official or generated",
    "data_dir": "the ALFWorld data folder holding json_2.1.1 (default: $ALFWORLD_DATA)",
    "games_dir": "where generated games are written and read (default: $ENVSERVE_ALFWORLD_GAMES or "
                 "~/.cache/envserve/alfworld/v1)",
    "heldout_task_types": "comma-separated task types of RLVMR's L2; the others make train_seen, L0 and L1",
    "ood_task_types": "comma-separated task types of LaMer's ood split; the others make id",
    "generated_train_games": "number of generated train games",
    "generated_valid_seen_games": "number of generated valid_seen games",
    "generated_valid_unseen_games": "number of generated valid_unseen games (in unseen floor plans)",
    "unseen_floor_plans": "comma-separated floor plans used only by valid_unseen when generating",
    "success_reward": "reward when the task is done",
    "goal_in_observations": "start every observation after the first with 'Your task is to: GOAL' (as "
                            "verl-agent's prompt repeats the task each turn); off: the alfworld package's "
                            "observations, which state the task in the first one only",
    "invalid_action_penalty": "added for a command the game cannot carry out ('Nothing happens.'); the "
                              "alfworld package gives 0 (set 0.0 for its rewards)",
    "expert": "run alfworld's handcoded expert along: the state endpoint tells its next action",
    "isolation": "process (an engine process per session) or none (in the worker; no process to start, "
                 "but one engine crash takes the worker down, and forks replay)",
    "engine_caches": "memoize the engine's PDDL translation and grammar parsing (same results, faster)",
    "engine_template": "start a session's engine process as a fork of the worker's template engine (imports "
                       "done; a few ms, their memory shared) instead of a fresh interpreter (about 1 s)",
    "fork_copies": "Fork copies the engine process, game state and all (os.fork), instead of replaying the "
                   "episode's actions in new engines; isolation=process only",
    "fork_copy_ttl_s": "how long the frozen engine copy behind a Fork waits for its copies to connect",
}

_BOUNDS = {
    "data_source": {"enum": ["auto", "official", "generated"]},
    # Folders on the server (data read, generated games written): the operator's allow-list only.
    "data_dir": SERVER_PATH_BOUNDS,
    "games_dir": SERVER_PATH_BOUNDS,
    # Comma-separated lists of the six task types' names (the longest is 32 characters).
    "heldout_task_types": {"maxLength": 256},
    "ood_task_types": {"maxLength": 256},
    # Games are generated (a planner run each, written to games_dir) the first time a seed needs
    # one, so these sizes bound the disk a caller can fill: ALFWorld's own split sizes at most.
    "generated_train_games": {"minimum": 0, "maximum": _DEFAULTS["generated_train_games"]},
    "generated_valid_seen_games": {"minimum": 0, "maximum": _DEFAULTS["generated_valid_seen_games"]},
    "generated_valid_unseen_games": {"minimum": 0, "maximum": _DEFAULTS["generated_valid_unseen_games"]},
    "unseen_floor_plans": {"maxLength": 256},
    "success_reward": REWARD_BOUNDS,
    # "none" runs the engine in the worker, where its crash would take every session of that
    # worker, other callers' too: an operator may allow it (core/limits.py).
    "isolation": {"enum": ["process"]},
    # How long a frozen engine process behind a Fork waits for its copies: a caller may shorten it.
    "fork_copy_ttl_s": {"exclusiveMinimum": 0.0, "maximum": _DEFAULTS["fork_copy_ttl_s"]},
}
# name -> (base splits, which task types), in seed-range order.
_SPLITS = (
    ("train", ("train",), "all"),
    ("valid_seen", ("valid_seen",), "all"),
    ("valid_unseen", ("valid_unseen",), "all"),
    ("train_seen", ("train",), "seen"),
    ("L0", ("valid_seen",), "seen"),
    ("L1", ("valid_unseen",), "seen"),
    ("L2", ("valid_seen", "valid_unseen"), "heldout"),
    ("id", ("valid_seen", "valid_unseen"), "id"),
    ("ood", ("valid_seen", "valid_unseen"), "ood"),
)
_SPLIT_DOCS = {
    "train": "ALFWorld train", "valid_seen": "ALFWorld valid_seen (seen rooms)",
    "valid_unseen": "ALFWorld valid_unseen (unseen rooms)",
    "train_seen": "train games of the seen task types (RLVMR/LaMer training set)",
    "L0": "RLVMR L0: seen task types in seen rooms", "L1": "RLVMR L1: seen task types in unseen rooms",
    "L2": "RLVMR L2: held-out task types (Cool, Pick Two)",
    "id": "LaMer in-distribution: pick, look, clean, heat", "ood": "LaMer out-of-distribution: cool, pick two",
}


def _type_list(text: str, key: str) -> frozenset[str]:
    types = frozenset(t.strip() for t in text.split(",") if t.strip())
    unknown = types - set(TASK_TYPES)
    if unknown:
        raise ValueError(f"{key}: unknown task types {sorted(unknown)}; known: {list(TASK_TYPES)}")
    return types


def _select(refs_by_base, heldout: frozenset[str], ood: frozenset[str]) -> dict[str, list]:
    keep = {"all": lambda t: True, "seen": lambda t: t not in heldout, "heldout": lambda t: t in heldout,
            "id": lambda t: t not in ood, "ood": lambda t: t in ood}
    return {name: [r for b in bases for r in refs_by_base[b] if keep[which](r.task_type)]
            for name, bases, which in _SPLITS}


def _default_split_games() -> dict[str, list]:
    """Each split's games under the default config (generated games), as the env selects them."""
    counts = {"train": _DEFAULTS["generated_train_games"], "valid_seen": _DEFAULTS["generated_valid_seen_games"],
              "valid_unseen": _DEFAULTS["generated_valid_unseen_games"]}
    refs = {b: [game_index.GameRef(b, i, TASK_TYPES[i % 6]) for i in range(n)] for b, n in counts.items()}
    heldout = _type_list(_DEFAULTS["heldout_task_types"], "heldout_task_types")
    return _select(refs, heldout, _type_list(_DEFAULTS["ood_task_types"], ""))


_DEFAULT_GAMES = _default_split_games()
_SIZES = {k: len(v) for k, v in _DEFAULT_GAMES.items()}


class AlfWorldEnv(Environment):
    spec = EnvSpec(
        env_id="alfworld",
        description="ALFWorld (text): six household task types on the alfworld package's PDDL engine; "
                    "official data via ALFWORLD_DATA or generated games; RLVMR L0/L1/L2 and LaMer id/ood splits. "
                    "Text only: no image observation. Unlike the alfworld package, every observation repeats "
                    "the task line (goal_in_observations) and an impossible command costs "
                    "invalid_action_penalty (-0.1; the package: 0).",
        system_prompt=SYSTEM_PROMPT,
        action_space="an ALFWorld command, e.g. go to fridge 1, take apple 1 from countertop 2, "
                     "heat apple 1 with microwave 1, move apple 1 to diningtable 1",
        # RLVMR: 30 steps, one action per turn.
        max_turns=30,
        max_actions_per_turn=1,
        config_defaults=_DEFAULTS,
        config_docs=_DOCS,
        config_bounds=_BOUNDS,
        splits=tuple(Split(name, f"{_SPLIT_DOCS[name]}: {_SIZES[name]} games with generated data, "
                                 f"seeds from {k * SPLIT_STRIDE:.0e}", k * SPLIT_STRIDE, max(1, _SIZES[name]))
                     for k, (name, _, _) in enumerate(_SPLITS)),
        default_action_format="free_think",
        # The game state lives in the engine process: a snapshot is a frozen fork of that process
        # (fork_copies), else forks replay (seed, actions).
        supports_snapshot=True,
    )

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        c = self.config
        if c["isolation"] not in ("process", "none"):  # an operator's enum may name others
            raise ValueError(f"isolation must be process or none, got {c['isolation']!r}")
        heldout = _type_list(c["heldout_task_types"], "heldout_task_types")
        ood = _type_list(c["ood_task_types"], "ood_task_types")
        root = game_index.official_root(c["data_dir"])
        if c["data_source"] == "official" and not root:
            raise ValueError("data_source=official needs json_2.1.1 under data_dir or $ALFWORLD_DATA")
        self.official = bool(root) and c["data_source"] != "generated"
        self._generated = None
        if self.official:
            refs = game_index.scan_official(root)
        else:
            try:
                plans = tuple(int(x) for x in str(c["unseen_floor_plans"]).split(",") if x.strip())
            except ValueError:
                raise ValueError(f"unseen_floor_plans must be comma-separated numbers, got {c['unseen_floor_plans']!r}") from None
            counts = {b: int(c[f"generated_{b}_games"]) for b in game_index.BASE_SPLITS}
            self._generated = game_index.GeneratedGames(c["games_dir"], counts, plans)
            refs = {b: self._generated.refs(b) for b in game_index.BASE_SPLITS}
        self._splits = _select(refs, heldout, ood)
        self._engine = None
        self._start_engine()
        self._lost = ""
        self._game: game_index.GameRef | None = None
        self._game_file = self._game_key = ""
        self._state: dict = {}
        self._intro = ""
        self._goal = ""
        self._done = False

    # -- the engine ----------------------------------------------------------------------
    def _start_engine(self) -> None:
        caches = bool(self.config["engine_caches"])
        if self.config["isolation"] == "process":
            self._engine = EngineClient.start(caches, template=bool(self.config["engine_template"]),
                                              warm_game=self._any_game_file)
        else:
            self._engine = Engine(caches=caches)

    def _any_game_file(self) -> str:
        """A game on disk to warm the template engine with ("" when none is yet)."""
        for games in self._splits.values():
            for ref in games[:1]:
                path = ref.path or (self._generated.existing(ref) if self._generated else "")
                if path:
                    return path
        return ""

    # -- copies (Fork) -------------------------------------------------------------------
    # What a session's episode is, besides the engine's own state.
    _EPISODE_FIELDS = ("_game", "_game_file", "_game_key", "_state", "_intro", "_goal", "_done")

    def snapshot(self):
        """A frozen fork of the engine process that serves copies for fork_copy_ttl_s, and this
        side's episode fields; None (replay instead) without an engine process to copy."""
        c = self.config
        if c["isolation"] != "process" or not c["fork_copies"] or self._lost or self._engine is None:
            return None
        try:
            address = self._engine.copies(float(c["fork_copy_ttl_s"]))
        except EngineGone:
            return None     # the replay that follows reports the loss where it belongs
        return {"engine": address, "fields": copy.deepcopy({k: getattr(self, k) for k in self._EPISODE_FIELDS})}

    def restore(self, snap) -> None:
        try:
            engine = EngineClient.connect(snap["engine"])
        except EngineGone as e:
            raise SessionError("UNAVAILABLE", f"fork failed: the frozen ALFWorld engine copy is gone ({e}); "
                                              f"fork again") from None
        self.close()        # the engine this instance started with
        self._engine, self._lost = engine, ""
        for k, v in copy.deepcopy(snap["fields"]).items():
            setattr(self, k, v)

    @property
    def engine_pid(self) -> int:
        return getattr(self._engine, "pid", -1)

    def _call(self, op: str, *args):
        """One engine call. A dead engine process loses this session only: DATA_LOSS."""
        if self._lost:
            raise SessionError("DATA_LOSS", self._lost)
        pid = self.engine_pid   # read first: a gone engine's handle forgets its pid
        try:
            return getattr(self._engine, op)(*args)
        except EngineGone as e:
            self._lost = (f"session lost: its ALFWorld engine (pid {pid}): {e}; "
                          "its episode is gone: reset the session (a new engine starts) or open a new one")
            self.close()
            raise SessionError("DATA_LOSS", self._lost) from None

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    @classmethod
    def describe_task(cls, spec, seed: int) -> TaskDescription:
        """The generated game a seed starts under the default config: the kind of goal its task type
        sets, the type, and where it sits in ALFWorld's base split (the game's own goal text, naming
        the object and receptacle, comes with the game when it is generated)."""
        games = _DEFAULT_GAMES[_SPLITS[(seed // SPLIT_STRIDE) % len(_SPLITS)][0]]
        if not games or game_index.official_root(_DEFAULTS["data_dir"]):
            return TaskDescription()   # official games: which one a seed starts is known once scanned
        ref = games[(seed % SPLIT_STRIDE) % len(games)]
        goal = TASK_GOALS.get(ref.task_type, ref.task_type)
        return TaskDescription(description=f"{goal} (a generated {ref.task_type} game, {ref.base} #{ref.index})",
                               task_type=ref.task_type, parameters={"base_split": ref.base, "game": ref.index})

    # -- episodes ------------------------------------------------------------------------
    def game_of_seed(self, seed: int) -> game_index.GameRef:
        name = _SPLITS[(seed // SPLIT_STRIDE) % len(_SPLITS)][0]
        games = self._splits[name]
        if not games:
            raise SessionError("FAILED_PRECONDITION", f"split {name} has no games with this config")
        return games[(seed % SPLIT_STRIDE) % len(games)]

    def _game_path(self, ref: game_index.GameRef) -> str:
        if ref.path:
            return ref.path
        gen = self._generated
        return gen.existing(ref) or self._call("generate", gen.seed(ref), ref.task_type,
                                               list(gen.floor_plans(ref.base)), gen.out_dir(ref))

    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        if self._lost:
            # The engine died: a new episode gets a new one.
            self._lost = ""
            self._start_engine()
        ref = self.game_of_seed(int(seed or 0))
        path = self._game_path(ref)
        self._state = self._call("load", path, bool(self.config["expert"]))
        if self.config["isolation"] == "process" and self.config["engine_template"]:
            EngineClient.warm_template(bool(self.config["engine_caches"]), path)
        self._game, self._game_file = ref, path
        # base split / task folder / trial: the same on every machine, unlike the path.
        self._game_key = "/".join(path.replace("\\", "/").split("/")[-4:-1])
        self._intro = self._state["feedback"]
        self._goal = self._intro.rsplit("Your task is to:", 1)[-1].strip().rstrip(".")
        self._done = False

    def step(self, action: str) -> ActionOutcome:
        if self._done:
            return ActionOutcome(valid=False, feedback="The episode is over; reset the environment.")
        try:
            self._state = self._call("step", action)
        except RuntimeError as e:
            return ActionOutcome(valid=False, feedback=f"The engine rejected {action!r}: {e}")
        if not self._state["valid"]:
            return ActionOutcome(valid=False, feedback=NOTHING_HAPPENS)
        won = self._state["won"]
        self._done = won
        reward = float(self.config["success_reward"]) if won else 0.0
        return ActionOutcome(reward=reward, done=won, success=won, components={"success": reward} if won else {})

    # -- observations ----------------------------------------------------------------------
    def render_text(self) -> str:
        feedback = self._state.get("feedback", "")
        if feedback == self._intro or not self.config["goal_in_observations"]:
            return feedback
        return f"Your task is to: {self._goal}\n\n{feedback}"

    def _world_facts(self) -> list[list[str]]:
        return [f for f in self._state.get("facts", []) if f[0] not in _LOOK_FACTS]

    def ground_truth(self) -> GroundTruth:
        world = self._world_facts()
        at = {}
        receptacle_at: dict[str, list[str]] = {}
        inside: dict[str, str] = {}
        holding, opened, states = [], [], {}
        for name, *args in world:
            if name == "atlocation" and len(args) == 2:
                at[args[0]] = args[1]
            elif name == "receptacleatlocation":
                receptacle_at.setdefault(args[1], []).append(args[0])
            elif name == "inreceptacle":
                inside[args[0]] = args[1]
            elif name == "holds":
                holding.append(args[1])
            elif name == "opened":
                opened.append(args[0])
            elif name in ("isclean", "ishot", "iscool", "istoggled", "issliced"):
                states.setdefault(args[0], []).append(name[2:])
        here = receptacle_at.get(at.get("agent1", ""), [])
        ref = self._game
        state = {
            "game": self._game_key, "split_base": ref.base if ref else "", "task_type": ref.task_type if ref else "",
            "goal": self._goal, "location": here[0] if here else "middle of the room",
            "inventory": sorted(holding), "object_locations": dict(sorted(inside.items())),
            "open_receptacles": sorted(opened), "object_states": {k: sorted(v) for k, v in sorted(states.items())},
            "won": bool(self._state.get("won")), "admissible_commands": list(self._state.get("admissible", [])),
            "facts": [" ".join(f) for f in world],
        }
        if self.config["expert"]:
            state["expert_action"] = self._state.get("expert_action", "")
        relations = [f"the agent is at the {state['location']}"]
        relations += [f"the agent holds the {o}" for o in state["inventory"]]
        relations += [f"the {o} is in the {r}" for o, r in state["object_locations"].items()]
        relations += [f"the {r} is open" for r in state["open_receptacles"]]
        relations += [f"the {o} is {s}" for o, ss in state["object_states"].items() for s in ss]
        return GroundTruth(state, relations)

    def anchor_data(self) -> Any:
        # The world facts identify the state; what the agent has looked at does not.
        return "\x1f".join([self._game_key, *("\x1e".join(f) for f in self._world_facts())])

    def valid_actions(self) -> list[str]:
        return [] if self._done else list(self._state.get("admissible", []))
