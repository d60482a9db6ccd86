"""Policy contexts as token ids: the env's system prompt, the history window, per-method templates.

A multi-turn context is assembled from token blocks, never by re-tokenizing text the policy wrote:
the completion ids it produced are put back exactly, so the update scores the tokens that were
sampled. Block boundaries come from the tokenizer's own chat template (by rendering a conversation
with and without the block and taking the difference), so any chat template whose renderings extend
one another works; that is checked once at construction.

Templates (RolloutSection.template):
  chat   multi-turn chat: system, then (observation, answer) turns, the last `history_turns` kept.
  rlvmr  RLVMR's single-turn prompt: admissible actions, recent history as text, the current plan
         (the agent's latest <planning> text) and the observation, rebuilt every turn.
  vagen  VAGEN's multi-turn prompt: as chat, each observation followed by the request to describe
         the state and predict the next one (the grounding_worldmodeling answer format).
LaMer's memory (earlier episodes of the trial, or the reflections written after them) goes into the
system block, so it stays in the context however short the history window is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

RLVMR_USER = (
    "{memory}Admissible actions: {actions}\n"
    "Your current plan: {plan}\n"
    "Your last {n_history} steps:\n{history}\n"
    "Current observation (step {turn}):\n{observation}\n"
    "Think with one meta-reasoning tag, then act.")
RLVMR_NO_HISTORY = "(none yet)"
RLVMR_NO_PLAN = "(none yet: make one with <planning>)"
VAGEN_SUFFIX = ("\nFirst describe what you observe, then predict what the state will be after your "
                "actions, then answer.")
REFLECTION_REQUEST = (
    "The episode is over ({outcome}). In one or two sentences, reflect on what went wrong or right "
    "and what to do differently next time. Write it inside <remark>...</remark>.")
MEMORY_HEADER = "\n\nWhat you remember from earlier attempts at this same task:\n"


class ChatLayout:
    """Token blocks of one tokenizer's chat template. With a vision codec (policies.vision.VisionCodec),
    a user block may hold images: each becomes the processor's expanded placeholder, ahead of the text."""

    def __init__(self, tokenizer, codec=None):
        self.tokenizer = tokenizer
        self.codec = codec
        self.stop_token_id = int(tokenizer.eos_token_id)
        probe_sys = {"role": "system", "content": "S"}
        probe_user = {"role": "user", "content": "U"}
        base = self._render([probe_sys])
        with_user = self._render([probe_sys, probe_user])
        prompt = self._render([probe_sys, probe_user], generation_prompt=True)
        full = self._render([probe_sys, probe_user, {"role": "assistant", "content": "A"}])
        if with_user[:len(base)] != base or prompt[:len(with_user)] != with_user or full[:len(prompt)] != prompt:
            raise ValueError("this chat template does not render conversations as extensions of each other; "
                             "the token-carrying rollout needs one that does")
        self.header_ids = prompt[len(with_user):]
        tail = full[len(prompt):]
        answer = self.tokenizer("A", add_special_tokens=False)["input_ids"]
        if tail[:len(answer)] != answer or self.stop_token_id not in tail[len(answer):]:
            raise ValueError("the chat template does not close an assistant turn with the eos token")
        after = tail[len(answer):]
        # What follows the stop token to close an assistant turn (e.g. a newline).
        self.turn_end_ids = after[after.index(self.stop_token_id) + 1:]

    def _render(self, messages, generation_prompt: bool = False) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def system_ids(self, content: str) -> list[int]:
        return self._render([{"role": "system", "content": content}])

    def user_ids(self, content: str, pngs: Sequence[bytes] = ()) -> list[int]:
        # The user block as it renders after a system block (templates may add a default system
        # message when none is given, so the difference is taken against a fixed one).
        if pngs:
            return self._user_ids_with_images(content, pngs)
        base = self._render([{"role": "system", "content": "S"}])
        full = self._render([{"role": "system", "content": "S"}, {"role": "user", "content": content}])
        return full[len(base):]

    def _user_ids_with_images(self, content: str, pngs: Sequence[bytes]) -> list[int]:
        if self.codec is None:
            raise ValueError("this observation holds images but the policy reads text only: use a "
                             "vision-language model (model.vision) or leave render_image off")
        system = [{"role": "system", "content": "S"}]
        blocks = [{"type": "image"} for _ in pngs] + [{"type": "text", "text": content}]
        base = self.codec.render(system, add_generation_prompt=False)
        full = self.codec.render(system + [{"role": "user", "content": blocks}], add_generation_prompt=False)
        if not full.startswith(base):
            raise ValueError("the processor's chat template does not render a user turn as an extension")
        return self.codec.encode(full[len(base):], pngs)

    def text_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def closed_answer(self, completion_ids: Sequence[int], suffix_ids: Sequence[int] = ()) -> list[int]:
        """A completion as it sits in a later context: the suffix the action got, the stop token
        (also when it ran out of length), then the template's turn end."""
        ids = list(completion_ids)
        if ids and ids[-1] == self.stop_token_id:
            ids.pop()
        return ids + list(suffix_ids) + [self.stop_token_id] + self.turn_end_ids


