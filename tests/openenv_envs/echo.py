"""Echoes each message back; the reward grows with its length, ten messages end the episode."""
from typing import Any, Optional

from pydantic import Field

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

MAX_MESSAGES = 10


class EchoAction(Action):
    message: str = Field(description="what to say")


class EchoObservation(Observation):
    echoed_message: str = ""
    message_length: int = 0


class EchoEnvironment(Environment):
    """Echoes each message back; longer messages earn more, ten messages end the episode."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> EchoObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return EchoObservation(echoed_message="ready", done=False, reward=0.0)

    def step(self, action: EchoAction, timeout_s: Optional[float] = None, **kwargs: Any) -> EchoObservation:
        self._state.step_count += 1
        return EchoObservation(echoed_message=action.message, message_length=len(action.message),
                               reward=min(len(action.message) * 0.1, 1.0),
                               done=self._state.step_count >= MAX_MESSAGES)

    def web_actions(self, observation):
        return [("hello", {"message": "hello"}), ("ping", {"message": "ping"})]

    @property
    def state(self) -> State:
        return self._state
