"""`envserve up --containers`: the family images as containers plus Redis, started through the Docker
Engine API (the `docker` SDK, extra "containers"), which podman also serves (`podman system service`).

Each environment runs in a container of its family's image on one private network, registered in
Redis under its container name (in-network address) and its published port on 127.0.0.1 (external
address), so clients on the host route through the directory:
    RoutedClient(f"redis://127.0.0.1:{stack.redis_port}/0", use_external=True)
The images come from deploy/build-images.sh; nothing is pulled except the Redis image when absent.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field

from .common.families import FAMILY_OF_ENV as FAMILY_IMAGES  # which image serves an environment

LABEL = "envserve.stack"
DEFAULT_REDIS_IMAGE = "redis:7-alpine"


class ContainersUnavailable(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineConnection:
    """A Docker Engine API client. engine "docker": $DOCKER_HOST or docker's socket; "podman": its
    sockets, or a `podman system service` started here on a private socket (stopped by close(),
    run with env, e.g. for CONTAINERS_CONF); None: whichever answers first, in that order."""

    def __init__(self, base_url: str | None = None, engine: str | None = None, env: dict | None = None):
        import docker
        self.client = None
        self._service: subprocess.Popen | None = None
        self._tmp: str | None = None
        candidates = [base_url]
        if not base_url and engine in (None, "docker"):
            candidates += [os.environ.get("DOCKER_HOST"), "unix:///var/run/docker.sock"]
        if not base_url and engine in (None, "podman"):
            candidates.append("unix:///run/podman/podman.sock")
            if os.environ.get("XDG_RUNTIME_DIR"):
                candidates.append(f"unix://{os.environ['XDG_RUNTIME_DIR']}/podman/podman.sock")
        for url in filter(None, candidates):
            if self._try(docker, url):
                return
        if base_url or engine == "docker" or not shutil.which("podman"):
            raise ContainersUnavailable(f"no Docker Engine API answers at {', '.join(filter(None, candidates))}"
                                        + ("" if shutil.which("podman") else " and podman is not installed"))
        self._tmp = tempfile.mkdtemp(prefix="envserve-podman-")
        url = f"unix://{self._tmp}/podman.sock"
        # Own session: a Ctrl-C meant for `envserve up` must not stop the API before the containers.
        self._service = subprocess.Popen(["podman", "system", "service", "--time=0", url], env=env,
                                         start_new_session=True,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not self._try(docker, url):
            if self._service.poll() is not None or time.monotonic() > deadline:
                err = self._service.stderr.read() if self._service.poll() is not None else "no answer"
                self.close()
                raise ContainersUnavailable(f"podman system service on {url}: {err}")
            time.sleep(0.2)

    def _try(self, docker, url: str) -> bool:
        try:
            client = docker.DockerClient(base_url=url, timeout=120)
            client.ping()
        except Exception:  # noqa: BLE001 - not listening, stale socket, wrong scheme: try the next
            return False
        self.client = client
        return True

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self._service is not None and self._service.poll() is None:
            self._service.terminate()
            try:
                self._service.wait(10)
            except subprocess.TimeoutExpired:
                self._service.kill()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


@dataclass
class ContainerStack:
    name: str
    redis_port: int
    ports: dict[str, int]                          # env -> published gRPC port on 127.0.0.1
    container_ids: list[str] = field(default_factory=list)
    network: str = ""

    @property
    def directory_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"


def _image_present(client, image: str) -> bool:
    import docker
    try:
        client.images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False


def start(client, envs: list[str], tag: str = "latest", redis_image: str = DEFAULT_REDIS_IMAGE,
          name: str = "envserve", first_port: int = 50051, redis_port: int = 6379, workers: int = 0,
          ready_timeout: float = 120.0) -> ContainerStack:
    """Starts Redis and one container per environment; returns once every replica is SERVING on its
    published port. Port 0 picks free ports. On failure everything started is removed again."""
    unknown = [e for e in envs if e not in FAMILY_IMAGES]
    if unknown:
        raise ValueError(f"no container image serves {unknown}; known: {sorted(FAMILY_IMAGES)}")
    # The names deploy/build-images.sh gives them, the same under docker and podman.
    images = {e: f"localhost/envserve-{FAMILY_IMAGES[e]}:{tag}" for e in envs}
    missing = sorted({i for i in images.values() if not _image_present(client, i)})
    if missing:
        raise ContainersUnavailable(f"images {missing} are missing: build them with deploy/build-images.sh")
    if not _image_present(client, redis_image):
        client.images.pull(redis_image)
    labels = {LABEL: name}
    stack = ContainerStack(name, redis_port or _free_port(), {})
    try:
        net = client.networks.create(f"{name}_net", driver="bridge", labels=labels)
        stack.network = net.name
        redis = client.containers.run(
            redis_image, ["redis-server", "--protected-mode", "no", "--save", "", "--appendonly", "no"],
            name=f"{name}_redis", network=net.name, labels=labels, detach=True,
            ports={"6379/tcp": ("127.0.0.1", stack.redis_port)})
        stack.container_ids.append(redis.id)
        for i, env in enumerate(envs):
            port = first_port + i if first_port else _free_port()
            cname = f"{name}_{env}"
            c = client.containers.run(
                images[env], ["serve", env, "--host", "0.0.0.0", "--port", "50051", "--workers", str(workers),
                              "--metrics-host", "0.0.0.0", "--metrics-port", "9100"],
                name=cname, network=net.name, labels=labels, detach=True,
                ports={"50051/tcp": ("127.0.0.1", port)},
                environment={"ENVSERVE_DIRECTORY": f"redis://{name}_redis:6379/0",
                             "ENVSERVE_ADVERTISE": f"{cname}:50051",
                             "ENVSERVE_EXTERNAL_ADDRESS": f"127.0.0.1:{port}"})
            stack.container_ids.append(c.id)
            stack.ports[env] = port
        _wait_serving(client, stack, ready_timeout)
    except BaseException:
        stop(client, stack)
        raise
    return stack


def _serving(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _listed(stack: ContainerStack) -> set[str]:
    """Environments whose replica is in the directory (what a RoutedClient will see)."""
    from envserve.directory import DirectoryUnavailable, open_directory
    try:
        with open_directory(stack.directory_url) as d:
            return {e for r in d.replicas() for e in r.envs}
    except DirectoryUnavailable:
        return set()


def _wait_serving(client, stack: ContainerStack, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = dict(stack.ports)
    while waiting:
        waiting = {e: p for e, p in waiting.items() if not _serving(f"127.0.0.1:{p}")}
        if not waiting:
            listed = _listed(stack)
            waiting = {e: p for e, p in stack.ports.items() if e not in listed}
        if not waiting:
            return
        for cid in stack.container_ids:
            c = client.containers.get(cid)
            if c.status in ("exited", "dead"):
                raise RuntimeError(f"container {c.name} exited:\n{c.logs(tail=40).decode(errors='replace')}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not serving after {timeout:.0f} s: {sorted(waiting)}")
        time.sleep(0.5)


def stop(client, stack: ContainerStack, drain_seconds: int = 70) -> None:
    """SIGTERM (replicas drain), then removes the containers and the network."""
    import docker
    for cid in reversed(stack.container_ids):
        try:
            c = client.containers.get(cid)
            c.stop(timeout=drain_seconds)
            c.remove(force=True)
        except docker.errors.NotFound:
            pass
    stack.container_ids.clear()
    if stack.network:
        try:
            client.networks.get(stack.network).remove()
        except docker.errors.NotFound:
            pass
        stack.network = ""


def up(envs: list[str] | None = None, tag: str = "latest", redis_image: str = "", name: str = "envserve",
       first_port: int = 50051, redis_port: int = 6379, workers: int = 0) -> int:
    """The command: start, print where everything is, wait for Ctrl-C or SIGTERM, stop.
    envs: default every environment that has a family image."""
    envs = list(envs) if envs else list(FAMILY_IMAGES)
    conn = EngineConnection()
    stop_now = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop_now.set())
    try:
        stack = start(conn.client, envs, tag=tag, redis_image=redis_image or os.environ.get(
            "ENVSERVE_REDIS_IMAGE", DEFAULT_REDIS_IMAGE), name=name, first_port=first_port,
            redis_port=redis_port, workers=workers)
        try:
            for env, port in stack.ports.items():
                print(f"envserve up --containers: {env} on 127.0.0.1:{port}", flush=True)
            print(f"directory {stack.directory_url}; RoutedClient('{stack.directory_url}', use_external=True)",
                  flush=True)
            while not stop_now.wait(1.0):
                pass
        finally:
            stop(conn.client, stack)
    finally:
        conn.close()
    return 0
