"""envserve environments for verl (0.9): a multi-turn agent loop and a stateful tool.

Imported only where verl is installed (deploy/trainer/verl-venv.sh builds such a venv); envserve is
used through `envserve.client` only.

**The agent loop**, registered with verl's agent-loop registry as `envserve_agent`. verl builds one
per dataset row (hydra-instantiated with the trainer config, its LLM server client, the tokenizer and
processor) and awaits `run(sampling_params, **row)`. Each run is one episode in its own envserve
session: Open (the env's rules and answer format become the system message), Reset with the row's
seed, the first observation as the user message, then turn after turn: generate with verl's server
client (token ids in, token ids out), decode, Step, append the observation as a user turn. Prompt and
turns are tokenized by verl's own Continuous Token builder (the chat template's delta), so the
response mask is 1 on generated tokens and 0 on observation turns and the template's scaffolding. The
episode ends when the env says done or truncated, after `max_turns` turns, or when the response budget
(`actor_rollout_ref.rollout.response_length`) is spent. reward_score is the episode's summed env
reward; the session is closed at the end, also when anything fails. Observations with images (a
session with `render_image`) put them before the text as image blocks: verl's VL token builder
renders them through the model's processor (image pad tokens, mask 0 with the rest of the turn),
each generate call sends the conversation's images as `image_data`, and the output's
`multi_modal_data` holds them for the trainer. A model without a processor fails such a rollout.

Settings, in increasing precedence: the agent-loop entry of `agent_loop_config_path` (keys passed to
the constructor: address, env_id, env_config, action_format, max_turns, token, timeout, stream,
recovery, stats_scope), then the
dataset row (columns, or keys of its `extra_info`): env_id, env_config, action_format, seed, task_id,
split. The address may also come from the ENVSERVE_ADDRESS variable, the stats scope (the run's name
its finished episodes are counted under, GetTaskStats) from ENVSERVE_STATS_SCOPE. It is one replica's address,
several (a list, or a string joined by commas) or a directory URL (`redis://host:6379/0`, `ray://`).
With neither, inside a Ray cluster (verl's AgentLoopWorker is a Ray actor) it is `ray://`: the
replicas of an `envserve.ray` fleet on that cluster, started by the trainer's driver
(`Fleet(...).start()` after `ray.init()`) or by `envserve ray up`. Sessions go
to the least-loaded replica, and a session whose replica died or drained is rebuilt on a live one by
replaying its history (`recovery: false` ends the episode instead). Steps travel on one Interact stream
per replica and event loop, shared by the loop's rollouts (`stream: false`: a unary Step each).

    # agent_loops.yaml, named by actor_rollout_ref.rollout.agent.agent_loop_config_path
    - name: envserve_agent
      _target_: envserve.integrations.verl.EnvServeAgentLoop
      address: envserve:50051
      env_id: sokoban
      action_format: free_think
      max_turns: 8

**The tool** (`EnvServeTool`, a verl BaseTool, for tool-calling loops): `create` opens and resets a
session (seed from its kwargs), `execute` is one Step with the call's argument written as a minimal
answer in the session's format, `calc_reward` is the episode return, `release` closes the session. A step's images come in the
ToolResponse's `image`, which verl's ToolAgentLoop makes image blocks of the tool turn.

    # tools.yaml, named by actor_rollout_ref.rollout.multi_turn.tool_config_path
    tools:
      - class_name: envserve.integrations.verl.EnvServeTool
        config: {type: native, address: "envserve:50051", env_id: frozenlake}

**The sampler** (`EnvServeTaskSampler`): each batch of rows drawn where the run can learn, by the
outcome statistics of the stats scope the agent loop's sessions count under. verl 0.9 takes it as
`RayPPOTrainer(..., train_sampler=EnvServeTaskSampler(train_dataset, config.data))`; it has the
constructor of verl's pluggable samplers (`data.sampler.class_path` in the verl releases that read it).
"""
from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence
from uuid import uuid4

from torch.utils.data import Sampler

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op

from envserve.client import AsyncRoutedClient, EnvServeError, RecoverySettings, item_error
from envserve.client.recovery import SessionTable
from envserve.client.experts import plain_answer, session_settings

from ._common import (Endpoint, action_choices, content_blocks, error_text, feedback_and_observation, is_cell_space, pil_images,
                      resolve_target, step_text, target_key)

