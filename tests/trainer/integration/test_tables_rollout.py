"""Self-play through the trainer's rollout engine: with `opponent: "session"` each trial of a
two-player TextArena game is one seat, and the seats of a table are two rollouts facing each other
on one Interact stream."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("textarena")

from serverproc import ServerProcess  # noqa: E402

from envserve.client import EnvClient  # noqa: E402
from envserve.client.aio import AsyncEnvClient  # noqa: E402
from envserve_trainer.config.train_config import TrainConfig  # noqa: E402
from envserve_trainer.models.small import build_small_model, build_tokenizer  # noqa: E402
from envserve_trainer.policies.hf import HFPolicy  # noqa: E402
from envserve_trainer.rollout.engine import RolloutEngine, Task  # noqa: E402

TTT = "textarena:TicTacToe-v0"
CELLS = [str(k) for k in range(9)]


def test_two_rollouts_face_each_other_and_each_seat_gets_its_own_reward():
    with ServerProcess([TTT], workers=1, metrics=False) as server:
        with EnvClient(server.address) as c:
            sid = c.open(TTT, 1, {"opponent": "self"}, "no_think")[0]
            corpus = [c.reset_one(sid, seed=0).observation.text, c.get_spec(TTT).system_prompt, " ".join(CELLS)]
            c.close_sessions([sid])
        tok = build_tokenizer(corpus)
        ids = [tok.convert_tokens_to_ids(w) for w in CELLS]
        policy = HFPolicy(build_small_model(tok, "tiny", seed=0), tok, allowed_token_ids=ids)
        cfg = TrainConfig.from_mapping({
            "env": {"env_id": TTT, "env_config": {"opponent": "session"}, "action_format": "no_think"},
            "rollout": {"max_new_tokens": 1, "response_prefix": "<answer>[", "response_suffix": "]</answer>",
                        "allowed_words": CELLS, "history_turns": 0, "max_turns": 12}})

        async def go():
            async with AsyncEnvClient(server.address) as ac:
                eng = RolloutEngine(ac, policy, tok, cfg, seed=1)
                try:
                    with pytest.raises(ValueError, match="split a table between tasks"):
                        await eng.collect([Task(3), Task(4)], 1)   # seats are samples of one task
                    return await eng.collect([Task(3), Task(4)], 2), list(eng.sessions)
                finally:
                    await eng.close()

        trials, sessions = asyncio.run(go())
    assert len(trials) == 4 and len(set(sessions)) == 4
    for seat0, seat1 in (trials[0:2], trials[2:4]):   # the two samples of a task sit at one table
        [e0], [e1] = seat0.episodes, seat1.episodes
        assert e0.done and e1.done and "error" not in seat0.info and "error" not in seat1.info
        # Seat 1's first turn comes after seat 0's first move: another board than the empty one.
        assert e0.turns[0].state_anchor and e1.turns[0].state_anchor
        assert e0.turns[0].state_anchor != e1.turns[0].state_anchor
        # One game, two sides: the final rewards are each seat's share (a win against a loss, or a draw).
        last0, last1 = e0.turns[-1], e1.turns[-1]
        assert (last0.reward_components["game"], last1.reward_components["game"]) in {(1.0, -1.0), (-1.0, 1.0),
                                                                                      (0.0, 0.0)}
