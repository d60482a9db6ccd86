"""textarena:<game id> through a real server on loopback: a two-player game played to the end over
the Interact stream (self-play and the built-in opponent), a one-player game won from its hints,
invalid moves with the game's feedback, and bad ids and configs."""
import asyncio
import re

import grpc
import pytest

pytest.importorskip("textarena")

from envserve.client import AsyncEnvClient, EnvClient, state_dict  # noqa: E402
from envserve.client.errors import EnvNotFoundError, EnvServeError  # noqa: E402
from serverproc import ServerProcess, serve_refusal  # noqa: E402

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


def test_a_game_envserve_cannot_serve_is_refused_at_serve(client):
    with pytest.raises(EnvNotFoundError):
        client.open("textarena:Poker-v0", 1)   # on TextArena's multi-player state
    out = serve_refusal("textarena:Poker-v0")
    assert out.returncode == 2 and "one- or two-player" in out.stderr


def test_an_unknown_game_is_not_found_and_the_operator_is_told_why(client):
    with pytest.raises(EnvNotFoundError) as e:
        client.open("textarena:NoSuchGame-v0", 1)
    assert "NoSuchGame-v0" in str(e.value)
    out = serve_refusal("textarena:NoSuchGame-v0")
    assert out.returncode == 2 and "NoSuchGame-v0" in out.stderr
    assert "TicTacToe-v0" in out.stderr   # the message names games that can be served


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


# -- two sessions at a table (opponent "session") --------------------------------------------------
def _play_seat(stream, sid, moves, seed=4):
    async def seat():
        out = [await stream.reset(sid, seed=seed)]
        for m in moves:
            if out[-1].done:
                break
            out.append(await stream.step(sid, _move(m)))
        return out
    return seat()


def test_two_sessions_play_tictactoe_to_the_end_over_the_stream(server):
    # Seat 0 takes the top row while seat 1 plays the middle one, each its own session and rollout.
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            a, b = await ac.open(TTT, 2, {"opponent": "session"}, "no_think")
            async with ac.stream() as s:
                r0, r1 = await asyncio.gather(_play_seat(s, a, [0, 1, 2]), _play_seat(s, b, [3, 4, 5]))
            truths = [state_dict(await ac.get_state(sid, -1)) for sid in (a, b)]
            statuses = await ac.close_sessions([a, b])
            return (a, b), r0, r1, truths, statuses

    (a, b), r0, r1, truths, statuses = asyncio.run(main())
    assert a != b and all(st.code == 0 for st in statuses)
    assert len(r0) == 4 and len(r1) == 3   # seat 1's third move never comes: the game ended before
    for seat, results in ((0, r0), (1, r1)):
        assert all(r.status.code == 0 and r.info["seat"] == seat for r in results)
        for r in results[:-1]:   # every answer comes at the seat's own turn
            assert not r.done and r.info["seat_to_move"] == seat
            assert f"It is Player {seat}'s turn" in r.observation.text
    assert r1[0].observation.text.count("[0]") >= 1 and "Player 0" in r1[0].observation.text
    assert r0[1].session_id == a and r1[1].session_id == b
    # The same last observation, each seat's own reward: seat 0 won on its move, seat 1 lost on it.
    assert r0[-1].done and r1[-1].done and r0[-1].observation.text == r1[-1].observation.text
    assert (r0[-1].reward, r0[-1].success) == (1.0, True) and (r1[-1].reward, r1[-1].success) == (-1.0, False)
    assert r1[-1].reward_components["game"] == -1.0 and dict(r1[-1].info["rewards"]) == {"0": 1.0, "1": -1.0}
    # Both seats read the one game as ground truth.
    assert truths[0] == truths[1] and truths[0]["done"] and truths[0]["rewards"] == {"0": 1.0, "1": -1.0}


def test_a_seat_waits_for_the_other_in_its_own_unary_calls(client):
    # Two rollouts in two threads, each stepping its own seat with unary calls.
    import concurrent.futures
    a, b = client.open(TTT, 2, {"opponent": "session"}, "no_think")

    def play(sid, moves):
        out = [client.reset_one(sid, seed=1)]
        for m in moves:
            if out[-1].done:
                break
            out.append(client.step_one(sid, _move(m)))
        return out

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        f1 = pool.submit(play, b, [4, 8, 7])
        f0 = pool.submit(play, a, [0, 2, 6, 3])
        r0, r1 = f0.result(timeout=60), f1.result(timeout=60)
    # 0, 4, 2, 8, 6, 7, 3: seat 0 wins down the left column on its fourth move.
    assert r0[-1].done and r0[-1].reward == 1.0 and r1[-1].done and r1[-1].reward == -1.0
    assert len(r1) == 4 and not any(r.done for r in r1[:-1])
    client.close_sessions([a, b])


