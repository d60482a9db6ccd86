"""Start real envserve servers as subprocesses on loopback, for tests and benchmarks."""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

_LINE = re.compile(r"serving .* on ([\d.]+:\d+) with \d+ workers(?:, metrics on :(\d+))?")


def stop_on_sigterm() -> None:
    """Makes a SIGTERM to this process unwind it like Ctrl-C does, so the servers its `with` blocks
    started are stopped; by default a SIGTERM ends it at once and leaves them running. Call from the
    main thread of a long benchmark (Python runs the handler there, between its bytecodes)."""
    def _unwind(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, _unwind)


def calls_while_it_stops(proc: subprocess.Popen, call, threads: int = 4) -> collections.Counter:
    """SIGTERMs a replica process while `threads` threads make call() back to back, until it has
    exited and each thread has called about twice more; returns how often each outcome happened:
    call()'s return value, or for an exception its gRPC code's name (else its repr)."""
    outcomes: collections.Counter = collections.Counter()
    lock, stop = threading.Lock(), threading.Event()

    def hammer():
        while not stop.is_set():
            try:
                outcome = call()
            except Exception as e:  # noqa: BLE001 - counted, so that the caller's assertions name it
                code = getattr(e, "code", None)
                outcome = code.name if isinstance(code, grpc.StatusCode) else repr(e)
            with lock:
                outcomes[outcome] += 1

    def until(done):
        deadline = time.monotonic() + 60
        while not done() and time.monotonic() < deadline:
            time.sleep(0.05)

    workers = [threading.Thread(target=hammer) for _ in range(threads)]
    for t in workers:
        t.start()
    try:
        until(lambda: sum(outcomes.values()) >= 10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        after = sum(outcomes.values())
        until(lambda: sum(outcomes.values()) >= after + 2 * threads)  # calls made after it exited too
    finally:
        stop.set()
        for t in workers:
            t.join(60)
    return outcomes


def start_cli(args, line_pattern: re.Pattern, env_vars=None, what="server"):
    """Runs `envserve ARGS` and reads its output until line_pattern matches (the ready line).
    Returns (process, match, output lines); the rest of the output keeps being collected."""
    cmd = [sys.executable, "-u", "-m", "envserve.cli", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_vars or {}))
    # Its own temporary folder, removed once the process object goes: a replica killed with SIGKILL
    # (as tests do, to play a crash) cannot remove its multiprocessing forkserver's pymp-* folder.
    tmp = tempfile.mkdtemp(prefix="envserve-cli-")
    if "TMPDIR" not in (env_vars or {}):
        env["TMPDIR"] = tmp
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    weakref.finalize(proc, shutil.rmtree, tmp, True)
    output: list[str] = []
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        output.append(line)
        m = line_pattern.search(line)
        if m:
            def drain():
                for rest in proc.stdout:
                    output.append(rest)
            threading.Thread(target=drain, daemon=True).start()
            return proc, m, output
    proc.kill()
    raise RuntimeError(f"{what} did not start:\n" + "".join(output))


def wait_until(condition, what: str, limit: float = 120.0):
    """Polls until condition() holds; the limit only stops a broken run from hanging (it is no
    measure of speed)."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


def serve_refusal(env_id: str, env_vars=None) -> subprocess.CompletedProcess:
    """`envserve serve ENV_ID` where it cannot start: its exit status and the line telling why."""
    return subprocess.run([sys.executable, "-m", "envserve.cli", "serve", env_id, "--port", "0"], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, **(env_vars or {})))


def start_together(*makers) -> list:
    """Calls each maker (a callable that starts a server and returns it: a ServerProcess, a
    JudgeProcess) on a thread of its own and returns the servers in the makers' order. A start is
    mostly the new process importing its envs, and those overlap. If one fails, the others are
    killed and its error is raised."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(makers))) as pool:
        futures = [pool.submit(make) for make in makers]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for f in futures:
            if f.exception() is None:
                f.result().kill()
        raise failed[0]
    return [f.result() for f in futures]


