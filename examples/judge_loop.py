"""A rollout whose answers say what the agent sees (<observation>) and expects (<prediction>), scored
by envserve's judge against the true state, as VAGEN rewards grounding and world modelling.

    envserve serve sokoban --port 50051 &
    envserve judge --port 50070 --env-address 127.0.0.1:50051      # the rule judge: no LLM needed
    python examples/judge_loop.py --address 127.0.0.1:50051 --judge 127.0.0.1:50070

The session's action format is `grounding_worldmodeling`, so each answer is
`<think><observation>...</observation><reasoning>...</reasoning><prediction>...</prediction></think><answer>Up</answer>`.
The env parses the texts into the step's `reasoning`; the judge reads the truth of turn t (observation)
and t+1 (prediction) through envserve's StateService and scores each text (F1 of the relations it
asserts). Steps never wait for it: the texts of the whole episode go in one batch at the end (a
trainer would submit them as it goes, AsyncJudgeClient). The reward is the env's return plus the mean
over turns of beta_g * grounding + beta_w * world_modeling, with the judge's own betas.

The writer of the texts is a stand-in for the model: it describes the true state (and, for the
prediction, the state after its move, read from a fork of the session); `--wrong-every K` makes
every K-th turn's texts false (above/below and left/right swapped), to show what the judge makes of them.
"""
from __future__ import annotations

import argparse
import os
import sys

from envserve.client import EnvClient, JudgeClient, JudgeTask, state_dict
from envserve.client.experts import Truth, look_ahead, plan_sokoban, relation_text
from envserve.client.judge import reasoning_reward

FORMAT = "grounding_worldmodeling"
SWAP = {"above": "below", "below": "above", "left": "right", "right": "left"}


def falsify(text: str) -> str:
    return " ".join(SWAP.get(w, w) for w in text.split(" "))


def answer(observation: str, prediction: str, move: str) -> str:
    return (f"<think><observation>{observation}</observation><reasoning>the plan's next move</reasoning>"
            f"<prediction>{prediction}</prediction></think><answer>{move}</answer>")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--address", default=os.environ.get("ENVSERVE_ADDRESS", "127.0.0.1:50051"))
    p.add_argument("--judge", default="127.0.0.1:50070", help="the address of `envserve judge`")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wrong-every", type=int, default=0, help="every K-th turn's texts are false (0: none)")
    args = p.parse_args(argv)

    env, judge = EnvClient(args.address), JudgeClient(args.judge)
    config = judge.info().config
    beta_g, beta_w = float(config["beta_grounding"]), float(config["beta_world_modeling"])
    sid = env.open("sokoban", 1, None, FORMAT)[0]
    try:
        r = env.reset_one(sid, args.seed)
        print(r.observation.text)
        tasks, env_return = [], 0.0
        while not (r.done or r.truncated):
            state = env.get_state(sid)
            moves = plan_sokoban(state_dict(state))
            move = moves[0] if moves else "Up"
            seen = relation_text(Truth.from_response(state).relations)
            expected = relation_text(look_ahead(env, [(sid, [move])], FORMAT, ",")[0].relations)
            if args.wrong_every and (r.turn + 1) % args.wrong_every == 0:
                seen, expected = falsify(seen), falsify(expected)
            r = env.step_one(sid, answer(seen, expected, move))
            env_return += r.reward
            t = r.turn - 1                      # the turn whose observation the answer described
            tasks += [JudgeTask(f"{t}/grounding", sid, t, "grounding", r.reasoning["observation"], trial=r.trial),
                      JudgeTask(f"{t}/world_modeling", sid, t, "world_modeling", r.reasoning["prediction"],
                                trial=r.trial)]
        scores = {res.key: res for res in judge.judge(tasks)}
        turns = r.turn
        rewards = []
        for t in range(turns):
            g, w = scores[f"{t}/grounding"], scores[f"{t}/world_modeling"]
            rewards.append(reasoning_reward(g.score, w.score, beta_g, beta_w).total)
            print(f"turn {t}: grounding {g.score:.2f} world_modeling {w.score:.2f} reasoning reward {rewards[-1]:.2f}")
            if g.score < 1.0:
                print(f"  judge: {g.reasoning}")
        mean = sum(rewards) / len(rewards)
        print(f"episode: turns={turns} success={r.success} env_return={env_return:.2f} "
              f"mean_reasoning_reward={mean:.2f} total={env_return + mean:.2f}")
    finally:
        env.close_sessions([sid])
        env.close()
        judge.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
