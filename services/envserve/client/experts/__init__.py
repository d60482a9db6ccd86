"""Experts that play envserve sessions through the gRPC API, for demonstrations (SFT), the demo
and tests.

An expert reads the ground truth of a turn (StateService.GetState) and answers the turn's primitive
actions with a short true reason; `play_expert` drives any expert over many sessions in batches and
writes each answer in the session's action format (`answer_text`). Only the client is used, so any
trainer can collect demonstrations from a remote replica.

    from envserve.client import EnvClient
    from envserve.client.experts import play_expert
    with EnvClient("127.0.0.1:50051") as env:
        episodes = play_expert(env, "sokoban", seeds=range(20), action_format="meta_reasoning")
"""
from __future__ import annotations

from .answers import (FORMATS, answer_text, fields_answer, meta_tag, needs_observation, needs_prediction,
                      plain_answer)
from .base import CONTINUE, EXPLORE, PLAN, REFLECT, Expert, Move, Truth, relation_text, session_settings
from .embodied import NavigationExpert, PrimitiveSkillExpert, agent_frame_offsets, plan_turn
from .grid import (FrozenLakeExpert, FrozenLakeNeighbourExpert, MinesweeperExpert, SokobanExpert,
                   deduce_minesweeper, mine_probabilities, neighbour_move, plan_frozenlake, plan_sokoban)
from .play import ExpertEpisode, ExpertTurn, expert_for, look_ahead, play_expert
from .shop import WebShopExpert
from .text import AlfWorldExpert, ScienceWorldExpert

EXPERTS: dict[str, type[Expert]] = {cls.env_id: cls for cls in (
    SokobanExpert, FrozenLakeExpert, MinesweeperExpert, AlfWorldExpert, ScienceWorldExpert,
    NavigationExpert, PrimitiveSkillExpert, WebShopExpert)}
# Alternatives to an env's own expert, by name (`envserve-train collect --expert NAME`).
EXPERTS["frozenlake_neighbours"] = FrozenLakeNeighbourExpert

__all__ = [
    "EXPERTS", "Expert", "Move", "Truth", "ExpertEpisode", "ExpertTurn", "play_expert", "expert_for", "look_ahead",
    "answer_text", "plain_answer", "fields_answer", "meta_tag", "needs_observation", "needs_prediction", "FORMATS",
    "relation_text", "session_settings", "PLAN", "CONTINUE", "EXPLORE", "REFLECT",
    "SokobanExpert", "FrozenLakeExpert", "FrozenLakeNeighbourExpert", "MinesweeperExpert", "AlfWorldExpert",
    "ScienceWorldExpert",
    "NavigationExpert", "PrimitiveSkillExpert", "WebShopExpert", "plan_sokoban", "plan_frozenlake", "deduce_minesweeper",
    "mine_probabilities", "neighbour_move", "plan_turn", "agent_frame_offsets",
]
