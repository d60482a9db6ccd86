"""envserve environments for GEM (gem-llm, `import gem`): a `gem.Env` over one envserve session.

GEM's contract, as of gem-llm 0.1.0: text in, text out, gymnasium-style. `reset(seed=None)` returns
(observation, info); `step(action)` returns (observation, reward, terminated, truncated, info).
Environments are registered under ids of the form "namespace:Name" (GEM's own are "game:Sokoban-v0-easy",
"math:..."); `gem.make(id, **kwargs)` builds one from the registered keyword arguments with kwargs over
them. `gem.make_vec(ids, wrappers=..., async_mode=...)` builds a vector env (a for loop, or a thread
pool) and passes each env a `seed` keyword (seed + index); vector envs reset an env by themselves
(`reset()` with no seed) as soon as its episode ends. GEM's wrappers (gem.wrappers: observation
history, episode tracking, tools) wrap any Env. GEM ships no env checker.

    from envserve.integrations.gem import register
    register("127.0.0.1:50051", ["sokoban", "frozenlake"])     # ids envserve:sokoban, envserve:frozenlake
    env = gem.make("envserve:sokoban", seed=3)
    obs, info = env.reset()
    obs, reward, terminated, truncated, info = env.step("<answer>Up</answer>")

The model's text goes to Step as is (the session's action format parses it; invalid answers are the
env's feedback and reward, not exceptions). The first observation is the env's rules with the answer
format, then the board; each step's observation is the env's feedback, the new observation, the
reward and how the episode ended. `terminated` is the env's done, `truncated` its turn limit. A lost
session or a replica that is gone ends the episode as truncated, with the error in info["error"]; the
next reset opens a new session. Seeds: `reset(seed)` uses it; `reset()` uses the seed given to the
constructor the first time, then seeds drawn from the last one (so a vector env's episodes are
reproducible), or the server's choice when no seed was ever given.
"""
from __future__ import annotations

import random
from typing import Any, Mapping, Optional, Sequence

import gem
from gem.core import Env

from envserve.client import RecoverySettings
from envserve.client.experts import plain_answer

from ._common import Endpoint, Outcome, Session, action_choices, first_text, is_cell_space, plain_dict, step_info

ENTRY_POINT = "envserve.integrations.gem:EnvServeEnv"


