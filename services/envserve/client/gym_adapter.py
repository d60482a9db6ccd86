"""One envserve session as a gymnasium.Env: text in, text (and images) out."""
from __future__ import annotations

from typing import Any, Mapping

import gymnasium as gym

from .client import EnvClient, decode_image
from .errors import check


class EnvServeGymEnv(gym.Env):
    """Observations are the text (dict with 'text' and 'image' when images are on); actions are
    the model's raw text. `info` carries the full result: reward components, validity, reasoning
    fields, anchor, turn and episode."""

    metadata = {"render_modes": []}

    def __init__(self, address: "str | EnvClient", env_id: str, config: Mapping[str, Any] | None = None,
                 action_format: str = "", max_text_length: int = 1 << 16):
        self.client = address if isinstance(address, EnvClient) else EnvClient(address)
        self._own_client = not isinstance(address, EnvClient)
        self.env_id = env_id
        self.spec_proto = self.client.get_spec(env_id)
        self.with_image = bool(config and config.get("render_image"))
        text_space = gym.spaces.Text(max_length=max_text_length, charset=_AnyChar())
        self.action_space = gym.spaces.Text(max_length=max_text_length, charset=_AnyChar())
        self.observation_space = text_space if not self.with_image else gym.spaces.Dict({"text": text_space})
        self.session_id = self.client.open(env_id, 1, config, action_format)[0]
        self.last = None

    def _obs(self, result):
        if not self.with_image:
            return result.observation.text
        images = result.observation.images
        return {"text": result.observation.text, "image": decode_image(images[0]) if images else None}

    @staticmethod
    def _info(result) -> dict:
        return {
            "reward_components": dict(result.reward_components), "action_valid": result.action_valid,
            "actions_executed": result.actions_executed, "parsed_actions": list(result.parsed_actions),
            "reasoning": dict(result.reasoning), "anchor": result.anchor, "feedback": result.feedback,
            "success": result.success, "turn": result.turn, "episode": result.episode,
        }

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        result = check(self.client.reset([self.session_id], [seed], task_id=options.get("task_id", ""),
                                         split=options.get("split", ""),
                                         same_task=bool(options.get("same_task", False)))[0])
        self.last = result
        return self._obs(result), self._info(result)

    def step(self, action: str):
        result = check(self.client.step([(self.session_id, action)])[0])
        self.last = result
        return self._obs(result), result.reward, result.done, result.truncated, self._info(result)

    def render(self):
        return self.last.observation.text if self.last is not None else None

    def close(self):
        if self.session_id:
            try:
                self.client.close_sessions([self.session_id])
            finally:
                self.session_id = ""
                if self._own_client:
                    self.client.close()


class _AnyChar(frozenset):
    """Text space charset that accepts any character: models may emit anything."""

    def __contains__(self, item) -> bool:
        return True

    def __new__(cls):
        return super().__new__(cls, "abcdefghijklmnopqrstuvwxyz")