class ServerProcess:
    def __init__(self, envs, workers=2, extra=(), metrics=True, env_vars=None, tls_ca=None):
        # tls_ca: the CA's PEM bytes, or whole grpc.ChannelCredentials (mutual TLS).
        self.tls_ca = tls_ca
        args = ["serve", *envs, "--port", "0", "--workers", str(workers), *extra]
        if metrics:
            args += ["--metrics-port", "0"]
        self.proc, m, self.output = start_cli(args, _LINE, env_vars)
        self.address = m.group(1)
        self.metrics_port = int(m.group(2) or 0)
        self.wait_serving()

    def wait_serving(self, timeout=30.0):
        creds = self.tls_ca
        if isinstance(creds, bytes):
            creds = grpc.ssl_channel_credentials(creds)
        ch = grpc.secure_channel(self.address, creds) if creds else grpc.insecure_channel(self.address)
        with ch:
            stub = health_pb2_grpc.HealthStub(ch)
            deadline = time.time() + timeout
            while time.time() < deadline:
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        raise RuntimeError("server never became healthy")

    def worker_pids(self) -> list[int]:
        """Workers are children of the multiprocessing forkserver, itself a child of the server."""
        pids = []
        for child in psutil.Process(self.proc.pid).children():
            if any("forkserver" in part for part in child.cmdline()):
                pids += [p.pid for p in child.children()]
        return sorted(pids)

    def metrics_text(self) -> str:
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str) -> float:
        """The sum of a metric's samples (every label) in the replica's Prometheus text."""
        total = 0.0
        for line in self.metrics_text().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def terminate(self, timeout=30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def kill(self):
        if self.proc.poll() is None:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                child.kill()
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


_JUDGE_LINE = re.compile(r"envserve judge on ([\d.]+:\d+)(?:.*metrics on :(\d+))?")


class JudgeProcess(ServerProcess):
    """`envserve judge` reading ground truth from `env_address` (or a directory URL)."""

    def __init__(self, env_address: str = "", extra=(), directory: str = "", env_vars=None, metrics=False):
        source = ["--env-address", env_address] if env_address else ["--directory", directory]
        args = ["judge", "--port", "0", *source, *extra] + (["--metrics-port", "0"] if metrics else [])
        self.tls_ca = None
        self.proc, m, self.output = start_cli(args, _JUDGE_LINE, env_vars, what="judge")
        self.address = m.group(1)
        self.metrics_port = int(m.group(2) or 0)
        self.wait_serving()


class RedisProcess:
    """A real redis-server on a loopback port, with no persistence: a restart empties it,
    as a Redis pod without a volume would be."""

    def __init__(self, port: int = 0):
        import shutil
        import socket
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        if not port:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def redis_or_skip() -> "RedisProcess":
    """A real redis-server on a loopback port, or the test skipped where none is installed."""
    try:
        return RedisProcess()
    except FileNotFoundError as e:
        import pytest
        pytest.skip(str(e))


class Cluster:
    """Replicas registered in one directory, by replica id; a killed one can come back."""

    def __init__(self, redis_url: str, envs, ids, workers=1, env_vars=None, heartbeat=0.5):
        self.url, self.envs, self.workers, self.env_vars = redis_url, list(envs), workers, env_vars
        self.heartbeat = heartbeat
        self.replicas: dict[str, ServerProcess] = {}
        started = start_together(*(functools.partial(self.start, rid) for rid in ids))
        self.replicas = dict(zip(ids, started))   # in the order asked for
        self.wait_listed(ids)

    def start(self, rid: str, port: int = 0) -> ServerProcess:
        self.replicas[rid] = ServerProcess(self.envs, workers=self.workers, metrics=False, env_vars=self.env_vars,
                                           extra=["--directory", self.url, "--heartbeat-seconds", str(self.heartbeat),
                                                  "--replica-id", rid, "--port", str(port)])
        return self.replicas[rid]

    def wait_listed(self, ids, timeout=60.0):
        from envserve.directory import open_directory
        directory = open_directory(self.url)
        deadline = time.time() + timeout
        try:
            while time.time() < deadline:
                try:
                    if set(ids) <= {r.replica_id for r in directory.replicas()}:
                        return
                except Exception:
                    pass
                time.sleep(0.05)
        finally:
            directory.close()
        raise AssertionError(f"directory never listed {ids}")

    def close(self):
        for p in self.replicas.values():
            p.kill()


@functools.cache
def sapien_vulkan_problem() -> str:
    """Empty when SAPIEN (ManiSkill) can create its render device here, else why not; probed in a
    child, to keep the test process clean, once a test run (the machine does not change within it)."""
    probe = "import sapien; sapien.render.RenderSystem(); print('ok')"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "creating a SAPIEN render device timed out"
    return "" if out.returncode == 0 and "ok" in out.stdout else (out.stderr.strip().splitlines() or ["?"])[-1]
