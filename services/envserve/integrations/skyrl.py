"""envserve environments for SkyRL: a `skyrl_gym` BaseTextEnv over one envserve session.

SkyRL's contract, as of skyrl-gym 0.4.0 (and skyrl-train's SkyRLGymGenerator, which drives it in
training): for every trajectory the generator makes a fresh env with
`skyrl_gym.make(env_class, env_config=<the config's environment.skyrl_gym.<env_class>>, extras=<the
dataset row's other columns, plus max_turns=generator.max_turns>)`, calls `init(prompt)` with the row's
chat messages and gets back (the chat the model sees first, metadata), then alternates generation and
`step(model_text)`, which returns a dict: observations (chat messages appended after the model's
turn), reward (of that turn), done, metadata, and an optional postprocessed_action. When done it reads
`get_metrics()` (averaged over episodes by `aggregate_metrics`) and calls `close()`. Steps run in a
thread pool, many trajectories at once.

    from envserve.integrations.skyrl import register
    register("127.0.0.1:50051", ["sokoban", "frozenlake"])    # env classes envserve-sokoban, envserve-frozenlake
    register(None, ["sokoban"])       # in a Ray task, no address: the cluster's fleet (ray://)
    # dataset rows: {"prompt": [...], "env_class": "envserve-sokoban", "seed": 3}
    env = skyrl_gym.make("envserve-sokoban", env_config={}, extras={"seed": 3, "max_turns": 30})

Settings (address, env_id, config, action_format, token, timeout, include_rules, tls,
root_certificates, stream, recovery) come from `register(...)` and can be overridden by the env_config SkyRL passes.
`address` is one replica's address, several (a list, or a string joined by commas) or a directory
URL (`redis://host:6379/0`, `ray://`). Left out (None), it is ENVSERVE_ADDRESS, else, in a process of
a Ray cluster, `ray://`: the replicas of an `envserve.ray` fleet on that cluster. It is resolved
where each env is made, so `register()` with no address in skyrl-train's entrypoint (a Ray task,
where custom envs are registered and made) reaches the fleet from every env. Each env's session goes
to the least-loaded replica, and a session whose replica died or drained is rebuilt on a live one by
replaying its history (`recovery=False`: the episode ends instead). Steps travel on one Interact stream per replica and process (`stream=False`:
a unary Step each). `extras` (the row) gives the episode: `seed`, `task_id` or `split`, at its top level or under
`extra_info`; `max_turns` there (SkyRL's generator always sets it) ends the episode after that many
steps, on top of the env's own limit. The session is opened when the env is made (a bad config or
action format is a ValueError then), reset by `init`, closed by `close` (and when the env is
garbage-collected). The model's text goes to Step as is: the session's action format parses it, so
invalid answers are rewarded as the env rewards them, not raised. A lost session or a replica that is
gone ends the episode: a done step with the error under metadata["error"].
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from envserve.client import RecoverySettings
from envserve.client.experts import plain_answer

from ._common import Endpoint, Outcome, Session, first_text, plain_dict, resolve_target, row_reset_args, step_info

ENTRY_POINT = "envserve.integrations.skyrl:EnvServeTextEnv"
_SETTINGS = ("address", "env_id", "config", "action_format", "token", "timeout", "include_rules",
             "root_certificates", "tls", "stream", "recovery")


class EnvServeTextEnv(BaseTextEnv):
    """One envserve session as a SkyRL text env (see the module's docstring for the contract).

    env_config and extras are SkyRL's; the keyword arguments are the defaults `register` stores, which
    env_config overrides. Required in the end: env_id, and an address unless ENVSERVE_ADDRESS or a
    Ray cluster gives one (see the module's docstring)."""

    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None, **defaults: Any):
        super().__init__()
        unknown = sorted(set(defaults) - set(_SETTINGS))
        if unknown:
            raise ValueError(f"unknown envserve settings {unknown}; known: {list(_SETTINGS)}")
        cfg = {**defaults, **{k: v for k, v in plain_dict(env_config, "env_config").items()
                              if k in _SETTINGS}}
        self.extras = plain_dict(extras, "extras")
        if not cfg.get("env_id"):
            raise ValueError("envserve's SkyRL env needs 'env_id' (from register(...) or env_config)")
        address = resolve_target(cfg.get("address"), "envserve's SkyRL env (`address` from register(...) or env_config)")
        action_format = str(cfg.get("action_format") or "no_think")
        plain_answer(action_format, ["x"])  # an unknown format is a ValueError here
        endpoint = Endpoint(address, cfg.get("token"), cfg.get("timeout", 60.0),
                            cfg.get("root_certificates"), bool(cfg.get("tls", False)), bool(cfg.get("stream", True)),
                            cfg.get("recovery", True))
        self.env_id = str(cfg["env_id"])
        self.session = Session(endpoint, self.env_id, plain_dict(cfg.get("config"), "config"), action_format)
        self.session.open()  # unknown config keys, bad values, formats the env refuses: ValueError now
        self.include_rules = bool(cfg.get("include_rules", True))
        seed, self.task_id, self.split = row_reset_args(self.extras, plain_dict(self.extras.get("extra_info"),
                                                                                "extra_info"))
        self.seed = seed
        env_turns = int(self.session.settings().get("max_turns") or 0)
        # SkyRL's limit, where the row (the generator) gives one, on top of the env's own.
        limit = self.extras.get("max_turns")
        self.max_turns = int(limit) if limit is not None else env_turns
        self.episode_return = 0.0
        self.success = False
        self.invalid_actions = 0
        self.done = False
        self.last: Outcome | None = None

    @property
    def session_id(self) -> str:
        return self.session.id

    def init(self, prompt: Sequence[Mapping[str, Any]] | None) -> tuple[list[dict], dict[str, Any]]:
        """Resets the session (the row's seed, task id or split) and returns the prompt with the env's
        rules and first observation added to its last user message (or as a new user message)."""
        result = self.session.reset(self.seed, self.task_id, self.split)
        self.turns, self.episode_return, self.success, self.invalid_actions, self.done = 0, 0.0, False, 0, False
        text = first_text(self.session.system_prompt if self.include_rules else "", result)
        chat = [dict(m) for m in (prompt or [])]
        if chat and chat[-1].get("role") == "user" and isinstance(chat[-1].get("content"), str):
            chat[-1]["content"] = f"{chat[-1]['content'].rstrip()}\n\n{text}" if chat[-1]["content"].strip() else text
        else:
            chat.append({"role": "user", "content": text})
        return chat, {"session_id": self.session.id, "env_id": self.env_id, "seed": self.seed,
                      "turn": int(result.turn), "max_turns": self.max_turns}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """The model's whole turn, as is, to Step. Observations: the step's text as a user message,
        none once the episode is over."""
        if self.done:
            return BaseTextEnvStepOutput(observations=[], reward=0.0, done=True, postprocessed_action=None,
                                         metadata={"turn": self.turns, "error": "the episode is over"})
        self.turns += 1
        outcome = self.last = self.session.step(action)
        metadata = step_info(outcome)
        metadata["turn"] = self.turns
        self.episode_return += outcome.reward
        if outcome.result is not None:
            self.success = bool(outcome.result.success)
            self.invalid_actions += not outcome.result.action_valid
        turn_limit = bool(self.max_turns) and self.turns >= self.max_turns
        self.done = outcome.ended or turn_limit
        if turn_limit and not outcome.ended:
            metadata["truncated"] = True
        observations = [] if self.done else [{"role": "user", "content": outcome.text()}]
        return BaseTextEnvStepOutput(observations=observations, reward=outcome.reward, done=self.done,
                                     metadata=metadata, postprocessed_action=None)

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns, "return": self.episode_return, "success": self.success,
                "invalid_actions": self.invalid_actions}

    def close(self) -> None:
        """Closes the session on the server (never raises; a second close does nothing)."""
        self.session.close()


