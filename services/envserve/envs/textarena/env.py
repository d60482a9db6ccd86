"""TextArena games as envserve environments.

`textarena:<game id>` resolves (core.registry's prefix families) to a class built by make_env_class
for an id in TextArena's registry (textarena.envs.registration.ENV_REGISTRY), made with
textarena.make, so its default wrappers shape the text and the actions ("up" becomes "[up]").
One- and two-player games are served. The observation is the game's text for the player to move,
and the model's whole answer is one move.

In a two-player game the session plays one seat (config player_id) and a built-in opponent the
other (config opponent="random": a move drawn with the session's seed among the bracketed moves
the game's text offers it that the game accepts), or the session plays both seats in turn
(opponent="self"). A game's end carries every seat's reward in the step info.

TextArena draws its randomness from the process-wide `random` (and a few games from numpy's):
each session keeps its own copy of those generator states and swaps it in around every call into
the game, so sessions sharing a worker do not disturb each other and a seed replays exactly.
TextArena's wrapped envs cannot be pickled (their attribute forwarding recurses), so copies replay
the seed and the actions instead of snapshotting.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import re
from typing import Any, Mapping

import numpy as np

from envserve.common.tables import SELF_PLAY_OPPONENT, TABLE_OPPONENT
from envserve.core.env import (REWARD_BOUNDS, ActionOutcome, Environment, EnvSpec, GroundTruth, arguments_bounds,
                               integral_numbers, seeded_splits)

# Games `envserve ls` and the conformance suite try: they run offline, a seed gives the same game
# in any process, and their text names at least one legal move at the start (the suite plays
# those). Served but left out: Sudoku, LightsOut, PegJump and Nim (their text names no move to
# play, or only an example). Not servable offline or on Python 3.11: Wordle, Hangman, Crosswords, WordLadder, WordSearch, SpellingBee,
# WordChains, DontSayIt, LetterAuction, Codenames (they load NLTK corpora, downloaded on first
# use); GuessWho, TwentyQuestions, Debate, ScenarioPlanning (an LLM through OpenRouter plays a
# part); Chess, Checkers, ReverseTicTacToe, Klondike, IteratedStagHunt, UltimateTexasHoldem
# (TextArena 0.7.4's code for them needs Python 3.12); Countdown (0.7.4 passes its invalid-move
# reason as the reward, so a game lost that way scores 0 here). Games on TextArena's multi-player
# state (three or more seats, and Poker or Snake even with two) are not served.
EXAMPLE_GAMES = ("GuessTheNumber-v0", "TowerOfHanoi-v0", "Minesweeper-v0", "FifteenPuzzle-v0", "FrozenLake-v0",
                 "2048-v0", "Mastermind-v0", "Blackjack-v0",
                 "TicTacToe-v0", "ConnectFour-v0", "Othello-v0", "KuhnPoker-v0", "IteratedRockPaperScissors-v0")
OPPONENTS = ("random", SELF_PLAY_OPPONENT)
CONFIG_DEFAULTS = {"kwargs": {}, "success_threshold": 1.0}
TWO_PLAYER_DEFAULTS = {"opponent": "random", "player_id": 0}
CONFIG_BOUNDS = {
    "kwargs": arguments_bounds(),
    "success_threshold": REWARD_BOUNDS,
    "opponent": {"enum": [*OPPONENTS, TABLE_OPPONENT]},
    "player_id": {"minimum": 0, "maximum": 1},
}
CONFIG_DOCS = {
    "kwargs": "keyword arguments of textarena.make for this game (board size, max_turns...)",
    "success_threshold": "the episode succeeds when the player's final reward reaches this",
    "opponent": "who plays the other seat: 'random' (a legal move the game's text offers, drawn with the "
                "session's seed), 'self' (this session plays both seats in turn) or 'session' (each seat is "
                "its own session: Open an even count, two seats per table)",
    "player_id": "the seat this session plays against the built-in opponent (0 moves first)",
}
# Turns per episode the session allows: a backstop, since every game ends itself.
MAX_TURNS = 500
# Reset seeds the start probe tries: any two different first observations or game states mean the seed picks the game.
START_PROBE_SEEDS = 8
# Opponent moves per model move at most: invalid ones do not pass the turn, and TextArena ends a
# game on repeated invalid moves, so this only guards a game that would do neither.
MAX_OPPONENT_MOVES = 32
# A move as TextArena games write them: a short bracketed text on one line.
_MOVE = re.compile(r"\[[^\[\]\n]{1,40}\]")
# Deepest nesting of game state written into the ground truth.
MAX_TRUTH_DEPTH = 12
_NP_SEED_MOD = 2 ** 32


def _ta():
    # Imported on first use so listing environments stays light (textarena imports openai, rich, nltk).
    import textarena
    return textarena


def _registry() -> dict:
    from textarena.envs.registration import ENV_REGISTRY
    return ENV_REGISTRY


def examples() -> list[str]:
    """The EXAMPLE_GAMES this TextArena registers."""
    known = _registry()
    return [n for n in EXAMPLE_GAMES if n in known]


@contextlib.contextmanager
def _own_randomness(states: "list | None", keep: bool = True):
    """Run with `states` ([random's, numpy's]) as the process's generator states, put the process's
    back afterwards, and (keep) store the advanced states in the list."""
    saved = (random.getstate(), np.random.get_state())
    if states and states[0] is not None:
        random.setstate(states[0])
        np.random.set_state(states[1])
    try:
        yield
    finally:
        if keep and states is not None:
            states[:] = [random.getstate(), np.random.get_state()]
        random.setstate(saved[0])
        np.random.set_state(saved[1])


def _make(name: str, kwargs: Mapping[str, Any], seed: int, num_players: int, states: "list | None" = None):
    ta = _ta()
    with _own_randomness(states):
        random.seed(seed)
        np.random.seed(seed % _NP_SEED_MOD)
        game = ta.make(name, **kwargs)
        game.reset(num_players=num_players, seed=seed)
    return game


def _players(name: str) -> int:
    """1 or 2: the seats the game plays with; ValueError where TextArena cannot make it here or
    it is not a one- or two-player game. TextArena's game states assert their player count."""
    ta = _ta()
    for n, state_type in ((1, ta.SinglePlayerState), (2, ta.TwoPlayerState)):
        try:
            game = _make(name, {}, 0, n, [None, None])
        except (ImportError, SyntaxError, LookupError, OSError) as e:
            # A missing package or NLTK corpus, code this Python cannot compile, a missing data file.
            raise ValueError(f"TextArena cannot make {name!r} here: {_brief(e)}") from None
        except Exception as e:  # a seat count the game refuses, or a missing API key
            if "API key" in str(e):
                raise ValueError(f"TextArena cannot make {name!r} here: {_brief(e)}") from None
            continue
        if isinstance(game.state, state_type):
            return n
    raise ValueError(f"{name!r} is not one of TextArena's one- or two-player games (on its SinglePlayerState "
                     f"or TwoPlayerState), which are what envserve serves")


