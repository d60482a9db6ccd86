"""textarena:<game id> through a real server on loopback: a two-player game played to the end over
the Interact stream (self-play and the built-in opponent), a one-player game won from its hints,
invalid moves with the game's feedback, and bad ids and configs."""
import asyncio
import re

import grpc
import pytest

pytest.importorskip("textarena")

from envserve.client import AsyncEnvClient, EnvClient, state_dict  # noqa: E402
from envserve.client.errors import EnvServeError  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

TTT, GUESS, G2048 = "textarena:TicTacToe-v0", "textarena:GuessTheNumber-v0", "textarena:2048-v0"


@pytest.fixture(scope="module")
def server():
    with ServerProcess([TTT, GUESS, G2048], workers=1, metrics=False) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with EnvClient(server.address) as c:
        yield c


def _move(m) -> str:
    return f"<answer>[{m}]</answer>"


def test_self_play_tictactoe_to_the_end_over_the_stream(server):
    # Player 0 takes the top row while Player 1 plays the middle one: one session moves for both.
    moves = [0, 3, 1, 4, 2]

    async def main():
        async with AsyncEnvClient(server.address) as ac:
            sid = (await ac.open(TTT, 1, {"opponent": "self"}, "no_think"))[0]
            async with ac.stream() as s:
                r = await s.reset(sid, seed=4)
                assert "It is Player 0's turn" in r.observation.text
                results = []
                for m in moves:
                    results.append(await s.step(sid, _move(m)))
            truth = state_dict(await ac.get_state(sid, -1))
            await ac.close_sessions([sid])
            return results, truth

    results, truth = asyncio.run(main())
    for k, r in enumerate(results[:-1]):
        assert r.status.code == 0 and r.action_valid and not r.done
        assert r.info["player_id"] == k % 2 and r.info["current_player"] == (k + 1) % 2
        assert f"It is Player {(k + 1) % 2}'s turn" in r.observation.text
    last = results[-1]
    assert last.done and last.success and last.reward == 1.0 and last.info["player_id"] == 0
    assert dict(last.info["rewards"]) == {"0": 1.0, "1": -1.0}
    assert truth["done"] and truth["rewards"] == {"0": 1.0, "1": -1.0} and truth["opponent"] == "self"


def _play_against_the_opponent(c, seed, player_id=0):
    sid = c.open(TTT, 1, {"include_valid_actions": True, "player_id": player_id}, "no_think")[0]
    r = c.reset_one(sid, seed=seed)
    trace = [r.observation.text]
    while not r.done:
        r = c.step_one(sid, f"<answer>{r.info['valid_actions'][0]}</answer>")
        assert r.action_valid and r.info["player_id"] == player_id
        trace.append((list(r.info["opponent_moves"]) if "opponent_moves" in r.info else [], r.observation.text))
    c.close_sessions([sid])
    return r, trace


def test_the_random_opponent_plays_legal_moves_the_same_way_for_a_seed(client):
    last, trace = _play_against_the_opponent(client, seed=11)
    rewards = dict(last.info["rewards"])
    assert set(rewards) == {"0", "1"} and sum(rewards.values()) == 0
    assert last.reward == rewards["0"] and last.success == (rewards["0"] == 1.0)
    assert any(moves for moves, _ in trace[1:])
    assert _play_against_the_opponent(client, seed=11)[1] == trace


def test_the_opponent_opens_when_the_session_plays_the_second_seat(client):
    sid = client.open(TTT, 1, {"player_id": 1}, "no_think")[0]
    r = client.reset_one(sid, seed=2)
    truth = state_dict(client.get_state(sid, 0))
    assert truth["current_player"] == 1 and truth["seat"] == 1 and truth["turn"] == 1
    assert "It is your turn (Player 1)" in r.observation.text
    assert sum(cell != "" for row in truth["game_state"]["board"] for cell in row) == 1
    client.close_sessions([sid])