def env_class_name(env_id: str, prefix: str = "envserve-") -> str:
    return prefix + re.sub(r"[^A-Za-z0-9_.-]+", "-", env_id)


def register(address: "str | Sequence[str] | None" = None, env_ids: "str | Sequence[str] | None" = None, *, prefix: str = "envserve-",
             config: Mapping[str, Any] | None = None, action_format: str = "no_think", token: str | None = None,
             timeout: float | None = 60.0, include_rules: bool = True, tls: bool = False,
             root_certificates: "str | None" = None, stream: bool = True,
             recovery: "bool | RecoverySettings" = True) -> list[str]:
    """Registers `prefix + env_id` with skyrl_gym for each env (all the replica serves when env_ids is
    None), so `skyrl_gym.make("envserve-sokoban", env_config=..., extras=...)` and dataset rows with
    that env_class work. The settings given here are the defaults; SkyRL's env_config overrides them.
    Registering an id again with the same settings does nothing; with other settings it replaces
    them. An address of None is stored as such and resolved where each env is made (ENVSERVE_ADDRESS,
    else `ray://` inside a Ray cluster); here it is resolved to check the envs. Returns the ids."""
    import skyrl_gym
    from skyrl_gym.envs.registration import deregister, registry

    if isinstance(env_ids, str):
        env_ids = [env_ids]
    endpoint = Endpoint(resolve_target(address, "envserve's SkyRL register(address)"), token, timeout,
                        root_certificates, tls, stream, recovery)
    if env_ids is None:
        env_ids = [spec.env_id for spec in endpoint.client().list_envs()]
    ids = []
    for env_id in env_ids:
        endpoint.spec(env_id)  # an env the replica does not serve: ValueError
        kwargs = dict(address=address, env_id=env_id, config=dict(config or {}), action_format=action_format,
                      token=token, timeout=timeout, include_rules=include_rules, tls=tls,
                      root_certificates=root_certificates, stream=stream, recovery=recovery)
        name = env_class_name(env_id, prefix)
        old = registry.get(name)
        if old is not None and old.entry_point != ENTRY_POINT:
            raise ValueError(f"{name!r} is registered with skyrl_gym for {old.entry_point!r}; pass another prefix")
        if old is not None and old.kwargs != kwargs:
            deregister(name)
            old = None
        if old is None:
            skyrl_gym.register(id=name, entry_point=ENTRY_POINT, kwargs=kwargs)
        ids.append(name)
    return ids


__all__ = ["EnvServeTextEnv", "register", "env_class_name"]
