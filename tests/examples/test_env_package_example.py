"""examples/my_env_package/ as its author uses it: pip builds and installs the package (into a folder
of its own, not the shared venv), its entry point makes `envserve ls` list the env and `envserve
serve` serve it, its run_conformance.sh passes envserve's conformance suite, and its Dockerfile builds
on an image deploy/build-images.sh makes (the image itself is not built here)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from exampleproc import EXAMPLES, ROOT, run_example
from serverproc import ServerProcess

PACKAGE = EXAMPLES / "my_env_package"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The package built by pip from a copy (the example folder stays clean) into its own folder;
    returns the environment variables that put it on the path."""
    root = tmp_path_factory.mktemp("env-package")
    shutil.copytree(PACKAGE, root / "src", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(root / "site"), str(root / "src")], check=True, capture_output=True, text=True)
    (dist,) = (root / "site").glob("envserve_guess-*.dist-info")
    assert "[envserve.envs]\nguess = envserve_guess:GuessEnv" in (dist / "entry_points.txt").read_text()
    return {"PYTHONPATH": os.pathsep.join([str(root / "site"), os.environ.get("PYTHONPATH", "")])}


def test_the_installed_package_is_listed_and_served(installed):
    out = subprocess.run([sys.executable, "-m", "envserve.cli", "ls"], capture_output=True, text=True, check=True,
                         env=dict(os.environ, **installed)).stdout
    assert re.search(r"^guess\s+text\s+Guess a secret whole number", out, re.M) and "sokoban" in out
    from envserve.client import EnvClient
    with ServerProcess(["guess"], workers=1, metrics=False, env_vars=installed) as server:
        with EnvClient(server.address) as c:
            assert c.get_spec("guess").default_action_format == "no_think"
            sid = c.open("guess", 1, {"high": 7}, "no_think")[0]
            r = c.reset_one(sid, seed=11)
            assert r.observation.text == "Secret in [0, 7]. Guesses so far: none."
            assert not c.step_one(sid, "<answer>8</answer>").action_valid      # above high
            low, high, turns = 0, 7, 0
            while not r.done:                                                  # bisect on the hints
                guess = (low + high) // 2
                r = c.step_one(sid, f"<answer>{guess}</answer>")
                turns += 1
                if "higher" in r.feedback:
                    low = guess + 1
                elif "lower" in r.feedback:
                    high = guess - 1
            assert r.success and r.reward == 1.0 and turns <= 4               # 8 numbers: at most 4 guesses
            from envserve.client import state_dict
            assert state_dict(c.get_state(sid))["secret"] == guess
            # Out of the bounds the spec states: refused at Open, naming the key.
            with pytest.raises(Exception, match="config.high: 12 is greater than the maximum of 9"):
                c.open("guess", 1, {"high": 12}, "no_think")


def test_the_conformance_script_passes(installed):
    out = run_example([str(PACKAGE / "run_conformance.sh"), "-p", "no:randomly", "-rA"], cwd=PACKAGE, timeout=600,
                      env={**installed, "PYTHON": sys.executable})
    summary = out.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed[1]) >= 10 and "failed" not in summary and "error" not in summary
    assert "FAILED" not in out.stdout and re.search(r"PASSED \S*test_lifecycle\[guess\]", out.stdout)


def test_the_dockerfile_builds_on_a_family_image_and_serves_the_entry_point():
    text = (PACKAGE / "Dockerfile").read_text()
    image = re.search(r"^ARG FAMILY_IMAGE=envserve-(\w+):latest$", text, re.M)
    assert image and re.search(r"^FROM \$\{FAMILY_IMAGE\}$", text, re.M)
    built = re.search(r"^IMAGES=\((.*)\)$", (ROOT / "deploy" / "build-images.sh").read_text(), re.M)
    assert image[1] in built[1].split()                       # deploy/build-images.sh makes it
    assert re.search(rf"^FROM base AS system-{image[1]}$", (ROOT / "deploy" / "Dockerfile").read_text(), re.M)
    cmd = re.search(r'^CMD \["serve", "(\w+)"', text, re.M)
    entry = re.search(r'^\[project.entry-points."envserve.envs"\]\n(\w+) = "envserve_guess:GuessEnv"$',
                      (PACKAGE / "pyproject.toml").read_text(), re.M)
    assert cmd and entry and cmd[1] == entry[1] == "guess"
    for copied in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (PACKAGE / copied).exists()
