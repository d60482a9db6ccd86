"""The tiny model the framework tests use, saved as a Hugging Face folder an example loads by path."""
from __future__ import annotations

import pytest

from exampleproc import DIRECTIONS, tool_call_text


@pytest.fixture(scope="session")
def tiny_model_dir(grid_server, tmp_path_factory) -> str:
    """The trainer's tiny random-weight Qwen2 and its grid tokenizer (whose own chat template renders
    no tool calls, as SmolLM2's does not), with one token per complete `move` call, saved to disk."""
    from tokenizers import AddedToken

    from envserve.client import EnvClient
    from envserve_trainer.models.small import build_small_model, build_tokenizer, corpus_from_envs
    with EnvClient(grid_server.address) as c:
        tok = build_tokenizer(corpus_from_envs(c, ["sokoban"], seeds=range(2), steps=3))
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ["<tool_call>", "</tool_call>", *map(tool_call_text, DIRECTIONS)]])
    model = build_small_model(tok, "tiny", seed=0)
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
