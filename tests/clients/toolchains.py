"""The tools the client tests drive (node, npm, buf, ...): a test skips where one is missing, unless
ENVSERVE_REQUIRE_CLIENT_TOOLCHAINS=1 (CI), where it fails naming what is missing."""
from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TYPESCRIPT = REPO / "clients" / "typescript"
REQUIRED = os.environ.get("ENVSERVE_REQUIRE_CLIENT_TOOLCHAINS") == "1"


def missing(what: str) -> None:
    """Skips the test for want of `what`, or fails it where the toolchains are required."""
    message = f"missing: {what}"
    if REQUIRED:
        pytest.fail(message + " (ENVSERVE_REQUIRE_CLIENT_TOOLCHAINS=1)", pytrace=False)
    pytest.skip(message)


def tool(name: str) -> str:
    """The path of `name` on PATH."""
    path = shutil.which(name)
    if not path:
        missing(f"{name} on PATH")
    return path


def run(cmd, cwd, env=None, timeout=600) -> subprocess.CompletedProcess:
    """Runs cmd, stdout and stderr together; the timeout only stops a hung tool."""
    return subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)


def node_modules() -> pathlib.Path:
    """clients/typescript/node_modules as package-lock.json pins it: `npm ci` where it is missing or
    older than the lock file. Test processes side by side (pytest-xdist) install one at a time."""
    npm = tool("npm")
    tool("node")
    modules = TYPESCRIPT / "node_modules"
    installed = modules / ".package-lock.json"  # written by npm at the end of an install
    with open(TYPESCRIPT / "package-lock.json") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not installed.exists() or installed.stat().st_mtime < (TYPESCRIPT / "package-lock.json").stat().st_mtime:
                done = run([npm, "ci", "--no-audit", "--no-fund"], TYPESCRIPT)
                assert done.returncode == 0, f"npm ci in {TYPESCRIPT} failed:\n{done.stdout}"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return modules


def buf() -> str:
    """$BUF, else buf on PATH, else the one clients/typescript's package-lock.json pins (as
    proto/check.sh picks it)."""
    found = os.environ.get("BUF") or shutil.which("buf")
    if found:
        return found
    if not (shutil.which("npm") and shutil.which("node")):
        missing("buf: none on PATH, nor node and npm to install the one clients/typescript pins")
    return str(node_modules() / ".bin" / "buf")