def test_guess_the_number_won_by_binary_search_from_the_hints(client):
    sid = client.open(GUESS, 1, {}, "no_think")[0]
    client.reset_one(sid, seed=7)
    target = state_dict(client.get_state(sid, 0))["game_state"]["game_number"]
    low, high = 1, 20
    for _ in range(5):   # 20 numbers: five halvings find any
        guess = (low + high) // 2
        r = client.step_one(sid, _move(guess))
        if r.done:
            break
        hint = re.findall(r"The target number is (higher|lower)", r.observation.text)[-1]
        low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
    assert r.done and r.success and r.reward == 1.0 and guess == target
    assert dict(r.info["rewards"]) == {"0": 1.0}
    client.close_sessions([sid])


@pytest.mark.parametrize("env_id, bad, good", [(TTT, "hello", _move(4)), (GUESS, "[abc]", _move(10))])
def test_an_invalid_move_gets_the_games_reason_and_the_session_goes_on(client, env_id, bad, good):
    sid = client.open(env_id, 1, {}, "no_think")[0]
    client.reset_one(sid, seed=1)
    r = client.step_one(sid, f"<answer>{bad}</answer>")
    assert r.status.code == 0 and not r.action_valid and not r.done
    assert "invalid move" in r.feedback.lower() and "Reason" in r.feedback
    r = client.step_one(sid, good)
    assert r.status.code == 0 and r.action_valid
    client.close_sessions([sid])


def test_repeated_invalid_moves_lose_the_game_as_textarena_scores_it(client):
    sid = client.open(TTT, 1, {}, "no_think")[0]
    client.reset_one(sid, seed=1)
    assert not client.step_one(sid, "<answer>nine</answer>").action_valid
    r = client.step_one(sid, "<answer>ten</answer>")
    assert r.done and r.reward == -1.0 and not r.success and r.info["invalid_move"]
    assert dict(r.info["rewards"]) == {"0": -1.0, "1": 1.0}
    client.close_sessions([sid])


def test_sessions_sharing_a_worker_keep_their_own_randomness(client):
    # 2048 places a random tile after every move, from Python's process-wide generator: sessions
    # stepped in turn in one worker must each go on as one stepped alone.
    moves = ["<answer>[Up]</answer>", "<answer>[Left]</answer>", "<answer>[Down]</answer>", "<answer>[Right]</answer>"] * 3

    def run(seeds, interleave):
        ids = client.open(G2048, len(seeds), {}, "no_think")
        for sid, seed in zip(ids, seeds):
            client.reset_one(sid, seed=seed)
        texts = {sid: [] for sid in ids}
        for m in moves:
            for sid in (ids if interleave else ids[:1]):
                texts[sid].append(client.step_one(sid, m).observation.text)
        client.close_sessions(ids)
        return texts[ids[0]]

    assert run([5, 6], interleave=True) == run([5], interleave=False)


def test_a_game_envserve_cannot_serve_is_invalid_argument(client):
    with pytest.raises(EnvServeError) as e:
        client.open("textarena:Poker-v0", 1)   # on TextArena's multi-player state
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "one- or two-player" in str(e.value)


def test_unknown_game_is_invalid_argument(client):
    with pytest.raises(EnvServeError) as e:
        client.open("textarena:NoSuchGame-v0", 1)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "NoSuchGame-v0" in str(e.value)
    assert "TicTacToe-v0" in str(e.value)   # the message names games that can be served


@pytest.mark.parametrize("env_id, config", [(TTT, {"opponent": "nobody"}), (TTT, {"player_id": 2}),
                                            (GUESS, {"opponent": "self"}), (GUESS, {"kwargs": {"no_such_arg": 1}}),
                                            (GUESS, {"kwargs": "not an object"})])
def test_malformed_config_is_invalid_argument(client, env_id, config):
    with pytest.raises(EnvServeError) as e:
        client.open(env_id, 1, config)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_kwargs_reach_the_game(client):
    sid = client.open(GUESS, 1, {"kwargs": {"min_number": 5, "max_number": 6}}, "no_think")[0]
    r = client.reset_one(sid, seed=0)
    assert "between 5 and 6" in r.observation.text
    client.close_sessions([sid])


def test_ls_lists_the_family_with_examples():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "envserve.cli", "ls"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "textarena:<id>" in out.stdout and "textarena:TicTacToe-v0" in out.stdout
