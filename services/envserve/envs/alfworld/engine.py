"""The ALFWorld text engine: TextWorld's PddlEnv with the alfworld package's wrappers, in a
process of its own per environment instance (core.child).

Why a process: the engine is not thread-safe (fast-downward's translator keeps module state,
each PddlEnv dlopen()s its own copy of a 33 MB planning library that nothing unloads) and a
parse error in it calls sys.exit. In a child process a crash loses one session, and closing
the session gives all of its memory back. `EngineClient` talks to it over a socket pair; the child
runs `Engine`, which can also run inline (isolation="none").

Two memo caches make the package fast enough to serve, without changing what it computes:
the PDDL-to-SAS translation (a pure function of domain and problem text that PddlEnv runs
twice on load and twice again on every reset) and TextWorld's grammar-string parser (run for
every admissible command on every step). tests/integration/test_alfworld.py checks that
games play identically with and without them.
"""
from __future__ import annotations

import copy
import functools
import os
import random
import re
import threading
from typing import Any, Callable

from envserve.core.child import ChildGone as EngineGone  # noqa: F401 - the name the env catches

from .generate import _close_engine, expert_seed

NOTHING_HAPPENS = "Nothing happens."
_CACHES_INSTALLED = False


def install_caches() -> None:
    """Memoize the two pure parsers the engine calls most (see the module docstring)."""
    global _CACHES_INSTALLED
    if _CACHES_INSTALLED:
        return
    import fast_downward
    from textworld.envs.pddl import textgen

    translate = fast_downward.pddl2sas

    @functools.lru_cache(maxsize=16)
    def _translated(domain: str, problem: str, verbose: bool, optimize: bool):
        return translate(domain, problem, verbose=verbose, optimize=optimize)

    def pddl2sas(domain, problem, verbose=False, optimize=False):
        return _translated(domain, problem, bool(verbose), bool(optimize))

    parse = textgen._parse_and_convert

    @functools.lru_cache(maxsize=4096)
    def _parsed(text: str, rule_name: str):
        return parse(text, rule_name=rule_name)

    def parse_and_convert(text, rule_name="symbols", trace=False, **kwargs):
        if trace or kwargs or not isinstance(text, str):
            return parse(text, rule_name=rule_name, trace=trace, **kwargs)
        # Symbols get their context assigned in place: hand out copies.
        return copy.deepcopy(_parsed(text, rule_name))

    fast_downward.pddl2sas = pddl2sas
    textgen._parse_and_convert = parse_and_convert
    _CACHES_INSTALLED = True


def normalize_command(text: str) -> str:
    """The engine matches commands exactly: lower-case and single spaces. `put X in/on Y`
    (ALFWorld up to 0.3, and most published prompts) is accepted for today's `move X to Y`."""
    command = " ".join(text.strip().lower().split())
    m = re.fullmatch(r"put (.+?) (?:in/on|in|on|into|onto) (.+)", command)
    if m:
        command = f"move {m.group(1)} to {m.group(2)}"
    return command