logger = logging.getLogger(__name__)

AGENT_NAME = "envserve_agent"

# One routed client per (event loop, target, settings): verl makes an agent loop per row, and a grpc
# aio channel (and the Interact streams on it) belongs to the loop it was made on; clients of a
# finished loop go with it. Every loop's client of a target shares one session table, so a session
# opened on one loop is routed, and rebuilt when lost, from any other.
_clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict]" = weakref.WeakKeyDictionary()
_tables: dict[tuple, SessionTable] = {}


def _client(address: "str | Sequence[str]", token: str | None, timeout: float | None, stream: bool = True,
            recovery: "bool | RecoverySettings" = True, stats_scope: str = "") -> AsyncRoutedClient:
    per_loop = _clients.setdefault(asyncio.get_running_loop(), {})
    key = (target_key(address), token, timeout, bool(stream), recovery, stats_scope)
    if key not in per_loop:
        client = per_loop[key] = AsyncRoutedClient(key[0], token=token, timeout=timeout, stream_steps=bool(stream),
                                                   recovery=recovery, stats_scope=stats_scope)
        client.sessions = _tables.setdefault(key, client.sessions)
    return per_loop[key]


def _plain(value: Any) -> Any:
    """Row values arrive as numpy scalars/arrays and config values as OmegaConf containers."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        pass
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


@dataclass
class EpisodeSettings:
    address: "str | tuple[str, ...]"
    env_id: str
    env_config: dict = field(default_factory=dict)
    action_format: str = ""
    max_turns: int = 0
    seed: Optional[int] = None
    task_id: str = ""
    split: str = ""
    token: Optional[str] = None
    timeout: Optional[float] = 60.0
    stream: bool = True
    recovery: Any = True
    stats_scope: str = ""


@register(AGENT_NAME)
class EnvServeAgentLoop(AgentLoopBase):
    """One envserve episode per verl rollout (see the module's doc)."""

    def __init__(self, *args, address: str | None = None, env_id: str | None = None,
                 env_config: Mapping[str, Any] | None = None, action_format: str = "", max_turns: int = 0,
                 token: str | None = None, timeout: float | None = 60.0, stream: bool = True,
                 recovery: "bool | RecoverySettings" = True, stats_scope: str = "", tools=None, **kwargs):
        # `tools` (verl's tool list) and `name` (the registry entry's) are verl's; this loop has no tools.
        kwargs.pop("name", None)
        super().__init__(*args, **kwargs)
        # Resolved per episode (resolve_target): the row may not need it, and ENVSERVE_ADDRESS or Ray decide then.
        self.defaults = dict(address=address, env_id=env_id or "",
                             env_config=dict(_plain(env_config) or {}), action_format=action_format or "",
                             max_turns=int(max_turns or 0), token=token, timeout=timeout, stream=stream,
                             recovery=recovery,
                             stats_scope=stats_scope or os.environ.get("ENVSERVE_STATS_SCOPE", ""))
        self.response_length = int(self.rollout_config.response_length)

    def settings(self, row: Mapping[str, Any]) -> EpisodeSettings:
        """The episode's settings: this loop's defaults, overridden by the row's columns, then by
        the keys of its extra_info."""
        s = dict(self.defaults)
        extra = _plain(row.get("extra_info")) or {}
        for source in (row, extra if isinstance(extra, Mapping) else {}):
            for key in ("env_id", "env_config", "action_format", "max_turns", "seed", "task_id", "split"):
                if key in source and source[key] is not None:
                    s[key] = _plain(source[key])
        if not s["env_id"]:
            raise ValueError("EnvServeAgentLoop needs an env_id: set it in the agent loop's config entry or in "
                             "the dataset row")
        address = resolve_target(s["address"], "EnvServeAgentLoop (`address` in its agent-loop entry)")
        seed = s.get("seed")
        return EpisodeSettings(
            address=address, env_id=str(s["env_id"]), env_config=dict(s.get("env_config") or {}),
            action_format=str(s.get("action_format") or ""), max_turns=int(s.get("max_turns") or 0),
            seed=None if seed is None or seed == "" else int(seed), task_id=str(s.get("task_id") or ""),
            split=str(s.get("split") or ""), token=s.get("token"), timeout=s.get("timeout"),
            stream=bool(s.get("stream", True)), recovery=s.get("recovery", True),
            stats_scope=str(s.get("stats_scope") or ""))

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        s = self.settings(kwargs)
        client = _client(s.address, s.token, s.timeout, s.stream, s.recovery, s.stats_scope)
        sids, system_prompt = await client.open_with_prompt(s.env_id, 1, s.env_config, s.action_format)
        sid = sids[0]
        try:
            return await self._episode(client, sid, system_prompt, s, sampling_params)
        finally:
            try:
                await client.close_sessions([sid])
            except Exception as e:  # the replica may be gone; its lease drops the session then
                logger.warning("closing envserve session %s failed: %s", sid, e)

    async def _episode(self, client: AsyncRoutedClient, sid: str, system_prompt: str, s: EpisodeSettings,
                       sampling_params: dict[str, Any]) -> AgentLoopOutput:
        first = (await client.reset([sid], [s.seed], task_id=s.task_id, split=s.split))[0]
        err = item_error(first)
        if err is not None:
            raise err
        images = pil_images(first)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt},
                                          {"role": "user", "content": content_blocks(first.observation.text, images)}]
        self._assert_mm_supported(bool(images))
        runtime_ids = await self.ct_build_initial_tokens(messages, images=images or None)
        want_logprobs = bool(sampling_params.get("logprobs"))
        mask: list[int] = []
        logprobs: Optional[list[float]] = [] if want_logprobs else None
        request_id = uuid4().hex
        rewards: list[float] = []
        success = False
        invalid = 0
        assistant_turns = observation_turns = 0
        env_error = ""
        metrics: dict[str, Any] = {"generate_sequences": 0.0, "tool_calls": 0.0}
        loop = asyncio.get_running_loop()
        while len(mask) < self.response_length:
            params = dict(sampling_params)
            left = self.response_length - len(mask)
            params["max_tokens"] = min(int(params.get("max_tokens") or left), left)
            t0 = loop.time()
            out = await self.server_manager.generate(request_id=request_id, prompt_ids=runtime_ids,
                                                     sampling_params=params, image_data=images or None)
            metrics["generate_sequences"] += loop.time() - t0
            if out.num_preempted is not None:
                metrics["num_preempted"] = metrics.get("num_preempted", 0) + out.num_preempted
            if logprobs is not None and out.log_probs is None:
                logprobs = None  # a server that gives none: the rollout carries none
            merge, mask, logprobs = await self.ct_merge_assistant_token(
                runtime_ids, out.token_ids, mask, logprobs,
                assistant_logprobs=out.log_probs if logprobs is not None else None)
            runtime_ids = merge.token_ids
            assistant_turns += 1
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            t0 = loop.time()
            try:
                # The answer's tokens count into the episode's outcome statistics (a stats scope's).
                result = (await client.step([(sid, text, len(out.token_ids))]))[0]
                err = item_error(result)
            except EnvServeError as e:
                result, err = None, e
            metrics["tool_calls"] += loop.time() - t0
            if err is not None:
                # A lost session or replica ends this rollout with what it has; the batch goes on.
                env_error = f"{err.code.name}: {err.message}"
                break
            rewards.append(float(result.reward))
            invalid += not result.action_valid
            success = success or bool(result.success)
            if result.done or result.truncated or (s.max_turns and assistant_turns >= s.max_turns):
                break
            step_images = pil_images(result)
            self._assert_mm_supported(bool(step_images))
            messages.append({"role": "assistant", "content": text})
            previous = list(messages)
            messages.append({"role": "user", "content": content_blocks(feedback_and_observation(result), step_images)})
            merge, new_mask, new_logprobs = await self.ct_merge_context_msg(previous, messages, runtime_ids, mask,
                                                                             logprobs)
            if len(new_mask) >= self.response_length:
                break  # the observation does not fit: the response ends after the model's turn
            runtime_ids, mask, logprobs = merge.token_ids, new_mask, new_logprobs
            images.extend(step_images)
            observation_turns += 1

        response_ids = runtime_ids[len(runtime_ids) - len(mask):] if mask else []
        episode_return = float(sum(rewards))
        extra = {"turn_scores": rewards, "tool_rewards": [],
                 "reward_extra_info": {"env_success": float(success), "env_return": episode_return,
                                       "env_invalid_actions": float(invalid)},
                 "envserve_session": sid}
        if env_error:
            extra["envserve_error"] = env_error
        return AgentLoopOutput(
            prompt_ids=runtime_ids[:len(runtime_ids) - len(mask)],
            response_ids=response_ids[:self.response_length],
            response_mask=mask[:self.response_length],
            response_logprobs=logprobs[:self.response_length] if logprobs else None,
            multi_modal_data={"images": images} if images else {},
            reward_score=episode_return,
            num_turns=1 + assistant_turns + observation_turns,
            metrics=metrics,
            extra_fields=extra,
        )


