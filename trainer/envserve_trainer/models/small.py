"""A small Qwen2-style policy with random weights and a tokenizer built in code, for unit tests (and
the from-scratch run of bench/learn_frozenlake.py). Real policies are pretrained models
(pretrained.py).

The tokenizer is a byte-level BPE in Qwen2's own pipeline (NFC, Qwen2's split pattern, byte-level
symbols), so `AutoTokenizer.from_pretrained` on a saved model rebuilds it exactly (transformers 5
loads any qwen2 checkpoint as Qwen2Tokenizer, which imposes that pipeline). Its vocabulary is
restricted to the grid tasks: the 256 byte symbols, the chat tokens, the answer and reasoning tags
as whole tokens, and merges that make each word of the environments' own texts (system prompts,
observations, feedback), bare and with its leading space, one token. Any other text still encodes
and decodes exactly, spelled in smaller pieces. The merges are learned from words only, and a word
may start with a capital but holds no other, so digits, punctuation and adjacent capitals never
merge: every grid cell ("P", "O", "_", "#", "√") stays one token.

The model is a Qwen2ForCausalLM with random weights drawn from a seed, in two sizes: "tiny" for
unit tests and "small" for short CPU training runs.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

PAD, IM_START, IM_END = "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)
ROLES = ("system", "user", "assistant", "tool")
TAG_NAMES = ("think", "answer", "observation", "reasoning", "prediction", "planning", "explore",
             "reflection", "monitor", "action", "remark")
TAGS = tuple(t for name in TAG_NAMES for t in (f"<{name}>", f"</{name}>"))
# Grid moves of Sokoban and FrozenLake (FrozenLake lists them Left, Down, Right, Up).
ACTION_WORDS = ("Up", "Down", "Left", "Right")
# Words a policy reasons with that the env texts may lack (the vocabulary is otherwise the envs' own).
REASONING_WORDS = ("I", "go", "move", "moves", "need", "to", "then", "so", "first", "next", "now", "push", "box",
                   "boxes", "goal", "hole", "holes", "target", "wall", "player", "above", "below", "left", "right",
                   "up", "down", "of", "is", "at", "the", "a", "in", "row", "column", "safe", "avoid", "reach",
                   "because", "will", "be", "after", "my", "me", "it", "and", "not", "can", "cannot")
# Grid symbols beyond ASCII (Sokoban's and FrozenLake's "on the goal/target" cell): one token each.
GRID_SYMBOLS = ("√",)
# A vocabulary word: lower-case letters, optionally after one capital ("Sokoban", "box"; "FrozenLake"
# counts as "Frozen" and "Lake"). No word holds two capitals, so no merge joins two grid cells.
_WORD = re.compile(r"[A-Z]?[a-z]+")

# Qwen2-style chat markup: each message between <|im_start|>role and <|im_end|>.
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Layer shapes of the two sizes. "tiny" keeps unit tests fast; "small" is the CPU training model.
# With the grid vocabulary (about 900 tokens) they hold about 0.2 M and 3.4 M parameters, and one
# forward and backward pass over 8 sequences of 256 tokens takes about 0.05 s and 0.4 s on 2 CPU cores.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4),
}
MAX_POSITIONS = 4096

DEFAULT_CORPUS_ENVS = ("sokoban", "frozenlake")


# -- corpus ----------------------------------------------------------------------------------------
def _answer(action_format: str, action: str) -> str:
    """A valid answer in each built-in action format (so the walk reaches real observations)."""
    if action_format == "no_think":
        return f"<answer>{action}</answer>"
    if action_format == "meta_reasoning":
        return f"<planning>go</planning><action>{action}</action>"
    return ("<think><observation>o</observation><reasoning>r</reasoning><prediction>p</prediction></think>"
            f"<answer>{action}</answer>")


class _ClientSessions:
    """Sessions on a server, through envserve.client (an EnvClient or a RoutedClient)."""

    def __init__(self, client):
        self.client = client

    def formats(self, env_id: str) -> Sequence[str]:
        spec = self.client.get_spec(env_id)
        return list(spec.action_formats) or [spec.default_action_format]

    def open(self, env_id: str, config: Mapping[str, Any], action_format: str):
        reply = self.client.open_sessions(env_id, 1, dict(config), action_format)
        return reply.session_ids[0], reply.system_prompt

    @staticmethod
    def _turn(r) -> tuple[str, str, list[str], bool]:
        from google.protobuf.json_format import MessageToDict
        from envserve.client import check
        r = check(r)
        info = MessageToDict(r.info)
        return r.observation.text, r.feedback, list(info.get("valid_actions", [])), r.done

    def reset(self, sid, seed: int):
        return self._turn(self.client.reset([sid], [seed])[0])

    def step(self, sid, text: str):
        return self._turn(self.client.step([(sid, text)])[0])

    def close(self, sid) -> None:
        self.client.close_sessions([sid])


def corpus_from_envs(client, env_ids: Iterable[str] = DEFAULT_CORPUS_ENVS, seeds: Iterable[int] = range(4),
                     steps: int = 6, walk_seed: int = 0) -> list[str]:
    """Texts the policy will read: each env's system prompt in every action format it accepts, and the
    observations and feedback of short random walks from a few seeds (plus one malformed answer, for
    the format feedback), through `client` (an envserve.client EnvClient or RoutedClient)."""
    source = _ClientSessions(client)
    rng = random.Random(walk_seed)
    texts: list[str] = []
    for env_id in env_ids:
        for action_format in source.formats(env_id):
            session, prompt = source.open(env_id, {"include_valid_actions": True}, action_format)
            try:
                texts.append(prompt)
                for seed in seeds:
                    obs, feedback, valid, done = source.reset(session, seed)
                    texts += [obs, feedback, ", ".join(valid)]
                    for i in range(steps):
                        if done:
                            break
                        # The first step of each walk is malformed on purpose: its feedback names the format.
                        text = "?" if i == 0 or not valid else _answer(action_format, rng.choice(valid))
                        obs, feedback, valid, done = source.step(session, text)
                        texts += [obs, feedback]
            finally:
                source.close(session)
    return [t for t in texts if t]


# -- tokenizer -------------------------------------------------------------------------------------
def vocabulary_words(corpus: Iterable[str], max_words: int | None = None) -> list[str]:
    """The words that become single tokens: those of `corpus` (the most frequent `max_words` of them
    when given) plus the chat roles, action words and a few reasoning words; sorted."""
    counts = Counter(w for text in corpus for w in _WORD.findall(text))
    words = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    if max_words is not None:
        words = words[:max_words]
    return sorted(set(words) | set(ROLES) | set(ACTION_WORDS) | set(REASONING_WORDS))


def _symbols(corpus: Iterable[str]) -> list[str]:
    """Non-ASCII symbols of the corpus (grid cells among them), each to become one token."""
    found = {ch for text in corpus for ch in text if ord(ch) > 127 and not ch.isspace()}
    return sorted(found | set(GRID_SYMBOLS))


def _qwen2_pipeline(tok) -> None:
    """Qwen2Tokenizer's normalizer, pre-tokenizer and decoder (taken from transformers, so the two
    cannot drift apart): the merges are learned on exactly the pieces that encoding will see."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()


