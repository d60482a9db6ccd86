"""Start a real `envserve web` (or `envserve up --http-port`) subprocess on loopback, for tests."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

_LINE = re.compile(r"envserve web on (http://\S+)")


class WebProcess:
    def __init__(self, args, env_vars=None):
        cmd = [sys.executable, "-u", "-m", "envserve.cli", *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_vars or {}))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.url = ""
        self.output: list[str] = []
        deadline = time.time() + 120
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.output.append(line)
            m = _LINE.search(line)
            if m:
                self.url = m.group(1)
                break
        if not self.url:
            self.kill()
            raise RuntimeError("web facade did not start:\n" + "".join(self.output))
        threading.Thread(target=self._drain_output, daemon=True).start()

    @classmethod
    def facade(cls, replicas=(), directory=""):
        args = ["web", "--port", "0"] + [a for r in replicas for a in ("--replica", r)]
        if directory:
            args += ["--directory", directory]
        return cls(args)

    def _drain_output(self):
        for line in self.proc.stdout:
            self.output.append(line)

    def kill(self):
        if self.proc.poll() is None:
            import psutil
            for child in psutil.Process(self.proc.pid).children(recursive=True):  # `up` has workers
                child.kill()
            self.proc.kill()
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