# -- the tool --------------------------------------------------------------------------------------
@dataclass
class _Instance:
    session_id: str
    episode_return: float = 0.0
    done: bool = False
    last: Any = None
    kept: bool = False   # the episode of a trajectory (per_trajectory): its release does not close it


# Trajectories whose episode a per_trajectory tool remembers (the oldest are forgotten, their
# sessions closed): far more than a batch's rollouts.
MAX_TRAJECTORIES = 65536


class EnvServeTool(BaseTool):
    """One envserve session per tool instance (see the module's doc). config: type (verl's, "native"),
    address (as the agent loop's), env_id, env_config, action_format, token, timeout, stream, recovery,
    include_rules (create's response starts with the env's rules), tools ("auto": `move(direction)` / `reveal(row, col)` from the
    spec's action space, else "act": `act(action)`), per_trajectory. Without a `tool_schema` in the
    YAML, the schema is built from the env's spec.

    per_trajectory (default false) is for verl's ToolAgentLoop, which creates and releases an
    instance around every call: the first call of a trajectory (verl's request id, from execute's
    `agent_data`) keeps its session as the trajectory's episode and later calls step that one (their
    own fresh sessions are closed at their release), so the episode goes on across turns. The kept
    session is closed when the episode ends; one whose trajectory stops first is left to the
    server's lease (or closed when MAX_TRAJECTORIES newer ones push it out)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        config = dict(_plain(config) or {})
        self.env_id = config.get("env_id", "")
        if not self.env_id:
            raise ValueError("EnvServeTool's config needs env_id")
        self.address = resolve_target(config.get("address"), "EnvServeTool (`address` in its config)")
        self.env_config = dict(config.get("env_config") or {})
        self.token = config.get("token")
        self.timeout = config.get("timeout", 60.0)
        self.include_rules = bool(config.get("include_rules", True))
        self.stream = bool(config.get("stream", True))
        self.recovery = config.get("recovery", True)
        self.stats_scope = str(config.get("stats_scope") or os.environ.get("ENVSERVE_STATS_SCOPE", ""))
        self.spec = Endpoint(self.address, self.token, self.timeout).spec(self.env_id)
        self.action_format = config.get("action_format") or self.spec.default_action_format or "no_think"
        plain_answer(self.action_format, ["x"])  # an unknown format fails here, not mid-rollout
        settings = session_settings(self.spec, self.env_config)
        self.separator = str(settings["action_separator"])
        self._schema = _tool_schema(self.spec, config.get("tools", "auto"))
        self._instances: dict[str, _Instance] = {}
        self.per_trajectory = bool(config.get("per_trajectory", False))
        self._trajectories: "OrderedDict[str, str]" = OrderedDict()   # verl request id -> instance id
        super().__init__(config, tool_schema)

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self._schema

    def _client(self) -> AsyncRoutedClient:
        # The running event loop's client: the session table is shared, so any loop's client reaches it.
        return _client(self.address, self.token, self.timeout, self.stream, self.recovery, self.stats_scope)

    def session_id(self, instance_id: str) -> str:
        return self._instances[instance_id].session_id

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        """Opens and resets a session. The seed (task_id, split) come from kwargs or from
        kwargs["create_kwargs"] (how verl's ToolAgentLoop passes a row's tools_kwargs)."""
        args = {**kwargs, **dict(_plain(kwargs.get("create_kwargs")) or {})}
        instance_id = instance_id or uuid4().hex
        client = self._client()
        sid = (await client.open(self.env_id, 1, self.env_config, self.action_format))[0]
        inst = _Instance(sid)
        self._instances[instance_id] = inst
        seed = args.get("seed")
        try:
            first = (await client.reset([inst.session_id], [None if seed is None else int(seed)],
                                        task_id=str(args.get("task_id") or ""), split=str(args.get("split") or "")))[0]
            err = item_error(first)
            if err is not None:
                raise err
        except BaseException:
            await self.release(instance_id)
            raise
        inst.last = first
        rules = self.spec.system_prompt if self.include_rules else ""
        text = f"{rules}\nAct by calling the tools.\n\n{first.observation.text}" if rules else first.observation.text
        return instance_id, _response(text, first)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """One Step with the call's action; returns (the text the model reads, the step's reward,
        metrics: action_valid, done, success, episode_return)."""
        if self.per_trajectory and getattr(kwargs.get("agent_data"), "request_id", None):
            instance_id = await self._trajectory_instance(kwargs["agent_data"], instance_id)
        inst = self._instances.get(instance_id)
        if inst is None:
            return ToolResponse(text="Error: no such environment instance."), 0.0, {}
        if inst.done:
            return ToolResponse(text="The episode is over; no more actions are accepted."), 0.0, {"done": True}
        action, why = _action_of(parameters)
        if why:
            return ToolResponse(text=why), 0.0, {"action_valid": False}
        if self.name == "move" and self.separator and self.separator in action:
            return ToolResponse(text=f"Invalid action {action!r}: give exactly one action per call."), 0.0, \
                {"action_valid": False}
        try:
            answer = plain_answer(self.action_format, [action], self.separator)
            result = (await self._client().step([(inst.session_id, answer)]))[0]
            err = item_error(result)
        except EnvServeError as e:
            result, err = None, e
        if err is not None:
            inst.done = True
            return ToolResponse(text=error_text(err)), 0.0, {"done": True, "error": err.code.name}
        inst.last = result
        inst.episode_return += result.reward
        inst.done = bool(result.done or result.truncated)
        if inst.done and inst.kept:
            await self._close(inst.session_id)
        text = step_text(result)
        metrics = {"action_valid": bool(result.action_valid), "done": inst.done, "success": bool(result.success),
                   "episode_return": inst.episode_return}
        return _response(text, result), float(result.reward), metrics

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        """The episode's summed env reward so far."""
        inst = self._instances.get(instance_id)
        return inst.episode_return if inst is not None else 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        """Closes the session (not a trajectory's kept episode, see per_trajectory)."""
        inst = self._instances.get(instance_id)
        if inst is None or inst.kept:
            return
        del self._instances[instance_id]
        await self._close(inst.session_id)

    async def _close(self, session_id: str) -> None:
        """Never raises: the replica may be gone, and its lease drops the session then."""
        try:
            await self._client().close_sessions([session_id])
        except Exception as e:
            logger.warning("closing envserve session %s failed: %s", session_id, e)

    async def _trajectory_instance(self, agent_data, instance_id: str) -> str:
        """The instance holding the trajectory's episode: the first call's own, kept from then on."""
        key = str(agent_data.request_id)
        kept = self._trajectories.get(key)
        if kept is not None and kept in self._instances:
            self._trajectories.move_to_end(key)
            return kept
        inst = self._instances.get(instance_id)
        if inst is None:
            return instance_id
        inst.kept = True
        self._trajectories[key] = instance_id
        extra = getattr(agent_data, "extra_fields", None)
        if isinstance(extra, dict):
            extra["envserve_session"] = inst.session_id
        while len(self._trajectories) > MAX_TRAJECTORIES:
            _, old = self._trajectories.popitem(last=False)
            gone = self._instances.pop(old, None)
            if gone is not None and not gone.done:
                await self._close(gone.session_id)
        return instance_id