def _brief(e: Exception) -> str:
    # NLTK's lookup errors come framed in asterisks and colour codes.
    text = re.sub(r"\x1b\[[0-9;]*m|\*{3,}", " ", str(e))
    return f"{type(e).__name__}: {' '.join(text.split())[:300]}"


def _start(name: str, seed: int, n: int) -> str:
    """The first observation and game state (a hidden number, a dealt card) of seed's game."""
    game = _make(name, {}, seed, n, [None, None])
    return json.dumps([game.get_observation()[1], _json_safe(game.state.game_state)], sort_keys=True)


def make_env_class(name: str) -> type:
    """The Environment class serving TextArena's `name`; KeyError for an id TextArena does not
    register, ValueError for one it cannot make here."""
    if name not in _registry():
        from importlib.metadata import version
        raise KeyError(f"TextArena {version('textarena')} has no game {name!r}; for example "
                       f"{', '.join(examples())} (all: python -c 'from textarena.envs.registration import "
                       f"ENV_REGISTRY; print(sorted(ENV_REGISTRY))')")
    n = _players(name)
    game = _make(name, {}, 0, n, [None, None])
    base = game
    while hasattr(base, "env") and isinstance(base, _ta().Wrapper):
        base = base.env
    summary = (type(base).__doc__ or "").strip().splitlines()
    varies = len({_start(name, s, n) for s in range(START_PROBE_SEEDS)}) > 1
    two = n == 2
    spec = EnvSpec(
        env_id=f"textarena:{name}",
        description=f"TextArena {name} ({n}-player): {summary[0] if summary else 'a text game'}",
        system_prompt=(f"You are playing TextArena's {name}.\n"
                       "Each turn you see the game's text for your player; answer with one move, written "
                       "in square brackets the way the game asks (for example [4] or [up]). A move the game "
                       "rejects is shown to you with the reason; repeated invalid moves lose the game."
                       + ("\nThe other player moves between your turns; the text tells whose turn it is." if two else "")),
        action_space="one move in square brackets as the game's text describes it",
        max_turns=MAX_TURNS,
        max_actions_per_turn=1,
        # A move may hold commas ("[2, 3]"): no separator splits it.
        config_defaults={**CONFIG_DEFAULTS, **(TWO_PLAYER_DEFAULTS if two else {}), "action_separator": ""},
        config_docs={k: v for k, v in CONFIG_DOCS.items() if two or k not in TWO_PLAYER_DEFAULTS},
        config_bounds={k: v for k, v in CONFIG_BOUNDS.items() if two or k not in TWO_PLAYER_DEFAULTS},
        splits=seeded_splits("TextArena reset seeds"),
        supports_snapshot=False,
        seed_varies_start=varies,
        seats=n,
    )
    safe = re.sub(r"\W", "_", name)
    return type(f"TextArena_{safe}", (TextArenaEnv,),
                {"spec": spec, "game_id": name, "num_players": n, "__module__": __name__})


