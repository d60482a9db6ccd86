"""The ALFWorld text engine: TextWorld's PddlEnv with the alfworld package's wrappers, in a
process of its own per environment instance.

Why a process: the engine is not thread-safe (fast-downward's translator keeps module state,
each PddlEnv dlopen()s its own copy of a 33 MB planning library that nothing unloads) and a
parse error in it calls sys.exit. In a child process a crash loses one session, and closing
the session gives all of its memory back. `EngineClient` talks to it over a pipe; the child
runs `Engine`, which can also run inline (isolation="none").

Two memo caches make the package fast enough to serve, without changing what it computes:
the PDDL-to-SAS translation (a pure function of domain and problem text that PddlEnv runs
twice on load and twice again on every reset) and TextWorld's grammar-string parser (run for
every admissible command on every step). tests/integration/test_alfworld.py checks that
games play identically with and without them.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import random
import re
import signal
import socket
import subprocess
import sys
from typing import Any

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

    def generate(self, seed: int, task_type: str, floor_plans: list[int], root: str) -> str:
        """Generate (and check with the expert) a game here, in the engine's process."""
        from .generate import generate_solvable
        return generate_solvable(seed, task_type, floor_plans, root)[0]

    def close(self) -> None:
        if self._env is not None:
            _close_engine(self._env)
        self._env = None


def _serve(fd: int, caches: bool) -> None:
    """The child's loop: (op, args) in, ("ok", value) or ("error", text) out."""
    from multiprocessing.connection import Connection
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is for the server
    conn = Connection(fd)
    engine = Engine(caches=caches)
    conn.send(("ok", os.getpid()))
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            break
        if op == "exit":
            break
        try:
            conn.send(("ok", getattr(engine, op)(*args)))
        except BaseException as e:  # noqa: BLE001 - SystemExit from the translator included
            conn.send(("error", f"{type(e).__name__}: {e}"))
    # No interpreter teardown: dlclose()d planner copies make exit handlers crash.
    os._exit(0)


class EngineGone(Exception):
    """The engine process died or stopped answering."""


class EngineClient:
    """The session side: the same calls as Engine, answered by a child process.

    A fresh interpreter (about 1 s to import the engine), not a fork: the worker may hold
    threads or locks a fork would copy, and multiprocessing's fork server re-imports the
    caller's __main__, which scripts without a main guard do not survive."""

    def __init__(self, caches: bool = True, timeout: float = 300.0) -> None:
        from multiprocessing.connection import Connection
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from envserve.envs.alfworld.engine import _serve; "
             "_serve(int(sys.argv[1]), sys.argv[2] == '1')", str(theirs.fileno()), "1" if caches else "0"],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._timeout = timeout
        self._handshake()

    def _handshake(self) -> None:
        if not self._conn.poll(self._timeout):
            raise EngineGone("the engine process did not start")
        self._receive()

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc else -1

    def _receive(self):
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise EngineGone(self._why()) from None

    def _why(self) -> str:
        code = self._proc.poll() if self._proc else None
        return f"exited with code {code}" if code is not None else "stopped answering"

    def _call(self, op: str, *args) -> Any:
        try:
            self._conn.send((op, args))
        except (OSError, BrokenPipeError):
            raise EngineGone(self._why()) from None
        if not self._conn.poll(self._timeout):
            raise EngineGone(f"no answer in {self._timeout:.0f} s")
        status, value = self._receive()
        if status == "error":
            raise RuntimeError(value)
        return value

    def load(self, game_file: str, expert: bool) -> dict:
        return self._call("load", game_file, expert)

    def step(self, command: str) -> dict:
        return self._call("step", command)

    def generate(self, seed: int, task_type: str, floor_plans: list[int], root: str) -> str:
        return self._call("generate", seed, task_type, list(floor_plans), root)

    def close(self) -> None:
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        with contextlib.suppress(Exception):
            self._conn.send(("exit", ()))
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._conn.close()