def _response(text: str, result) -> ToolResponse:
    images = pil_images(result)
    return ToolResponse(text=text, image=images) if images else ToolResponse(text=text)


def _action_of(parameters: Mapping[str, Any]) -> tuple[str, str]:
    """(the action text, why it is not one) from a tool call's arguments."""
    parameters = dict(parameters or {})
    if "row" in parameters or "col" in parameters:
        try:
            return f"({int(parameters['row'])}, {int(parameters['col'])})", ""
        except (KeyError, TypeError, ValueError):
            return "", f"Invalid action: row and col must be whole numbers, got {parameters!r}."
    value = parameters.get("direction", parameters.get("action"))
    action = "" if value is None else str(value).strip()
    return (action, "") if action else ("", "Invalid action: empty.")


def _tool_schema(spec, mode: str) -> OpenAIFunctionToolSchema:
    space = " ".join(spec.action_space.split())
    if mode not in ("auto", "act"):
        raise ValueError(f"tools must be 'auto' or 'act', got {mode!r}")
    choices = action_choices(spec) if mode == "auto" else None
    if choices:
        fn = dict(name="move", description="Move one step in a direction; returns what happened, the new "
                                           "observation and the reward.",
                  parameters=dict(type="object", required=["direction"], properties=dict(
                      direction=dict(type="string", enum=choices, description="Where to move."))))
    elif mode == "auto" and is_cell_space(spec):
        fn = dict(name="reveal", description="Reveal one hidden cell of the board; returns what happened, the "
                                             "new board and the reward.",
                  parameters=dict(type="object", required=["row", "col"], properties=dict(
                      row=dict(type="integer", description="Row of the cell, counted from 0 at the top."),
                      col=dict(type="integer", description="Column of the cell, counted from 0 at the left."))))
    else:
        fn = dict(name="act", description="Take an action in the environment; returns what happened, the new "
                                          "observation and the reward.",
                  parameters=dict(type="object", required=["action"], properties=dict(
                      action=dict(type="string", description=f"The action: {space}."))))
    return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": fn})


