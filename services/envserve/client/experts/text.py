"""Experts of the text games, which the envs run beside the episode (config `expert: true`):
ALFWorld's handcoded expert and ScienceWorld's gold path, read from GetState's `expert_action`."""
from __future__ import annotations

from .base import CONTINUE, PLAN, Expert, Move, Truth

# Where the env's expert has no advice (ALFWorld's gave up, or a ScienceWorld episode left its gold
# path), a look changes nothing and keeps the turn valid.
_LOOK = {"alfworld": "look", "scienceworld": "look around"}
_PLAN_SHOWN = 8


class _EnvExpert(Expert):
    session_config = {"expert": True}

    def _next(self, truth: Truth) -> str:
        if "expert_action" not in truth.state:
            raise ValueError(f"{self.env_id}: the ground truth has no expert_action; open the session with "
                             f"config expert: true")
        return str(truth.state["expert_action"] or "")


class AlfWorldExpert(_EnvExpert):
    env_id = "alfworld"

    def act(self, truth: Truth, max_actions: int) -> Move:
        s = truth.state
        action = self._next(truth)
        holding = f" and hold the {', the '.join(s['inventory'])}" if s.get("inventory") else ""
        where = f"I am at the {s.get('location', 'middle of the room')}{holding}."
        if not action:
            return Move([_LOOK[self.env_id]], f"{where} I have no further step planned, so I look around.")
        if truth.turn == 0:
            plan = (f"My task is to {s.get('goal', '')}. I will find what it needs, take it, treat it if the task "
                    f"asks, and put it in place; first: {action}.")
            return Move([action], plan, PLAN, plan=plan)
        return Move([action], f"{where} Next toward the goal ({s.get('goal', '')}): {action}.", CONTINUE)


class ScienceWorldExpert(_EnvExpert):
    env_id = "scienceworld"

    def act(self, truth: Truth, max_actions: int) -> Move:
        s = truth.state
        action = self._next(truth)
        path = [str(a) for a in s.get("gold_path") or []]
        where = f"I am in the {s.get('location', '')}; score {int(s.get('score', 0))}."
        if not action:
            return Move([_LOOK[self.env_id]], f"{where} I have no further step planned, so I look around.")
        shown = "; ".join(path[:_PLAN_SHOWN]) + ("; ..." if len(path) > _PLAN_SHOWN else "")
        if truth.turn == 0:
            plan = f"The task takes {len(path)} steps: {shown}"
            return Move([action], plan, PLAN, plan=plan)
        return Move([action], f"{where} {len(path)} steps remain; next: {action}.", CONTINUE)
