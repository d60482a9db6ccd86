"""A certificate authority, and server and client certificates it signed, made with openssl for the
TLS tests (the server's names 127.0.0.1 and localhost)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> Path:
    """ca.pem, server.pem/.key and client.pem/.key in d; skips the test where openssl is missing."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=envserve test CA",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", "san.ext", "-out", f"{name}.pem", cwd=d)
    return d