# -- the sampler -----------------------------------------------------------------------------------
class EnvServeTaskSampler(Sampler):
    """verl's dataset sampler drawing each batch's rows by learnability (p(1-p) of each row's task's
    success so far, unseen tasks explored, a floor: envserve.client.sampling), from the outcome
    statistics the replicas keep for the run's stats scope. verl repeats each row rollout.n times
    itself, so a batch holds train_batch_size different tasks where the dataset has that many.

    Its settings are keys of `data.sampler` (`+data.sampler.stats_scope=run-7`): stats_scope
    (else ENVSERVE_STATS_SCOPE; the agent loop or tool must open its sessions under the same one),
    address (else ENVSERVE_ADDRESS, else `ray://` inside a Ray cluster), token, floor (0.05),
    cost_power (0), cost (turns or tokens). The rows name their env and task in extra_info
    (`envserve tasks export --format verl`); all of one env. The weights are read again before each
    batch, so update(), which verl's curriculum samplers take after each step, has nothing to add."""

    def __init__(self, data_source, data_config):
        from envserve.integrations.task_sampler import TaskSampler
        cfg = _plain(data_config.get("sampler")) or {}
        address = resolve_target(cfg.get("address"), "EnvServeTaskSampler (data.sampler.address)")
        scope = str(cfg.get("stats_scope") or os.environ.get("ENVSERVE_STATS_SCOPE", ""))
        if not scope:
            raise ValueError("EnvServeTaskSampler needs a stats scope: data.sampler.stats_scope or "
                             "ENVSERVE_STATS_SCOPE")
        # verl's RLHFDataset tokenizes in __getitem__: the task columns are read from its table.
        table = getattr(data_source, "dataframe", data_source)
        rows = [{"extra_info": _plain(r.get("extra_info")) or {}, **{k: _plain(r[k]) for k in ("seed", "task_id")
                 if k in r}} for r in (table[i] for i in range(len(table)))]
        envs = {str(r["extra_info"].get("env_id") or "") for r in rows}
        if len(envs) != 1 or "" in envs:
            raise ValueError(f"EnvServeTaskSampler draws the rows of one env named in extra_info.env_id; found {sorted(envs)}")
        self.env_id = envs.pop()
        self.endpoint = Endpoint(address, cfg.get("token"), stats_scope=scope)
        batch = int(data_config.get("gen_batch_size") or data_config.get("train_batch_size") or 1)
        self.tasks = TaskSampler(rows, lambda: self.endpoint.client().task_stats(self.env_id), batch_size=batch,
                                 seed=int(data_config.get("seed") or 0), floor=float(cfg.get("floor", 0.05)),
                                 cost_power=float(cfg.get("cost_power", 0.0)), cost=str(cfg.get("cost", "turns")))

    def __iter__(self):
        return iter(self.tasks)

    def __len__(self) -> int:
        return len(self.tasks)

    def update(self, batch=None, *args, **kwargs) -> None:
        pass