class Engine:
    """One loaded game: load, reset, step; every call answers the state the env needs."""

    def __init__(self, caches: bool = True) -> None:
        if caches:
            install_caches()
        self._env = None
        self._game_file = ""
        self._expert = None
        self._admissible: list[str] = []

    def load(self, game_file: str, expert: bool) -> dict:
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        from alfworld.agents.expert import HandCodedTWAgent
        from textworld import EnvInfos
        from textworld.envs import PddlEnv

        if self._env is None or game_file != self._game_file:
            self.close()
            env = AlfredInfos(AlfredDemangler(PddlEnv(EnvInfos(admissible_commands=True, won=True, facts=True))))
            env.load(game_file)
            self._env, self._game_file = env, game_file
        self._expert = HandCodedTWAgent(max_steps=200) if expert else None
        # The handcoded expert draws from the global `random`: seed it per game, as generate.solve does.
        random.seed(expert_seed(game_file))
        state = self._env.reset()
        if self._expert is not None:
            self._expert.reset(game_file)
            self._expert.observe(state["feedback"])
        return self._answer(state, valid=True, expert_action="look" if self._expert else "")

    def step(self, command: str) -> dict:
        command = normalize_command(command)
        valid = command in self._admissible
        state, _, _ = self._env.step(command)
        return self._answer(state, valid=valid, expert_action=self._expert_next(state, command))

    def _expert_next(self, state, command: str) -> str:
        """What alfworld's handcoded expert would do now (its AlfredExpert wrapper's rule), or ""
        once it has given up; its failure never fails the step."""
        if self._expert is None:
            return ""
        try:
            action = self._expert.act(state, 0, state["won"], command)
        except Exception:  # noqa: BLE001 - HandCodedAgentFailed/Timeout: no advice any more
            self._expert = None
            return ""
        return action if action in state["admissible_commands"] else "look"

    def _answer(self, state, valid: bool, expert_action: str) -> dict:
        self._admissible = list(state["admissible_commands"])
        # [predicate, argument names]: demangled names ("apple 1", "loc 3", "agent1").
        facts = sorted([f.name, *(a.name.strip() for a in f.arguments)] for f in state["facts"])
        return {"feedback": state["feedback"], "admissible": self._admissible, "won": bool(state["won"]),
                "valid": valid, "facts": facts, "expert_action": expert_action}

    def warm(self, game_file: str) -> None:
        """In a template engine: play a game's load once and drop it, so that what every load
        builds alike (parsed grammar, the logic, the planner's code) is there, frozen, before
        sessions' engines are forked from this one."""
        import gc
        self.load(game_file, False)
        self.close()
        self._game_file = ""
        gc.collect()
        gc.freeze()

    def generate(self, seed: int, task_type: str, floor_plans: list[int], root: str) -> str:
        """Generate (and check with the expert) a game here, in the engine's process."""
        from .generate import generate_solvable
        return generate_solvable(seed, task_type, floor_plans, root)[0]

    def close(self) -> None:
        if self._env is not None:
            _close_engine(self._env)
        self._env = None


# The planner library an engine process loads from the package's own file (share_planner_library).
_SHARED_PLANNER: dict[str, Any] = {"lib": None}


def share_planner_library() -> None:
    """For a process that plays one game at a time: each PddlEnv's planner library is the package's
    file itself, not a private copy (fast_downward.load_lib copies the 33 MB library per PddlEnv so
    that several can plan side by side in one process; per session those copies were a third of
    its memory, and a shared file's pages are shared by every engine on the machine). A second
    PddlEnv while the first is alive (a game generated beside a loaded one) gets a private copy."""
    import types

    import fast_downward
    from fast_downward import interface

    if getattr(fast_downward.load_lib, "shares_planner", False):
        return
    private_copy = fast_downward.load_lib

    def load_lib():
        if _SHARED_PLANNER["lib"] is not None:
            return private_copy()
        # load_lib copies the file, then loads the copy: a link to the file instead makes the
        # loader find the library it already has (same file), whose state PddlEnv resets per game.
        real = interface.shutil
        interface.shutil = types.SimpleNamespace(copyfile=os.symlink)
        try:
            lib = private_copy()
        finally:
            interface.shutil = real
        _SHARED_PLANNER["lib"] = lib
        return lib

    load_lib.shares_planner = True
    fast_downward.load_lib = load_lib


def release_planner(lib) -> None:
    """The PddlEnv holding the shared library has been closed: the next one may take it."""
    if lib is not None and lib is _SHARED_PLANNER["lib"]:
        _SHARED_PLANNER["lib"] = None


def _serve(fd: int, caches: str) -> None:
    """The child: core.child's loop over an Engine (caches arrives as "1" or "0")."""
    from envserve.core.child import serve
    share_planner_library()
    engine = Engine(caches=caches == "1")
    serve(fd, lambda op, args: getattr(engine, op)(*args))


def warm_imports() -> None:
    """What Engine.load imports, imported ahead: a template's copies then share these pages."""
    import alfworld.agents.environment.alfred_tw_env  # noqa: F401
    import alfworld.agents.expert  # noqa: F401
    import textworld.envs  # noqa: F401