def learn_merges(words: Sequence[str], symbols: Sequence[str] = ()) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a byte-level BPE in which each word, bare and after a space, and each symbol
    is one token. The special tokens and tags take the first ids, in a fixed order."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    _qwen2_pipeline(tok)
    # Trained to completion (no vocabulary cap), every training item ends as a single token; the
    # items are sorted, so the merges do not depend on the order the corpus came in.
    trainer = trainers.BpeTrainer(vocab_size=1 << 20, min_frequency=0, show_progress=False,
                                  special_tokens=[*SPECIAL_TOKENS, *TAGS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    items = sorted(set(words) | {" " + w for w in words} | set(symbols))
    tok.train_from_iterator(items, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), merges


def build_tokenizer(corpus: Iterable[str], max_words: int | None = None):
    """A Qwen2Tokenizer over the restricted vocabulary of `corpus` (e.g. the grid envs' texts from
    corpus_from_envs), with the Qwen2 chat template; eos is <|im_end|>, pad is <pad>, no bos."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    corpus = list(corpus)
    vocab, merges = learn_merges(vocabulary_words(corpus, max_words), _symbols(corpus))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token=IM_END,
                         pad_token=PAD, additional_special_tokens=[IM_START], clean_up_tokenization_spaces=False,
                         padding_side="left", model_max_length=MAX_POSITIONS)
    # Tags match whole wherever they appear and survive skip_special_tokens; their ids are the vocab's.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tok.chat_template = CHAT_TEMPLATE
    return tok


# -- model -----------------------------------------------------------------------------------------
def small_config(tokenizer, size: str = "tiny", attn_implementation: str = "sdpa"):
    from transformers import Qwen2Config
    try:
        shape = MODEL_SIZES[size]
    except KeyError:
        raise ValueError(f"unknown model size {size!r}; sizes: {sorted(MODEL_SIZES)}") from None
    # Untied: with tied input and output embeddings a random model's logits are dominated by the
    # residual copy of its input token, so it only repeats its last token; untied, it samples
    # varied text from the start (and the output matrix costs only vocab x hidden).
    return Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=MAX_POSITIONS,
                       tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                       attn_implementation=attn_implementation, **shape)


def build_small_model(tokenizer, size: str = "tiny", seed: int = 0, attn_implementation: str = "sdpa"):
    """A Qwen2ForCausalLM with random weights drawn from `seed` (the global torch RNG is left as it was)."""
    import torch
    from transformers import Qwen2ForCausalLM

    config = small_config(tokenizer, size, attn_implementation)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval()


def count_parameters(model) -> int:
    # A tied embedding and output matrix counts once.
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def weights_digest(model) -> str:
    """A short hash of every weight: equal digests, equal weights."""
    import torch
    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        # raw bytes, so any dtype (bf16 too) hashes exactly
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
