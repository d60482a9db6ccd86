"""The LLM judge over the real protocol path: a real OpenAI-compatible server (`transformers serve`)
on loopback running a real, tiny, random-weight model (tests/llm_fixtures.py), judging texts against
real Sokoban ground truth.

The model's replies are random words, so a judgment is normally a parse failure (score 0, verdict
False, the reason given); should the model happen to answer YES or NO, the invariants below still
hold. What is checked for certain: the server received exactly the env's prompt (its token count
equals the chat-templated prompt's) and answered with what this model generates from it, repeats
come from the cache without reaching the server, the concurrency limit holds, and structured mode
takes the reply as malformed JSON (the vocabulary has no brackets or braces).
"""
from __future__ import annotations

import asyncio

import pytest

from envserve.judge import GROUNDING, WORLD_MODELING
from envserve.judge.base import JudgeInput, Judgment
from envserve.judge.llm_judge import LLMJudge, LLMJudgeConfig
from envserve.judge.prompts import structured_prompt, yesno_prompt
from llm_fixtures import judge_model_server, sokoban_push_right, tiny_judge_model  # noqa: F401

MAX_TOKENS = 12
TEXT = "The box is at the same row and to the right of the player. The target is below and right of me."


@pytest.fixture(scope="module")
def sokoban_turns():
    """Real records of turns 0 and 1 (Sokoban seed 7, one push to the right)."""
    before, after = sokoban_push_right()
    assert before["state"]["player"] == [2, 2] and after["state"]["player"] == [2, 3]
    return before, after


def make_judge(server, **overrides) -> LLMJudge:
    return LLMJudge(LLMJudgeConfig.from_mapping({"base_url": server.base_url, "model": server.model,
                                                 "max_tokens": MAX_TOKENS, "timeout_s": 60.0, "max_retries": 1,
                                                 **overrides}))


def prompt_tokens(tokenizer, prompt) -> int:
    return len(tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=True,
                                             return_dict=False))


def local_reply(model_dir, tokenizer, prompt) -> str:
    """What the model generates greedily from the prompt, here in the test process."""
    import torch
    from transformers import AutoModelForCausalLM
    ids = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0][len(ids):], skip_special_tokens=True)


def assert_yesno_invariants(j: Judgment, server) -> None:
    assert j.judge == f"llm:{server.model}" and j.details["mode"] == "yesno"
    assert j.score in (0.0, 1.0) and j.verdict is (j.score == 1.0)
    assert j.details["completion_tokens"] <= MAX_TOKENS
    if "parse_error" in j.details:
        assert (j.score, j.verdict) == (0.0, False)
        assert "could not be read" in j.reasoning and j.details["reply"][:50] in j.reasoning
    else:
        assert j.details["answer"] == ("YES" if j.verdict else "NO")


def test_yesno_judgment_from_a_real_model_server(judge_model_server, tiny_judge_model, sokoban_turns):
    model_dir, tokenizer = tiny_judge_model
    before, _ = sokoban_turns
    item = JudgeInput("sokoban", GROUNDING, TEXT, before)
    judge = make_judge(judge_model_server)
    served = judge_model_server.settled_completions()

    async def main():
        try:
            first = await judge.judge(item)
            after_first = dict(judge.stats())
            second = await judge.judge(item)
            return first, after_first, second
        finally:
            await judge.aclose()

    first, after_first, second = asyncio.run(main())
    prompt = yesno_prompt("sokoban", GROUNDING, TEXT, before)
    # the server got exactly the env's prompt, and the reply is this model's own greedy continuation
    assert first.details["prompt_tokens"] == prompt_tokens(tokenizer, prompt)
    assert first.details["reply"].strip() and first.details["reply"] == local_reply(model_dir, tokenizer, prompt)
    assert_yesno_invariants(first, judge_model_server)
    assert not first.cached and first.details["attempts"] == 1
    assert after_first["parse_failures"] == (1 if "parse_error" in first.details else 0)
    # the repeat: from the cache, no second request
    assert second.cached and (second.score, second.verdict, second.reasoning) == (
        first.score, first.verdict, first.reasoning)
    s = judge.stats()
    assert (s["requests"], s["completions"], s["cache_hits"]) == (1, 1, 1)
    assert s["parse_failures"] == after_first["parse_failures"]
    # the server's own log: exactly one completion served for the two calls
    assert judge_model_server.wait_completions(served + 1) == served + 1