@dataclass
class HistoryTurn:
    observation: str
    observation_ids: list[int]     # the user block it was shown in
    answer_ids: list[int]          # prefix + completion, closed
    action: str
    feedback: str = ""
    images: list[bytes] = field(default_factory=list)   # the PNGs of its user block, in order


@dataclass
class ContextBuilder:
    """Builds one session's context each turn from its system prompt, memory and history."""
    layout: ChatLayout
    system_prompt: str
    template: str = "chat"
    history_turns: int = 2
    response_prefix: str = ""
    response_suffix: str = ""
    admissible_actions: str = ""
    memory: str = ""
    history: list[HistoryTurn] = field(default_factory=list)
    plan: str = ""
    max_images: int = 0            # most images in one context (0: no bound); the oldest turns leave first
    context_images: list[bytes] = field(default_factory=list)   # the PNGs of the last prompt_ids, in order
    _system_cache: tuple[str, list[int]] | None = None

    def _system(self) -> list[int]:
        text = self.system_prompt + (MEMORY_HEADER + self.memory if self.memory else "")
        if self._system_cache is None or self._system_cache[0] != text:
            self._system_cache = (text, self.layout.system_ids(text))
        return self._system_cache[1]

    def new_episode(self, memory: str = "") -> None:
        self.history.clear()
        self.plan = ""
        self.memory = memory

    def user_text(self, observation: str, turn: int) -> str:
        if self.template == "rlvmr":
            recent = self.history[-self.history_turns:] if self.history_turns else []
            lines = [f"- you did: {h.action!s}; then: {h.observation.strip()}" + (f" ({h.feedback})" if h.feedback else "")
                     for h in recent]
            return RLVMR_USER.format(memory="", actions=self.admissible_actions or "see the rules above",
                                     plan=self.plan or RLVMR_NO_PLAN, n_history=len(recent),
                                     history="\n".join(lines) or RLVMR_NO_HISTORY, turn=turn, observation=observation)
        if self.template == "vagen":
            return observation + VAGEN_SUFFIX
        return observation

    def prompt_ids(self, observation: str, turn: int, images: Sequence[bytes] = ()) -> tuple[list[int], list[int]]:
        """(context ids ending with the assistant header and response prefix, the user block shown).
        `images`: the observation's PNGs; context_images then holds every image of the context."""
        user = self.layout.user_ids(self.user_text(observation, turn), images)
        ids = list(self._system())
        kept = self.kept_turns(len(images)) if self.template != "rlvmr" else []
        for h in kept:
            ids += h.observation_ids + self.layout.header_ids + h.answer_ids
        ids += user + self.layout.header_ids + self.layout.text_ids(self.response_prefix)
        self.context_images = [png for h in kept for png in h.images] + list(images)
        return ids, user

    def kept_turns(self, new_images: int = 0) -> list[HistoryTurn]:
        """The history window, less its oldest turns while their images and `new_images` exceed
        max_images (a turn keeps its images or leaves whole: its ids hold their tokens)."""
        kept = self.history[-self.history_turns:] if self.history_turns else []
        if self.max_images:
            if new_images > self.max_images:
                raise ValueError(f"an observation with {new_images} images, more than max_images {self.max_images}")
            while kept and new_images + sum(len(h.images) for h in kept) > self.max_images:
                kept = kept[1:]
        return kept

    def record(self, observation: str, user_ids: list[int], completion_ids: Sequence[int], action: str,
               feedback: str = "", plan: str | None = None, images: Sequence[bytes] = ()) -> None:
        answer = self.layout.text_ids(self.response_prefix) + self.layout.closed_answer(
            completion_ids, self.layout.text_ids(self.response_suffix))
        self.history.append(HistoryTurn(observation, user_ids, answer, action, feedback, list(images)))
        if plan:
            self.plan = plan
        # Only the window is ever read; older turns are dropped to keep memory flat.
        keep = max(self.history_turns, 1)
        if len(self.history) > keep:
            del self.history[:-keep]


def reflection_prompt(layout: ChatLayout, builder: ContextBuilder, last_observation: str, success: bool) -> list[int]:
    """The context for LaMer's reflection after an episode: the episode's last turns, then the request."""
    ids = list(builder._system())
    kept = builder.kept_turns()
    for h in kept:
        ids += h.observation_ids + layout.header_ids + h.answer_ids
    builder.context_images = [png for h in kept for png in h.images]
    request = last_observation + "\n\n" + REFLECTION_REQUEST.format(outcome="success" if success else "failure")
    return ids + layout.user_ids(request) + layout.header_ids


def trajectory_summary(actions: Sequence[str], success: bool, score: float) -> str:
    """LaMer's trajectory memory: what was done and how it ended, as one line."""
    return f"attempt: actions {' | '.join(actions) or '(none)'}; outcome {'success' if success else 'failure'}, score {score:.2f}"