class EnvServeEnv(Env):
    """One envserve session of `env_name` (envserve's env id: "sokoban") at `address` as a GEM
    environment. (`env_id` is GEM's: gem.make sets it to the registered id, "envserve:sokoban".)

    config and action_format are Open's (the session is opened here: an unknown config key, a bad
    value or a format the env refuses is a ValueError). seed: the first reset's seed (make_vec passes
    one per env). task_id / split: reset to that task or split instead of a seed. include_rules: the
    first observation starts with the env's rules and answer format.

    address: one replica's address, several (a list, or a string joined by commas) or a directory
    URL (`redis://host:6379/0`; None: ENVSERVE_ADDRESS, else `ray://` in a process of a Ray cluster):
    sessions go to the least-loaded replica. stream: steps travel on
    the replicas' Interact streams (False: a unary Step each). recovery: a session whose replica
    died or drained is rebuilt on a live one and the step answered as if nothing happened (False:
    the episode ends with the error; or RecoverySettings)."""

    def __init__(self, address: "str | Sequence[str]", env_name: str, config: Mapping[str, Any] | None = None,
                 action_format: str = "no_think", token: str | None = None, *, seed: Optional[int] = None,
                 task_id: str = "", split: str = "", include_rules: bool = True, timeout: float | None = 60.0,
                 root_certificates: "bytes | str | None" = None, tls: bool = False, stream: bool = True,
                 recovery: "bool | RecoverySettings" = True, _session: Session | None = None):
        super().__init__()
        plain_answer(action_format, ["x"])  # an unknown format is a ValueError here
        if seed is not None and not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self._kwargs = dict(address=address, env_name=env_name, config=plain_dict(config, "config"),
                            action_format=action_format, token=token, task_id=task_id, split=split,
                            include_rules=include_rules, timeout=timeout, root_certificates=root_certificates,
                            tls=tls, stream=stream, recovery=recovery)
        endpoint = Endpoint(address, token, timeout, root_certificates, tls, stream, recovery)
        self.session = _session or Session(endpoint, env_name, self._kwargs["config"], action_format)
        self.session.open()
        self.include_rules = include_rules
        self.task_id, self.split = task_id, split
        self._next_seed = seed
        self._rng = random.Random(seed)
        self.seed: Optional[int] = None
        self.done = _session is None   # a fork continues its origin's episode
        self.last: Outcome | None = None
        self.episode_return = 0.0

    @property
    def session_id(self) -> str:
        return self.session.id

    def reset(self, seed: Optional[int] = None) -> tuple[str, dict[str, Any]]:
        if seed is None:
            seed = self._next_seed
        if seed is not None:
            # The next seedless reset's seed, drawn from this one: reproducible episodes in a vector env.
            self._next_seed = random.Random(seed).randrange(2 ** 31)
            self._rng.seed(seed)
        self.seed = seed
        result = self.session.reset(seed, self.task_id, self.split)
        self.done, self.last, self.episode_return = False, None, 0.0
        info = {"session_id": self.session.id, "env": self.session.env_id, "seed": seed, "turn": int(result.turn)}
        return first_text(self.session.system_prompt if self.include_rules else "", result), info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.done:
            return ("The episode is over; reset to start another.", 0.0, True, False,
                    {"error": "the episode is over"})
        outcome = self.last = self.session.step(str(action))
        info = step_info(outcome)
        self.episode_return += outcome.reward
        self.done = outcome.ended
        if outcome.error is not None:
            return outcome.text(), 0.0, False, True, info
        r = outcome.result
        return outcome.text(), float(r.reward), bool(r.done), bool(r.truncated and not r.done), info

    def sample_random_action(self) -> str:
        """A random primitive action as an answer in the session's format (for env tests and baselines):
        one of the spec's listed actions, or a random cell for board envs."""
        spec = self.session.endpoint.spec(self.session.env_id)
        choices = action_choices(spec)
        if choices:
            return self.session.answer([self._rng.choice(choices)])
        if is_cell_space(spec):
            settings = self.session.settings()
            rows = int(settings.get("rows") or settings.get("size") or 8)
            cols = int(settings.get("cols") or settings.get("size") or rows)
            return self.session.answer([f"({self._rng.randrange(rows)}, {self._rng.randrange(cols)})"])
        raise NotImplementedError(f"{self.session.env_id}'s actions are free text ({spec.action_space!r})")

    def spawn(self, same_state: bool = False, **kwargs) -> "EnvServeEnv":
        """A new env with this one's settings (kwargs over them). same_state: a fork of this session
        in its exact state (the episode goes on from here in both)."""
        if same_state:
            if kwargs:
                raise ValueError("spawn(same_state=True) takes no settings: the fork keeps the session's")
            twin = EnvServeEnv(**self._kwargs, _session=self.session.fork())
            twin.done, twin.seed, twin.episode_return = self.done, self.seed, self.episode_return
            return twin
        return EnvServeEnv(**{**self._kwargs, **kwargs})

    def close(self) -> None:
        """Closes the session on the server (never raises). A later reset opens a new one."""
        self.session.close()


def env_id_for(env_id: str, prefix: str = "envserve:") -> str:
    return prefix + env_id


def register(address: "str | Sequence[str]", env_ids: "str | Sequence[str] | None" = None, *, prefix: str = "envserve:",
             **settings: Any) -> list[str]:
    """Registers `prefix + env_id` ("envserve:sokoban") with GEM for each env (every env the replica
    serves when env_ids is None); address as EnvServeEnv's; settings (config, action_format, token,
    include_rules, timeout, tls, root_certificates, stream, recovery...) are the defaults `gem.make` overrides. An id registered again with the same
    settings is left as is; with different ones it is a ValueError (GEM's registry refuses doubles).
    Returns the ids."""
    from gem.envs.registration import ENV_REGISTRY

    if isinstance(env_ids, str):
        env_ids = [env_ids]
    endpoint = Endpoint(address, settings.get("token"), settings.get("timeout", 60.0),
                        settings.get("root_certificates"), bool(settings.get("tls", False)),
                        bool(settings.get("stream", True)), settings.get("recovery", True))
    if env_ids is None:
        env_ids = [spec.env_id for spec in endpoint.client().list_envs()]
    ids = []
    for env_id in env_ids:
        endpoint.spec(env_id)  # an env the replica does not serve: ValueError
        name = env_id_for(env_id, prefix)
        kwargs = dict(address=address, env_name=env_id, **settings)
        old = ENV_REGISTRY.get(name)
        if old is None:
            gem.register(name, ENTRY_POINT, **kwargs)
        elif old.entry_point != ENTRY_POINT or old.kwargs != kwargs:
            raise ValueError(f"{name!r} is already registered with GEM with other settings; pass another prefix")
        ids.append(name)
    return ids


__all__ = ["EnvServeEnv", "register", "env_id_for"]
