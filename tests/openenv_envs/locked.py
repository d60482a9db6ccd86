"""A counter guarded by a lock, as an env shared with a background thread would be: the lock
cannot be copied, so envserve forks it by replaying its actions."""
import threading
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class AddAction(Action):
    amount: int


class CounterObservation(Observation):
    total: int


class LockedCounterEnvironment(Environment):
    """Add amounts to a running total; reaching 10 ends the episode."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        self._state = State(step_count=0)
        self._total = 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> CounterObservation:
        with self._lock:
            self._state, self._total = State(episode_id=episode_id), (seed or 0) % 5
            return CounterObservation(total=self._total, reward=0.0)

    def step(self, action: AddAction, timeout_s: Optional[float] = None, **kwargs: Any) -> CounterObservation:
        with self._lock:
            self._state.step_count += 1
            self._total += action.amount
            return CounterObservation(total=self._total, reward=float(action.amount), done=self._total >= 10)

    @property
    def state(self) -> State:
        return self._state


class NotAnEnvironment:
    """Has reset and step, but is no OpenEnv Environment."""

    def reset(self, seed=None):
        return None

    def step(self, action):
        return None
