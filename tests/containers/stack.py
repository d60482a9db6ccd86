"""The compose stack of the container tests: choose the engine, build the images with the deploy
scripts, bring docker-compose.yml up under a unique project name, and take it down again.

Engine: a docker whose daemon answers (`docker compose`), else podman (podman-compose from the
venv or PATH); $ENVSERVE_CONTAINER_ENGINE forces one. Base image: where debootstrap runs as root
(the project's machines, which reach no image registry) deploy/base/build-base-image.sh makes a
local Debian one and docker-compose.sandbox.yml is added; elsewhere python:3.11-slim and
redis:7-alpine come from the registry. $ENVSERVE_CONTAINER_BASE=local|registry forces the choice.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCAL_BASE = "localhost/envserve-base:bookworm"
GRID_ENVS = ["sokoban", "frozenlake", "minesweeper"]
# Builds pull packages from PyPI and Debian; generous, and only there to end a hung command.
BUILD_TIMEOUT = 900


class Unavailable(Exception):
    """No container engine on this machine: the tests skip with this reason."""


def _ok(cmd: list[str], env: dict | None = None) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=60, env=env).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def podman_env() -> dict[str, str]:
    """The process environment for podman. The project's machines need the settings in
    ../shared/sandbox/containers.conf (runc, cgroupfs, no default ulimits); elsewhere the
    engine's own defaults apply."""
    env = dict(os.environ)
    conf = ROOT.parent / "shared" / "sandbox" / "containers.conf"
    if "CONTAINERS_CONF" not in env and conf.is_file():
        env["CONTAINERS_CONF"] = str(conf)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Engine:
    name: str                  # "docker" | "podman"
    compose: list[str]         # the compose command
    env: dict[str, str]

    def run(self, args: list[str], timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
        out = subprocess.run([self.name, *args], capture_output=True, text=True, timeout=timeout,
                             env=self.env, **kw)
        if check and out.returncode != 0:
            raise RuntimeError(f"{self.name} {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return out


def find_engine() -> Engine:
    forced = os.environ.get("ENVSERVE_CONTAINER_ENGINE", "")
    docker_up = forced in ("", "docker") and shutil.which("docker") and _ok(["docker", "info"])
    if docker_up and _ok(["docker", "compose", "version"]):
        return Engine("docker", ["docker", "compose"], dict(os.environ))
    if forced == "docker":
        raise Unavailable("ENVSERVE_CONTAINER_ENGINE=docker, but no docker daemon with the compose plugin answers")
    if forced in ("", "podman") and shutil.which("podman"):
        env = podman_env()
        info = subprocess.run(["podman", "info"], capture_output=True, text=True, env=env)
        if info.returncode != 0:
            # Installed but broken is a failure, not a skip: CI must exercise the images.
            raise RuntimeError(f"podman is installed but `podman info` fails:\n{info.stderr}")
        venv_compose = Path(sys.executable).parent / "podman-compose"
        compose = str(venv_compose) if venv_compose.exists() else shutil.which("podman-compose")
        if not compose:
            raise RuntimeError("podman is installed but podman-compose is not (pip install podman-compose)")
        return Engine("podman", [compose], env)
    if shutil.which("docker"):
        raise Unavailable("a docker CLI is installed but no docker daemon (with `docker compose`) answers, "
                          "and podman is not installed")
    raise Unavailable("neither podman nor docker is installed")


@dataclass
class Stack:
    engine: Engine
    project: str
    files: list[str]
    ports: dict[str, int]
    tag: str = "latest"
    timings: dict[str, float] = field(default_factory=dict)
    up_done: bool = False
    down_done: bool = False

    @property
    def compose_env(self) -> dict[str, str]:
        env = dict(self.engine.env, ENVSERVE_TAG=self.tag)
        for name, port in self.ports.items():
            env[f"ENVSERVE_{name.upper()}_PORT"] = str(port)
        return env

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [*self.engine.compose, "-p", self.project]
        for f in self.files:
            cmd += ["-f", f]
        out = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                             env=self.compose_env)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd + list(args))} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return out

    def up(self) -> None:
        start = time.monotonic()
        self.up_done = True  # even a half-started stack is taken down
        self.compose("up", "-d")
        self.timings["compose_up_s"] = time.monotonic() - start

    def down(self) -> None:
        if self.down_done or not self.up_done:
            return
        start = time.monotonic()
        self.compose("down", "-v", timeout=300, check=False)
        self.down_done = True
        self.timings["compose_down_s"] = time.monotonic() - start

    def containers(self) -> list[str]:
        label = f"com.docker.compose.project={self.project}"
        out = self.engine.run(["ps", "-a", "--filter", f"label={label}", "--format", "{{.Names}}"], check=False)
        return out.stdout.split()

    def healthy(self, container: str) -> bool:
        """The image's own HEALTHCHECK. podman runs it on request (its timers need systemd);
        docker runs it on its interval and reports the status."""
        if self.engine.name == "podman":
            return self.engine.run(["healthcheck", "run", container], check=False).returncode == 0
        out = self.engine.run(["inspect", "--format", "{{.State.Health.Status}}", container], check=False)
        return out.stdout.strip() == "healthy"

    def logs(self, tail: int = 60) -> str:
        parts = []
        for name in self.containers():
            # The whole log, cut here: podman 4.3's --tail has returned nothing for short logs.
            out = self.engine.run(["logs", name], check=False)
            lines = (out.stdout + out.stderr).splitlines()[-tail:]
            parts.append(f"--- {name} ---\n" + "\n".join(lines))
        return "\n".join(parts)