def _serve_template(fd: int, caches: str) -> None:
    """A template engine: imports done, no game; sessions' engines are forks of it."""
    import gc
    warm_imports()
    # What is imported now stays shared with the copies only while no one writes to its pages:
    # frozen objects are not traversed (and so not written) by the copies' garbage collector.
    gc.collect()
    gc.freeze()
    _serve(fd, caches)


# This worker's template engines, by caches on/off (started on first use, replaced when dead).
_TEMPLATES: dict[bool, Any] = {}
_TEMPLATES_LOCK = threading.Lock()


def _warm(template, game_file: str, timeout: float) -> None:
    """Engine.warm in a template, once; best effort (a cold template still works, a dead one is
    replaced when the next engine is started)."""
    from envserve.core.child import ChildGone
    if getattr(template, "warmed", False):
        return
    template.warmed = True
    try:
        template.call("warm", game_file, timeout=timeout)
    except (ChildGone, RuntimeError):
        pass


class EngineClient:
    """The session side: the same calls as Engine, answered by an engine process (core.child's
    ChildProcess). `start` forks one from the worker's template engine (a few ms; the imported
    code's pages shared) or starts a fresh interpreter (about 1 s); `copies` leaves a frozen copy
    of this engine, game state included, that `connect` copies from. A dead or silent engine raises
    ChildGone (EngineGone here)."""

    def __init__(self, caches: bool = True, timeout: float = 300.0, child=None) -> None:
        """An engine in a fresh interpreter, or the given ChildProcess running one."""
        from envserve.core.child import ChildProcess
        self._timeout = timeout
        self._child = child or ChildProcess("envserve.envs.alfworld.engine:_serve", ("1" if caches else "0",),
                                            start_timeout=timeout, what="engine process")

    @classmethod
    def start(cls, caches: bool = True, template: bool = True, timeout: float = 300.0,
              warm_game: Callable[[], str] | None = None) -> "EngineClient":
        """An engine of its own: forked from the worker's template (started on first use, and
        warmed with the game file warm_game() names, if any, before its first copy) or,
        template=False, a fresh interpreter."""
        from envserve.core.child import ChildGone, ChildProcess
        if not template:
            return cls(caches, timeout)
        with _TEMPLATES_LOCK:
            for attempt in (0, 1):
                t = _TEMPLATES.get(caches)
                if t is None or not t.alive():
                    t = _TEMPLATES[caches] = ChildProcess(
                        "envserve.envs.alfworld.engine:_serve_template", ("1" if caches else "0",),
                        start_timeout=timeout, what="template engine process")
                if warm_game is not None and not getattr(t, "warmed", False):
                    path = warm_game()
                    if path:
                        _warm(t, path, timeout)
                try:
                    return cls(caches, timeout, child=t.fork(what="engine process", timeout=timeout))
                except ChildGone:
                    if attempt:
                        raise
                    _TEMPLATES.pop(caches, None)   # the template died: start another once

    @staticmethod
    def warm_template(caches: bool, game_file: str) -> None:
        """Has the worker's template engine load a game once (Engine.warm), the first time a game
        is loaded in this worker; later sessions' engines start warm. Best effort."""
        with _TEMPLATES_LOCK:
            t = _TEMPLATES.get(caches)
            if t is not None and t.alive():
                _warm(t, game_file, 300.0)

    @classmethod
    def connect(cls, address: str, timeout: float = 300.0) -> "EngineClient":
        from envserve.core.child import ChildProcess
        return cls(timeout=timeout, child=ChildProcess.connect(address, what="engine process",
                                                               timeout=min(timeout, 60.0)))

    def copies(self, ttl_s: float) -> str:
        return self._child.copies(ttl_s, timeout=self._timeout)

    @property
    def pid(self) -> int:
        return self._child.pid if self._child is not None else -1

    def _call(self, op: str, *args) -> Any:
        if self._child is None:
            raise EngineGone("the engine process was closed")
        return self._child.call(op, *args, timeout=self._timeout)

    def load(self, game_file: str, expert: bool) -> dict:
        return self._call("load", game_file, expert)

    def step(self, command: str) -> dict:
        return self._call("step", command)

    def generate(self, seed: int, task_type: str, floor_plans: list[int], root: str) -> str:
        return self._call("generate", seed, task_type, list(floor_plans), root)

    def close(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.close()
