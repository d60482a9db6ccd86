"""Start a real `envserve web` (or `envserve up --http-port`) subprocess on loopback, for tests."""
from __future__ import annotations

import re

from serverproc import start_cli

_LINE = re.compile(r"envserve web on (https?://\S+)")


class WebProcess:
    def __init__(self, args, env_vars=None):
        self.proc, m, self.output = start_cli(args, _LINE, env_vars, what="web facade")
        self.url = m.group(1)

    @classmethod
    def facade(cls, replicas=(), directory="", extra=(), env_vars=None):
        args = ["web", "--port", "0"] + [a for r in replicas for a in ("--replica", r)]
        if directory:
            args += ["--directory", directory]
        return cls(args + list(extra), env_vars)

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