def test_world_modelling_prompt_reaches_the_server(judge_model_server, tiny_judge_model, sokoban_turns):
    _, tokenizer = tiny_judge_model
    before, after = sokoban_turns
    judge = make_judge(judge_model_server)

    async def main():
        try:
            return await judge.judge(JudgeInput("sokoban", WORLD_MODELING, "The box will be right of me.", after,
                                                before))
        finally:
            await judge.aclose()

    j = asyncio.run(main())
    prompt = yesno_prompt("sokoban", WORLD_MODELING, "The box will be right of me.", after, before)
    assert j.details["prompt_tokens"] == prompt_tokens(tokenizer, prompt)
    assert j.details["prompt_tokens"] > prompt_tokens(
        tokenizer, yesno_prompt("sokoban", GROUNDING, "The box will be right of me.", after))
    assert_yesno_invariants(j, judge_model_server)


def test_concurrency_limit_against_the_server(judge_model_server, sokoban_turns):
    before, _ = sokoban_turns
    judge = make_judge(judge_model_server, max_concurrency=2)
    served = judge_model_server.settled_completions()
    texts = [f"{TEXT} Note {i}." for i in range(5)]

    async def main():
        try:
            return await asyncio.gather(*(judge.judge(JudgeInput("sokoban", GROUNDING, t, before)) for t in texts))
        finally:
            await judge.aclose()

    results = asyncio.run(main())
    for j in results:
        assert_yesno_invariants(j, judge_model_server)
        assert not j.cached
    s = judge.stats()
    assert s["peak_in_flight"] == 2 and s["in_flight"] == 0
    assert (s["requests"], s["completions"], s["retries"], s["failures"]) == (5, 5, 0, 0)
    assert s["parse_failures"] == sum("parse_error" in j.details for j in results)
    assert judge_model_server.wait_completions(served + 5) == served + 5


def test_structured_mode_takes_the_random_reply_as_malformed(judge_model_server, tiny_judge_model, sokoban_turns):
    _, tokenizer = tiny_judge_model
    before, _ = sokoban_turns
    judge = make_judge(judge_model_server, mode="structured")
    served = judge_model_server.settled_completions()

    async def main():
        try:
            return await judge.judge(JudgeInput("sokoban", GROUNDING, TEXT, before))
        finally:
            await judge.aclose()

    j = asyncio.run(main())
    assert j.details["mode"] == "structured"
    assert j.details["prompt_tokens"] == prompt_tokens(tokenizer, structured_prompt("sokoban", GROUNDING, TEXT, before))
    assert (j.score, j.verdict, j.precision, j.recall, j.f1) == (0.0, False, 0.0, 0.0, 0.0)
    assert "not valid JSON" in j.reasoning and "parse_error" in j.details and "claims" not in j.details
    assert judge.stats()["parse_failures"] == 1
    assert judge_model_server.wait_completions(served + 1) == served + 1


def test_the_service_gives_each_env_its_judge(grid_server, judge_model_server, tmp_path):
    """`envserve judge` with the LLM judge for FrozenLake (and as the fallback for MineSweeper, which
    the rule judge cannot score), the rule judge for Sokoban, all in one batch over gRPC."""
    import json

    from envserve.client import EnvClient, JudgeClient, JudgeTask
    from serverproc import JudgeProcess

    settings = tmp_path / "judge.json"
    settings.write_text(json.dumps({"llm": {"base_url": judge_model_server.base_url, "model": judge_model_server.model,
                                            "max_tokens": MAX_TOKENS, "timeout_s": 60.0},
                                    "judges": {"frozenlake": "llm"}}))
    with EnvClient(grid_server.address) as env, JudgeProcess(grid_server.address, extra=["--config", str(settings)]) as j, \
            JudgeClient(j.address) as jc:
        sids = {}
        for env_id in ("sokoban", "frozenlake", "minesweeper"):
            sids[env_id] = env.open(env_id, 1)[0]
            env.reset([sids[env_id]], seeds=[3])
        tasks = [JudgeTask(env_id, sid, 0, "grounding", "The goal is below me.") for env_id, sid in sids.items()]
        first = {r.key: r for r in jc.judge(tasks)}
        again = {r.key: r for r in jc.judge(tasks[1:2])}
        info = jc.info()
    llm = f"llm:{judge_model_server.model}"
    assert {k: r.judge for k, r in first.items()} == {"sokoban": "rule", "frozenlake": llm, "minesweeper": llm}
    for r in first.values():
        assert r.status.code == 0, r.status.message
        assert r.reasoning and r.score in (0.0, 1.0) if r.judge == llm else r.HasField("f1")
    assert not first["frozenlake"].cached and again["frozenlake"].cached
    assert again["frozenlake"].score == first["frozenlake"].score
    assert dict(info.judge_by_env) == {"frozenlake": "llm"} and info.fallback_judge == "llm"
    assert sorted(info.judges) == ["llm", "rule"]
