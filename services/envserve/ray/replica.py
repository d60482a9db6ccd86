"""One replica of a fleet as a Ray actor: a real `envserve serve` process, with its workers, that
lives and dies with the actor.

The actor starts the replica on its node's address with a fresh replica id, registered in the
fleet's directory, and watches it. Where the replica process dies, the actor ends itself, so Ray
restarts the actor (and with it a new replica, under a new id: clients rebuild the lost sessions
there from their own histories). Where the actor dies (its node lost, `ray.kill`), the kernel kills
the replica with it (PR_SET_PDEATHSIG), as the machine's loss would. `drain` is the shrinking
fleet's way out: the replica refuses new sessions, moves its live ones to the others, and exits.
"""
from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading

log = logging.getLogger("envserve.ray")

# `envserve serve` prints this line once it serves (server/app.py serve_forever).
READY_PREFIX = "envserve serving "
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """(In the replica process, before exec.) SIGKILL when the thread that started it ends, which
    is the actor's watcher thread: it lives as long as the actor's process."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # no glibc: the watcher's exit still ends the actor; the replica then drains itself
        pass


class ReplicaActor:
    """Made a Ray actor by the fleet (fleet.py), with the family's resources and max_restarts."""

    def __init__(self, family: str, envs: list[str], directory_url: str, serve_args: list[str],
                 start_timeout: float = 300.0):
        import ray
        self.family = family
        self.node_id = ray.get_runtime_context().get_node_id()
        self.host = ray.util.get_node_ip_address()
        self.replica_id = f"ray-{family}-{secrets.token_hex(4)}"
        self.address = ""
        self._stopping = False
        self._ready = threading.Event()
        self._failed = ""
        env = dict(os.environ, ENVSERVE_DIRECTORY=directory_url,
                   RAY_ADDRESS=ray.get_runtime_context().gcs_address)
        self._argv = [sys.executable, "-m", "envserve.cli", "serve", *envs, "--host", self.host, "--port", "0",
                      "--replica-id", self.replica_id, "--directory", directory_url, *serve_args]
        self._env = env
        self._proc: subprocess.Popen | None = None
        threading.Thread(target=self._watch, name="envserve-replica", daemon=True).start()
        if not self._ready.wait(start_timeout) or self._failed:
            self._stopping = True
            if self._proc is not None:
                self._proc.kill()
            raise RuntimeError(f"replica {self.replica_id} did not start: {self._failed or 'timed out'}")

    def _watch(self) -> None:
        try:
            self._proc = subprocess.Popen(self._argv, env=self._env, stdout=subprocess.PIPE, stderr=None,
                                          text=True, preexec_fn=_die_with_parent)
        except OSError as e:
            self._failed = str(e)
            self._ready.set()
            return
        for line in self._proc.stdout:
            if line.startswith(READY_PREFIX) and not self._ready.is_set():
                self.address = line.split(" on ", 1)[1].split()[0]
                self._ready.set()
            sys.stdout.write(line)
        code = self._proc.wait()
        if not self._ready.is_set():
            self._failed = f"exited with {code} before serving"
            self._ready.set()
            return
        if not self._stopping:
            # A replica that died under a live actor: end the actor, so Ray restarts both.
            log.warning("replica %s exited with %s; the actor ends for Ray to restart it", self.replica_id, code)
            os._exit(1)

    def info(self) -> dict:
        return {"replica_id": self.replica_id, "address": self.address, "family": self.family,
                "node_id": self.node_id, "pid": self._proc.pid if self._proc else 0}

    def drain(self, timeout: float = 120.0) -> bool:
        """SIGTERM: the replica refuses new sessions, finishes calls in flight, moves its live
        sessions to the other replicas (its --drain-timeout), deregisters and exits. True when it
        exited within timeout (else it is killed)."""
        self._stopping = True
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return True
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return False

    def kill_replica(self) -> int:
        """Kills the replica process (not the actor), as a crash would; Ray then restarts the actor."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        return proc.pid if proc else 0

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __del__(self):
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()