def _rewards(state) -> "dict[int, float]":
    # A reward that is not a number (a game passing its arguments out of order) counts as 0.
    out = {}
    for p, r in (state.rewards or {}).items():
        try:
            out[int(p)] = float(r)
        except (TypeError, ValueError):
            out[int(p)] = 0.0
    return out


def _json_safe(value: Any, depth: int = 0) -> Any:
    """Game state as plain JSON, the same in every process: objects become their fields, sets
    sorted lists, non-finite floats strings, and anything else its str."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, np.generic):
        return _json_safe(value.item(), depth)
    if depth >= MAX_TRUTH_DEPTH:
        return str(value)
    if isinstance(value, np.ndarray):
        return _json_safe(value.tolist(), depth + 1)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_json_safe(v, depth + 1) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if hasattr(value, "__dict__") and not callable(value):  # a game's own objects (cars, cards)
        return {"type": type(value).__name__, **{k: _json_safe(v, depth + 1) for k, v in vars(value).items()}}
    return str(value)


class TextArenaEnv(Environment):
    """One TextArena game per episode. Subclasses built by make_env_class set spec, game_id and num_players."""

    spec: EnvSpec
    game_id: str
    num_players: int

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        cfg = self.config
        self._kwargs = integral_numbers(dict(cfg["kwargs"]))
        self._threshold = float(cfg["success_threshold"])
        # The seat the session plays against the built-in opponent; None when it plays every seat.
        self._seat: "int | None" = 0
        if self.num_players == 2:
            if cfg["opponent"] == TABLE_OPPONENT:
                raise ValueError("opponent 'session' seats each player as a session of its own, which "
                                 "a server arranges at Open (an even count, two seats per table)")
            self._seat = None if cfg["opponent"] == "self" else int(cfg["player_id"])
        try:  # bad kwargs fail here, at Open, rather than at the first reset
            _make(self.game_id, self._kwargs, 0, self.num_players, [None, None])
        except Exception as e:
            raise ValueError(f"TextArena cannot make {self.game_id} with kwargs {dict(cfg['kwargs'])!r}: "
                             f"{type(e).__name__}: {e}") from None
        self._game = None
        self._states: list = [None, None]   # this session's random and numpy generator states
        self._rng = random.Random(0)        # the opponent's draws
        self._text: dict[int, str] = {}     # each seat's text, as of its latest turn
        self._legal: "list[str] | None" = None

    # -- the game ------------------------------------------------------------------------------
    @property
    def _state(self):
        return self._game.state

    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        seed = int(seed) if seed is not None else 0
        self._states = [None, None]
        self._rng = random.Random(seed)
        self._game = _make(self.game_id, self._kwargs, seed, self.num_players, self._states)
        self._text, self._legal = {}, None
        self._observe()
        self._opponent_moves()

    def _observe(self) -> None:
        pid, text = self._game.get_observation()
        self._text[pid] = text
        self._legal = None

    def _play(self, move: str) -> "tuple[bool, str]":
        """Play `move` for the seat to move; (whether the game rejected it, the game's reason)."""
        st = self._state
        pid, errors = st.current_player_id, st.error_count
        with _own_randomness(self._states):
            self._game.step(move)
        st = self._state
        invalid = st.error_count > errors or bool(st.game_info.get(pid, {}).get("invalid_move"))
        reason = ""
        if invalid:
            admin = [m for _, m, t in st.observations.get(pid, []) if t == _ta().ObservationType.GAME_ADMIN]
            reason = admin[-1] if admin else str(st.game_info.get(pid, {}).get("reason") or "")
        self._observe()
        return invalid, reason

    def _opponent_moves(self) -> list[str]:
        played: list[str] = []
        while (self._seat is not None and not self._state.done and self._state.current_player_id != self._seat
               and len(played) < MAX_OPPONENT_MOVES):
            legal = self.valid_actions()
            if legal:
                move = self._rng.choice(legal)
            else:  # the text offers no move the game takes: TextArena's invalid-move rule decides
                offered = self._offered(self._state.current_player_id)
                move = offered[0] if offered else "[]"
            self._play(move)
            played.append(move)
        return played

    def _offered(self, pid: int) -> list[str]:
        roles = {f"[{r}]" for r in self._state.role_mapping.values()} | {"[GAME]"}
        return [m for m in dict.fromkeys(_MOVE.findall(self._text.get(pid, ""))) if m not in roles]

    # -- the five methods ----------------------------------------------------------------------
    def step(self, action: str) -> ActionOutcome:
        if self._state.done:
            return ActionOutcome(valid=False, feedback="The game is over; reset the environment.")
        if not isinstance(action, str) or not action.strip():
            return ActionOutcome(valid=False, feedback="Invalid move: expected a move such as [4].")
        pid = self._state.current_player_id
        invalid, reason = self._play(action)
        st = self._state
        if invalid and not st.done:
            return ActionOutcome(valid=False, feedback=f"Invalid move: {reason}", info={"player_id": pid})
        moves = self._opponent_moves()
        info: dict[str, Any] = {"player_id": pid, "current_player": st.current_player_id}
        if moves:
            info["opponent_moves"] = moves
        reward, feedback = 0.0, ""
        if st.done:
            rewards = _rewards(st)
            reward = rewards.get(pid, 0.0)
            info["rewards"] = {str(p): r for p, r in sorted(rewards.items())}
            info["successes"] = {str(p): r >= self._threshold for p, r in sorted(rewards.items())}
            info["reason"] = str(st.game_info.get(pid, {}).get("reason") or "")
            # An invalid move past TextArena's allowance ends the game as it scores it: the step is
            # the game's last, so it is reported as played, with the game's reason.
            feedback = f"Invalid move, and the game is over: {reason}" if invalid else info["reason"]
            info["invalid_move"] = invalid
        return ActionOutcome(reward=reward, done=st.done, success=st.done and reward >= self._threshold,
                             feedback=feedback, components={"game": reward}, info=info)

    def seat_to_move(self) -> "int | None":
        if self.num_players != 2 or self._state.done:
            return None
        return int(self._state.current_player_id)

    def render_text(self) -> str:
        st = self._state
        seat = st.current_player_id if self._seat is None else self._seat
        text = self._text.get(seat, "")
        if st.done:
            rewards = ", ".join(f"Player {p}: {r:g}" for p, r in sorted(_rewards(st).items()))
            reason = st.game_info.get(seat, {}).get("reason") or ""
            return f"{text}\n[GAME] Game over. {reason} Rewards: {rewards}.".rstrip()
        if self.num_players == 2:
            whose = "your" if self._seat is not None else f"Player {seat}'s"
            text += f"\n[GAME] It is {whose} turn (Player {seat})."
        return text

    def valid_actions(self) -> "list[str] | None":
        """The moves the game's text offers the seat to move that the game accepts, each tried on a copy."""
        if self._legal is None:
            st = self._state
            pid, legal = st.current_player_id, []
            if not st.done:
                for move in self._offered(pid):
                    trial = copy.deepcopy(self._game)
                    with _own_randomness(list(self._states), keep=False):
                        trial.step(move)
                    ts = trial.state
                    if not (ts.error_count > st.error_count or ts.game_info.get(pid, {}).get("invalid_move")):
                        legal.append(move)
            self._legal = legal
        return list(self._legal)

    def ground_truth(self) -> GroundTruth:
        st = self._state
        truth = {
            "game": self.game_id,
            "num_players": self.num_players,
            "turn": int(st.turn),
            "current_player": int(st.current_player_id),
            "done": bool(st.done),
            "rewards": None if st.rewards is None else {str(p): r for p, r in sorted(_rewards(st).items())},
            "game_state": _json_safe(st.game_state),
            "game_info": _json_safe(st.game_info),
        }
        if self.num_players == 2:
            truth["opponent"] = self.config["opponent"]
            truth["seat"] = self._seat
        return GroundTruth(truth)

    def close(self) -> None:
        self._game = None