def build_images(engine: Engine, base: str, tag: str, timings: dict[str, float]) -> list[str]:
    """Builds what the stack runs with the deploy scripts; returns the compose files to use."""
    files = ["docker-compose.yml"]
    args = ["--engine", engine.name, "--tag", tag]
    images = ["grid", "web", "judge"]
    if base == "local":
        start = time.monotonic()
        out = subprocess.run(["bash", str(ROOT / "deploy/base/build-base-image.sh"), "--engine", engine.name],
                             capture_output=True, text=True, timeout=BUILD_TIMEOUT, env=engine.env)
        if out.returncode != 0:
            raise RuntimeError(f"build-base-image.sh failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
        timings["base_image_s"] = time.monotonic() - start
        args += ["--base-image", LOCAL_BASE]
        cert = os.environ.get("ENVSERVE_PIP_CERT", "/etc/ssl/certs/ca-certificates.crt")
        if os.path.isfile(cert):
            args += ["--pip-cert", cert]
        images.append("redis")
        files.append("docker-compose.sandbox.yml")
    for image in images:
        start = time.monotonic()
        out = subprocess.run(["bash", str(ROOT / "deploy/build-images.sh"), *args, image], capture_output=True,
                             text=True, timeout=BUILD_TIMEOUT, env=engine.env)
        if out.returncode != 0:
            raise RuntimeError(f"build-images.sh {image} failed:\n{out.stdout[-6000:]}\n{out.stderr[-4000:]}")
        timings[f"build_{image}_s"] = time.monotonic() - start
    return files


def build_trainer_image(engine: Engine, base: str, tag: str, timings: dict[str, float]) -> str:
    """envserve-trainer (CPU) with deploy/build-images.sh; returns the image name. On the project's
    machines (local base) torch comes from the folder of local wheels pip uses there ($ENVSERVE_WHEELS,
    default /opt/wheels) and the rest from PyPI: the PyTorch index is unreachable, and PyPI's own torch
    is the several-GB CUDA build."""
    args = ["--engine", engine.name, "--tag", tag]
    if base == "local":
        wheels = Path(os.environ.get("ENVSERVE_WHEELS", "/opt/wheels"))
        if not any(wheels.glob("torch-*.whl")):
            raise RuntimeError(f"no torch wheel in {wheels}: set ENVSERVE_WHEELS to a folder holding a CPU torch wheel")
        args += ["--base-image", LOCAL_BASE, "--wheels", str(wheels), "--build-arg", "TORCH_INDEX_URL="]
        cert = os.environ.get("ENVSERVE_PIP_CERT", "/etc/ssl/certs/ca-certificates.crt")
        if os.path.isfile(cert):
            args += ["--pip-cert", cert]
    start = time.monotonic()
    out = subprocess.run(["bash", str(ROOT / "deploy/build-images.sh"), *args, "trainer"], capture_output=True,
                         text=True, timeout=BUILD_TIMEOUT, env=engine.env)
    if out.returncode != 0:
        raise RuntimeError(f"build-images.sh trainer failed:\n{out.stdout[-6000:]}\n{out.stderr[-4000:]}")
    timings["build_trainer_s"] = time.monotonic() - start
    return f"localhost/envserve-trainer:{tag}"


def choose_base() -> str:
    forced = os.environ.get("ENVSERVE_CONTAINER_BASE", "")
    if forced in ("local", "registry"):
        return forced
    return "local" if shutil.which("debootstrap") and os.geteuid() == 0 else "registry"


def new_stack(engine: Engine, files: list[str]) -> Stack:
    ports = {name: free_port() for name in ["redis", *GRID_ENVS, "web", "judge"]}
    return Stack(engine, f"envtest{uuid.uuid4().hex[:8]}", files, ports)


def leftovers(client, label: str, prefix: str) -> dict[str, list[str]]:
    """Containers and networks that carry the label (key=value) or whose name starts with prefix,
    as the Docker Engine API (docker SDK) reports them."""
    by_label = {"label": label}
    containers = {c.name for c in client.containers.list(all=True, filters=by_label)}
    containers |= {c.name for c in client.containers.list(all=True) if c.name.startswith(prefix)}
    networks = {n.name for n in client.networks.list(filters=by_label)}
    networks |= {n.name for n in client.networks.list() if n.name.startswith(prefix)}
    return {"containers": sorted(containers), "networks": sorted(networks)}
