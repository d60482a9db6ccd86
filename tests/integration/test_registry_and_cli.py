"""Registration by entry point, and the command line, with real processes."""
import os
import subprocess
import sys
import textwrap

from envserve.client import EnvClient
from outoftree import register_on_path
from serverproc import ServerProcess

THIRD_PARTY_ENV = textwrap.dedent('''
    from envserve.core import ActionOutcome, Environment, EnvSpec, GroundTruth


    class GuessEnv(Environment):
        """Guess a digit; the answer is derived from the seed."""
        spec = EnvSpec(env_id="guess", description="guess the digit", system_prompt="Guess a digit 0-9.",
                       action_space="0, 1, 2, 3, 4, 5, 6, 7, 8, 9", max_turns=5, max_actions_per_turn=1,
                       config_defaults={"reward_right": 1.0})

        def reset(self, seed, options=None):
            self.target, self.guesses = seed % 10, []

        def step(self, action):
            if action not in "0123456789" or len(action) != 1:
                return ActionOutcome(valid=False, feedback=f"not a digit: {action!r}")
            self.guesses.append(int(action))
            right = int(action) == self.target
            return ActionOutcome(reward=self.config["reward_right"] if right else 0.0, done=right, success=right)

        def render_text(self):
            return f"guesses so far: {self.guesses}"

        def ground_truth(self):
            return GroundTruth({"target": self.target, "guesses": list(self.guesses)})
''')


def make_third_party_package(root):
    (root / "guess_env.py").write_text(THIRD_PARTY_ENV)
    return register_on_path(root, "guess-env", {"envserve.envs": {"guess": "guess_env:GuessEnv"}})


def test_entry_point_environment_is_listed_and_served(tmp_path):
    env_vars = make_third_party_package(tmp_path)
    out = subprocess.run([sys.executable, "-m", "envserve.cli", "ls"], capture_output=True, text=True,
                         env=dict(os.environ, **env_vars), check=True).stdout
    assert "guess" in out and "sokoban" in out
    with ServerProcess(["guess"], workers=1, metrics=False, env_vars=env_vars) as server:
        with EnvClient(server.address) as c:
            sid = c.open("guess", 1, None, "no_think")[0]
            assert c.reset_one(sid, seed=13).observation.text == "guesses so far: []"
            assert not c.step_one(sid, "<answer>x</answer>").action_valid
            r = c.step_one(sid, "<answer>3</answer>")
            assert r.success and r.reward == 1.0 and r.done


def test_serve_rejects_unknown_env():
    proc = subprocess.run([sys.executable, "-m", "envserve.cli", "serve", "nope", "--port", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown environment" in proc.stderr


def test_up_refuses_inline_with_containers():
    # --inline would make every family's container step in its front, ALFWorld's included.
    proc = subprocess.run([sys.executable, "-m", "envserve.cli", "up", "--containers", "--inline"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "ENVSERVE_INLINE=1" in proc.stderr


def test_ls_against_a_server(grid_server):
    out = subprocess.run([sys.executable, "-m", "envserve.cli", "ls", "--address", grid_server.address],
                         capture_output=True, text=True, check=True).stdout
    assert all(e in out for e in ("sokoban", "frozenlake", "minesweeper"))


def test_play_in_the_terminal():
    """A person's keystrokes on stdin: two moves in frozenlake, then quit."""
    proc = subprocess.run([sys.executable, "-m", "envserve.cli", "play", "frozenlake", "--seed", "7"],
                          input="Down, Down, Down\nRight, Right, Right\n", capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "turn 1>" in proc.stdout and "reward" in proc.stdout
    assert "Episode over: solved" in proc.stdout
