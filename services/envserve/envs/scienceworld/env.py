"""ScienceWorld (Wang et al. 2022): 30 text-simulated science task types, from the PyPI package
`scienceworld`, whose Scala simulator runs in a JVM reached through py4j. A JVM hosts up to
`sessions_per_jvm` sessions of its worker, each its own simulator object (the package's
PythonInterface, several per JVM): one JVM costs about 190 MiB with its first simulator and
15-20 MiB for each further one, so 8 per JVM hold a session in about 35 MiB. A JVM that dies loses
its own sessions (DATA_LOSS; their next reset gets a place in a live JVM), never another JVM's;
a JVM whose sessions have all closed ends. `sessions_per_jvm: 1` gives each session its own JVM.

Seeds map to (task type, variation) through the RLVMR splits: L0 = the package's train
variations of the seen task types, L1 = their unseen (test) variations, L2 = the held-out task
types (by default the last type of each topic). Split k owns seeds [k * SPLIT_STRIDE, ...);
the mapping reads variations.json (the package's own lists), so it needs no JVM and is the same
in every process.
"""
from __future__ import annotations

import functools
import re
import threading
from typing import Any, Mapping

from envserve.core.env import ActionOutcome, Environment, EnvSpec, GroundTruth, Split, TaskDescription
from envserve.core.session import SessionError

from .catalog import load_catalog

SPLIT_STRIDE = 1_000_000
SPLIT_NAMES = ("L0", "L1", "L2")
_NO_MATCH = "No known action matches that input."
_AMBIGUOUS = "Ambiguous request"
_LOCATION = re.compile(r"called the (.+?)\.")
# A gold path answers the simulator's "which object did you mean?" question with a bare number.
_CHOICE = re.compile(r"\d+")

SYSTEM_PROMPT = """You are an agent in ScienceWorld, a text-based simulation of a house, a greenhouse, a workshop, a foundry and the outdoors, where you do elementary-school science tasks (boiling and melting substances, measuring temperatures, building electrical circuits, growing plants, mixing chemicals, genetics, friction on inclined planes...).
Each observation starts with your task, then says what your last action did.
Actions are short commands, one per answer, for example:
look around | look at OBJ | look in OBJ | go to LOC | open OBJ | close OBJ | pick up OBJ | put down OBJ | move OBJ to OBJ | pour OBJ into OBJ | mix OBJ | activate OBJ | deactivate OBJ | use OBJ on OBJ | connect OBJ to OBJ | disconnect OBJ | eat OBJ | flush OBJ | dunk OBJ into OBJ | read OBJ | inventory | task | wait | wait1 | focus on OBJ
"focus on OBJ" tells the simulator which object your task is about: focusing on the wrong object ends the task as failed.
The reward of an action is the change of your task score (0 to 100); the task succeeds when it is completed."""


def _tasks_by_split(heldout: frozenset[str], variation_sets: Mapping[str, str]) -> dict[str, list[tuple[str, int]]]:
    """Every split's (task name, variation) pairs, in the package's task order."""
    out: dict[str, list[tuple[str, int]]] = {name: [] for name in SPLIT_NAMES}
    for t in load_catalog()["tasks"]:
        held = t["task_id"] in heldout
        for split in (("L2",) if held else ("L0", "L1")):
            which = variation_sets[split]
            variations = t["train"] + t["dev"] + t["test"] if which == "all" else t[which]
            out[split] += [(t["name"], v) for v in variations]
    return out


def _last_task_of_each_topic() -> str:
    last: dict[str, str] = {}
    for t in load_catalog()["tasks"]:
        last[t["topic"]] = t["task_id"]
    return ",".join(last.values())