def test_out_of_turn_and_rejected_moves_are_answered_at_once(client):
    a, b = client.open(TTT, 2, {"opponent": "session"}, "no_think")
    assert "Player 0" in client.reset_one(a, seed=0).observation.text
    r = client.step([(b, _move(4))])[0]   # seat 1 before its turn (and before it joined)
    assert r.status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and "Player 0's turn" in r.status.message
    r = client.step_one(a, _move(9))       # not a cell: the game's reason, and still seat 0's turn
    assert not r.action_valid and r.info["seat_to_move"] == 0 and not r.done
    # Two seats of a table in one batch would wait for each other: both are refused, nothing moves.
    both = client.step([(a, _move(0)), (b, _move(4))])
    assert all(r.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "one batch" in r.status.message
               for r in both)
    assert state_dict(client.get_state(a, -1))["turn"] == 0
    client.close_sessions([a, b])


def test_a_seat_left_waiting_hears_that_the_other_left(server, client):
    a, b = client.open(TTT, 2, {"opponent": "session"}, "no_think")

    async def main():
        async with AsyncEnvClient(server.address) as ac:
            async with ac.stream() as s:
                await s.reset(a, seed=0)
                waiting = asyncio.ensure_future(s.step(a, _move(0)))   # answered at seat 0's next turn
                await asyncio.sleep(0.2)
                assert not waiting.done()
                statuses = await ac.close_sessions([b])
                return statuses, await waiting

    statuses, r = asyncio.run(main())
    assert statuses[0].code == 0
    assert r.status.code == grpc.StatusCode.ABORTED.value[0] and "Player 1 left the table" in r.status.message
    r = client.step([(a, _move(1))])[0]
    assert r.status.code == grpc.StatusCode.ABORTED.value[0]
    client.close_sessions([a])
    assert client.step([(a, _move(1))])[0].status.code == grpc.StatusCode.NOT_FOUND.value[0]


@pytest.mark.parametrize("env_id, count, why", [(TTT, 1, "even count"), (TTT, 3, "even count"),
                                                (GUESS, 2, "two-player game")])
def test_a_table_that_cannot_be_seated_is_invalid_argument(client, env_id, count, why):
    with pytest.raises(EnvServeError) as e:
        client.open(env_id, count, {"opponent": "session"})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and why in str(e.value)


def test_a_seat_cannot_be_forked(client):
    a, b = client.open(TTT, 2, {"opponent": "session"}, "no_think")
    with pytest.raises(EnvServeError) as e:
        client.fork(a)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "seat" in str(e.value)
    client.close_sessions([a, b])


def test_a_seat_waiting_when_its_worker_dies_hears_that_its_game_is_lost():
    import os
    import signal
    with ServerProcess([TTT], workers=1, metrics=False) as s:
        async def main():
            async with AsyncEnvClient(s.address) as ac:
                a, b = await ac.open(TTT, 2, {"opponent": "session"}, "no_think")
                async with ac.stream() as st:
                    await st.reset(a, seed=0)
                    waiting = asyncio.ensure_future(st.step(a, _move(0)))
                    await asyncio.sleep(0.2)
                    os.kill(s.worker_pids()[0], signal.SIGKILL)
                    r = await asyncio.wait_for(waiting, 60)
                    later = await st.step(b, _move(4))
                return r, later

        r, later = asyncio.run(main())
    assert r.status.code == grpc.StatusCode.DATA_LOSS.value[0] and "died" in r.status.message
    assert later.status.code == grpc.StatusCode.DATA_LOSS.value[0]


def test_a_table_plays_game_after_game_whoever_resets_first(server):
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            a, b = await ac.open(TTT, 2, {"opponent": "session"}, "no_think")
            games = []
            async with ac.stream() as s:
                for seed in (4, 5):
                    # Seat 1 asks first: its reset is answered at its first turn of the game seat 0 starts.
                    joined = asyncio.ensure_future(_play_seat(s, b, [3, 4, 5], seed=seed))
                    await asyncio.sleep(0.1)
                    games.append((await _play_seat(s, a, [0, 1, 2], seed=seed), await joined))
                # Seat 0 starting again mid-game ends the turn seat 1 was waiting for.
                await s.reset(a, seed=6)
                joined = asyncio.ensure_future(s.reset(b, seed=6))
                moved = asyncio.ensure_future(s.step(a, _move(0)))
                first = await joined
                waiting = asyncio.ensure_future(s.step(b, _move(4)))
                answered = await moved                  # seat 1 moved: seat 0's turn again
                restarted = await s.reset(a, seed=7)
                cut = await waiting
            await ac.close_sessions([a, b])
            return games, (first, answered), restarted, cut

    games, (first, answered), restarted, cut = asyncio.run(main())
    for r0, r1 in games:
        assert [r.status.code for r in r0 + r1] == [0] * (len(r0) + len(r1))
        assert r0[-1].reward == 1.0 and r1[-1].reward == -1.0 and len(r1) == 3
        assert r1[0].info["seat_to_move"] == 1 and "[0]" not in r1[0].observation.text.split("Available Moves")[-1]
    assert games[0][0][-1].episode == games[1][0][-1].episode   # each game is a new task (trial), episode 0
    assert games[1][0][-1].trial == games[0][0][-1].trial + 1
    assert first.status.code == 0 and first.info["seat_to_move"] == 1
    assert answered.status.code == 0 and answered.info["seat_to_move"] == 0
    assert restarted.status.code == 0 and restarted.info["seat_to_move"] == 0
    assert cut.status.code == grpc.StatusCode.ABORTED.value[0] and "new game" in cut.status.message
