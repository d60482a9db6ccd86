"""The push-box game bench/vs_openenv.py serves on both sides: its script must end an episode
exactly at its last move, or the bench would count episodes ending off script as errors. And the
bench's measurement of one client process: the CPU of every role between the client's markers."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import vs_openenv as v  # noqa: E402


def test_script_reaches_the_target_on_its_last_move_only():
    game = v.PushBox()
    for k, move in enumerate(v.SCRIPT):
        reward, done, valid = game.move(move)
        assert valid, (k, move)
        last = k == len(v.SCRIPT) - 1
        assert (reward, done) == ((1.0, True) if last else (0.0, False)), (k, move)
    assert game.box == v.TARGET


def test_walls_block_the_player_and_the_box():
    game = v.PushBox()
    before = game.render()
    assert game.move("up") == (0.0, False, False)     # the player starts against the top wall
    assert game.move("left") == (0.0, False, False)
    assert game.render() == before
    game.player, game.box = (1, 3), (1, 4)             # box against the right wall
    assert game.move("right") == (0.0, False, False)
    assert (game.player, game.box) == ((1, 3), (1, 4))


def test_reset_and_render():
    game = v.PushBox()
    for move in v.SCRIPT:
        game.move(move)
    assert game.move("down") == (0.0, True, False)    # over until reset
    game.reset()
    rows = game.render().splitlines()
    assert rows[0] == "#" * v.SIZE and rows[1] == "#P...#" and rows[2] == "#.B.T#"
    assert game.move("jump") == (0.0, False, False)


def test_measure_reads_cpu_of_every_role_between_the_markers():
    # the client burns CPU between its markers only; the roles' CPU comes back per role
    client = ("import time; print('measuring', flush=True); t = time.process_time()\n"
              "while time.process_time() - t < 0.3: pass\n"
              "print('measured', flush=True); print('{\"steps\": 1}')")
    result = v.measure([sys.executable, "-c", client], {"server": [os.getpid()]}, 60)
    assert result["steps"] == 1
    assert set(result["cpu_s"]) == {"server", "client"}
    assert all(isinstance(s, float) and s >= 0 for s in result["cpu_s"].values())
    assert result["cpu_s"]["client"] >= 0.2


def test_measure_reports_a_client_that_gives_no_result():
    result = v.measure([sys.executable, "-c", "import sys; sys.exit('no game today')"], {}, 60)
    assert "no game today" in result["failed"]