_DEFAULTS = {
    # RLVMR's L2: the last task type of each of the 10 topics is never trained on.
    "heldout_tasks": _last_task_of_each_topic(),
    "l0_variations": "train",
    "l1_variations": "test",
    "l2_variations": "test",
    "simplifications": "",
    "reward_scale": 1.0,
    "heap_max_mb": 512,
    "sessions_per_jvm": 8,
    "expert": False,
}
_VARIATIONS = {"enum": ["train", "dev", "test", "all"]}
_BOUNDS = {
    # Comma-separated task ids ('1-4', 30 tasks): the whole list is under 200 characters.
    "heldout_tasks": {"maxLength": 256},
    "l0_variations": _VARIATIONS, "l1_variations": _VARIATIONS, "l2_variations": _VARIATIONS,
    # The package's six simplification names, comma-separated, fit in 128 characters.
    "simplifications": {"maxLength": 128},
    # The task score changes by at most 100 a step: at scale 10 a reward stays within +-1000.
    "reward_scale": {"minimum": 0.0, "maximum": 10.0},
    # A JVM's heap and how many sessions share it protect the worker's memory: a caller may give
    # a JVM less, never more. The heap in 64 MiB steps: JVMs are shared by (heap, sessions_per_jvm),
    # so every distinct value is another JVM.
    "heap_max_mb": {"minimum": 64, "maximum": _DEFAULTS["heap_max_mb"], "multipleOf": 64},
    "sessions_per_jvm": {"minimum": 1, "maximum": _DEFAULTS["sessions_per_jvm"]},
}
_DEFAULT_SPLITS = _tasks_by_split(frozenset(_DEFAULTS["heldout_tasks"].split(",")),
                                  {"L0": "train", "L1": "test", "L2": "test"})
_SPLIT_DOCS = {"L0": "seen variations of seen task types", "L1": "unseen variations of seen task types",
               "L2": "held-out task types"}


@functools.lru_cache(maxsize=1)
def _task_titles() -> dict[str, tuple[str, str]]:
    """Task name -> (topic, title) from the package's task list (no JVM): "boil" -> ("Matter",
    "Changes of State (Boiling)")."""
    from scienceworld.constants import TASKS
    return {t["task_name"]: (t["topic"], t["task"]) for t in TASKS}


class _Jvm:
    """One JVM with its py4j gateway, and how many sessions hold a simulator in it."""

    def __init__(self, heap_mb: int) -> None:
        from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
        from scienceworld.constants import BASEPATH, JAR_PATH
        # The package's ScienceWorldEnv cannot pass JVM options, so the gateway is launched here
        # the same way (die_on_exit: the JVM ends with this process's stdin pipe) plus a bounded
        # heap; the serial GC because a JVM should not run a GC thread per core.
        port, self.proc = launch_gateway(classpath=JAR_PATH, die_on_exit=True, cwd=BASEPATH, return_proc=True,
                                         javaopts=[f"-Xmx{heap_mb}m", "-XX:+UseSerialGC"])
        self.gateway = JavaGateway(gateway_parameters=GatewayParameters(auto_field=True, port=port),
                                   java_process=self.proc)
        self.sessions = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        try:
            self.gateway.shutdown()
        except Exception:  # noqa: BLE001 - the JVM may already be gone
            pass
        if self.proc.poll() is None:
            try:
                # die_on_exit: the JVM exits on a line on its stdin (py4j#320).
                self.proc.stdin.write(b"\n")
                self.proc.stdin.flush()
                self.proc.wait(5)
            except Exception:  # noqa: BLE001 - it did not exit: make sure no JVM outlives its sessions
                self.proc.kill()
                self.proc.wait()


# This worker's JVMs by (heap, sessions per JVM): sessions asking for other limits never share one.
_JVMS: dict[tuple[int, int], list[_Jvm]] = {}
_JVMS_LOCK = threading.Lock()


def _take_jvm(heap_mb: int, per_jvm: int) -> _Jvm:
    """A place in a live JVM with room, or a new JVM."""
    key = (heap_mb, per_jvm)
    with _JVMS_LOCK:
        jvms = _JVMS.setdefault(key, [])
        jvms[:] = [j for j in jvms if j.alive() or j.sessions > 0]
        for j in jvms:
            if j.alive() and j.sessions < per_jvm:
                j.sessions += 1
                return j
        j = _Jvm(heap_mb)
        j.sessions = 1
        jvms.append(j)
        return j


def _give_back(jvm: _Jvm, heap_mb: int, per_jvm: int) -> None:
    """A session leaves its JVM; the last one out ends it."""
    with _JVMS_LOCK:
        jvm.sessions -= 1
        if jvm.sessions > 0:
            return
        jvms = _JVMS.get((heap_mb, per_jvm), [])
        if jvm in jvms:
            jvms.remove(jvm)
    jvm.stop()


def _java_gone(e: BaseException) -> bool:
    from py4j.protocol import Py4JNetworkError
    return isinstance(e, (Py4JNetworkError, ConnectionError, OSError))


class ScienceWorldEnv(Environment):
    spec = EnvSpec(
        env_id="scienceworld",
        description="ScienceWorld: 30 science task types with their variations, from the scienceworld "
                    "package's JVM simulator; RLVMR splits L0/L1/L2. Text only: no image observation.",
        system_prompt=SYSTEM_PROMPT,
        action_space="a ScienceWorld command, e.g. look around, go to kitchen, pick up thermometer, focus on water",
        # RLVMR: 30 steps, one action per turn.
        max_turns=30,
        max_actions_per_turn=1,
        config_defaults=_DEFAULTS,
        config_bounds=_BOUNDS,
        config_docs={
            "heldout_tasks": "comma-separated task ids (tasks.json, e.g. '1-4') of split L2; the others make L0/L1",
            "l0_variations": "the package's variation list for L0: train, dev, test or all",
            "l1_variations": "the package's variation list for L1: train, dev, test or all",
            "l2_variations": "the package's variation list for L2: train, dev, test or all",
            "simplifications": "the package's simplification string, e.g. 'easy' or 'openDoors,teleportAction'",
            "reward_scale": "reward = scale * change of the task score (0-100)",
            "heap_max_mb": "maximum Java heap of a JVM (-Xmx), in MiB, shared by the sessions it hosts",
            "sessions_per_jvm": "sessions one JVM hosts at most (each its own simulator); a dead JVM loses these",
            "expert": "load the task with the package's gold path: the state endpoint tells its next action "
                      "(expert_action) and the rest of it (gold_path) while the episode follows it",
        },
        splits=tuple(Split(name, f"{_SPLIT_DOCS[name]}: {len(_DEFAULT_SPLITS[name])} (task, variation) pairs "
                                 f"with the default config, seeds from {k * SPLIT_STRIDE:.0e}",
                           k * SPLIT_STRIDE, len(_DEFAULT_SPLITS[name]))
                     for k, name in enumerate(SPLIT_NAMES)),
        default_action_format="free_think",
        # The simulator's state lives in the JVM: forks replay (seed, actions).
        supports_snapshot=False,
        # A py4j call stopped part way would leave its answer unread on the JVM's socket.
        interruptible=False,
    )

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        c = self.config
        known = {t["task_id"] for t in load_catalog()["tasks"]}
        heldout = frozenset(x.strip() for x in c["heldout_tasks"].split(",") if x.strip())
        if heldout - known:
            raise ValueError(f"unknown task ids {sorted(heldout - known)}; known: {sorted(known)}")
        sets = {s: c[f"{s.lower()}_variations"] for s in SPLIT_NAMES}
        self._splits = _tasks_by_split(heldout, sets)
        if not all(self._splits.values()):
            raise ValueError("every split needs at least one task type")
        self._scale = float(c["reward_scale"])
        self._jvm: _Jvm | None = None
        self._proc = self._server = None
        self._lost = ""
        self._start_jvm()
        self._task = ("", -1)
        self._obs = ""
        self._desc = ""
        self._score = 0
        self._done = self._success = False
        self._truth: GroundTruth | None = None
        self._valid: list[str] | None = None
        self._gold: list[str] = []
        self._gold_pos = 0
        self._on_gold = False

    # -- the JVM -----------------------------------------------------------------------
    def _start_jvm(self) -> None:
        """A simulator of this session's own in a shared JVM (a new JVM when none has room)."""
        c = self.config
        self._jvm = _take_jvm(int(c["heap_max_mb"]), int(c["sessions_per_jvm"]))
        self._proc = self._jvm.proc
        try:
            self._server = self._jvm.gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
        except Exception:
            self.close()
            raise

    @property
    def java_pid(self) -> int:
        return self._proc.pid if self._proc else -1

    def _call(self, method: str, *args):
        """One call into the simulator. A dead JVM loses the sessions it hosts, each on its next
        call: DATA_LOSS, which clients raise as SessionLostError, as for a dead worker."""
        if self._lost:
            raise SessionError("DATA_LOSS", self._lost)
        try:
            return getattr(self._server, method)(*args)
        except Exception as e:
            from py4j.protocol import Py4JJavaError
            if isinstance(e, Py4JJavaError) and self._proc.poll() is None:
                raise  # a simulator exception with a live JVM: the caller decides
            code = self._proc.poll()
            self._lost = (f"session lost: the ScienceWorld JVM (pid {self._proc.pid}) "
                          f"{'exited with code ' + str(code) if code is not None else 'stopped answering'} "
                          f"({type(e).__name__}); its episode is gone: reset the session (it gets a place "
                          f"in a live JVM) or open a new one")
            self.close()
            raise SessionError("DATA_LOSS", self._lost) from None

    def close(self) -> None:
        jvm, server = self._jvm, self._server
        self._jvm = self._server = None
        if jvm is None:
            return
        if server is not None and jvm.alive():
            try:
                jvm.gateway.detach(server)   # the JVM may collect this session's simulator now
            except Exception:  # noqa: BLE001 - the JVM may be going away
                pass
        c = self.config
        _give_back(jvm, int(c["heap_max_mb"]), int(c["sessions_per_jvm"]))

    # -- episodes ----------------------------------------------------------------------
    @classmethod
    def describe_task(cls, spec, seed: int) -> TaskDescription:
        """The task name and variation a seed starts under the default splits (no JVM)."""
        pairs = _DEFAULT_SPLITS[SPLIT_NAMES[(seed // SPLIT_STRIDE) % len(SPLIT_NAMES)]]
        task, variation = pairs[(seed % SPLIT_STRIDE) % len(pairs)]
        topic, title = _task_titles().get(str(task), ("", str(task)))
        # The variation's own goal text comes from the simulator when it loads the task.
        return TaskDescription(description=f"{title}, variation {variation}" + (f" ({topic})" if topic else ""),
                               task_type=str(task), parameters={"variation": int(variation)})

    def task_of_seed(self, seed: int) -> tuple[str, int]:
        """(task name, variation) of a seed: split by seed range, then an index into its list."""
        pairs = self._splits[SPLIT_NAMES[(seed // SPLIT_STRIDE) % len(SPLIT_NAMES)]]
        return pairs[(seed % SPLIT_STRIDE) % len(pairs)]

    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        if self._lost:
            # The JVM died: a new episode gets a place in a live JVM.
            self._lost = ""
            self._start_jvm()
        self._task = self.task_of_seed(int(seed or 0))
        expert = bool(self.config["expert"])
        self._call("load", self._task[0], self._task[1], str(self.config["simplifications"]), expert)
        # Read before the first step: the path is planned from the loaded state.
        self._gold = [str(a) for a in self._call("getGoldActionSequence")] if expert else []
        self._gold_pos, self._on_gold = 0, expert
        # As the package's reset(): the first observation is a "look around" (it costs no move).
        self._obs = self._call("step", "look around")
        self._desc = self._call("getTaskDescription")
        self._score = 0
        self._done = self._success = False
        self._truth = self._valid = None

    def step(self, action: str) -> ActionOutcome:
        if self._done:
            return ActionOutcome(valid=False, feedback="The episode is over; reset the environment.")
        from py4j.protocol import Py4JJavaError
        on_gold = self._follow_gold(action)
        try:
            obs = self._call("step", action)
            feedback = ""
            if obs.startswith(_AMBIGUOUS):
                # The simulator asks which object was meant; take its first reading, as agents
                # given one action per turn cannot answer the question. On the gold path, take
                # the reading the path answers with, as its next entry.
                feedback = "Ambiguous action; the first matching object was used."
                obs = self._call("step", self._gold_choice() if on_gold else "0")
            self._skip_gold_choices()
        except Py4JJavaError as e:
            return ActionOutcome(valid=False, feedback=f"The simulator rejected {action!r}: {e.java_exception}")
        self._truth = self._valid = None
        self._obs = obs
        if obs.strip() == _NO_MATCH:
            return ActionOutcome(valid=False, feedback=obs)
        score = int(round(100 * self._call("getScore")))
        completed = bool(self._call("getCompleted"))
        delta, self._score = score - self._score, score
        # A negative score is the package's failed task (e.g. focus on the wrong object): over.
        self._done = completed or score < 0
        self._success = completed and score >= 100
        reward = self._scale * delta
        return ActionOutcome(reward=reward, done=self._done, success=self._success, feedback=feedback,
                             components={"score": reward}, info={"score": score})

    # -- the gold path (config expert) ---------------------------------------------------
    def _follow_gold(self, action: str) -> bool:
        """Whether `action` is the gold path's next action; the first action off the path leaves it
        for the rest of the episode (its later entries assume the states the path went through)."""
        if not self._on_gold:
            return False
        pos = self._gold_pos
        if pos < len(self._gold) and " ".join(action.lower().split()) == " ".join(self._gold[pos].lower().split()):
            self._gold_pos = pos + 1
            return True
        self._on_gold = False
        return False

    def _gold_choice(self) -> str:
        pos = self._gold_pos
        if pos < len(self._gold) and _CHOICE.fullmatch(self._gold[pos].strip()):
            self._gold_pos = pos + 1
            return self._gold[pos].strip()
        return "0"

    def _skip_gold_choices(self) -> None:
        # A number in the path answers an ambiguity question; where this simulator asked none
        # (or step() already answered it), the number is not an action to take.
        gold = self._gold
        while self._on_gold and self._gold_pos < len(gold) and _CHOICE.fullmatch(gold[self._gold_pos].strip()):
            self._gold_pos += 1

    # -- observations --------------------------------------------------------------------
    def render_text(self) -> str:
        return f"{self._desc}\n\n{self._obs}"

    def ground_truth(self) -> GroundTruth:
        if self._truth is None:
            look = self._call("freeActionLook")
            inventory = self._call("freeActionInventory")
            m = _LOCATION.search(look)
            location = m.group(1) if m else ""
            items = [line.strip() for line in inventory.splitlines()[1:] if line.strip()]
            state = {
                "task": self._task[0], "variation": self._task[1], "task_description": self._desc,
                "location": location, "look": look, "inventory": items, "score": self._score,
                "completed": self._success, "moves": int(self._call("getNumMoves")),
                "goal_progress": self._call("getGoalProgressStr"),
            }
            if self.config["expert"]:
                on = self._on_gold and not self._done
                state["expert_action"] = self._gold[self._gold_pos] if on and self._gold_pos < len(self._gold) else ""
                state["gold_path"] = list(self._gold[self._gold_pos:]) if on else []
            relations = [f"the agent is in the {location}"] + [f"the agent has {i}" for i in items]
            self._truth = GroundTruth(state, relations)
        return self._truth

    def anchor_data(self) -> Any:
        # The place, what is seen and held, and the score identify the state; the move count
        # would make every step a new state.
        # Lines sorted: the simulator lists a room's objects in its JVM's hash order, which depends
        # on what else that JVM has loaded, so the same state can be listed in another order.
        s = self.ground_truth().state
        return "\x1f".join([s["task"], str(s["variation"]), *sorted(s["look"].splitlines()),
                            *sorted(s["inventory"]), str(s["score"])])

    def valid_actions(self) -> list[str]:
        """The simulator's valid action/object combinations (about 50 ms each state): only called
        when the session asks (include_valid_actions). Sorted: the JVM's order is a hash order."""
        if self._done:
            return []
        if self._valid is None:
            self._valid = sorted(set(self._call("getValidActionObjectCombinations")))
        return list(self._valid)
