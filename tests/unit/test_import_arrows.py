"""Imports flow one way (docs/ARCHITECTURE.md): every `import envserve...` of every module, those
inside functions included, read with `ast`, must follow the arrows below. A new arrow is a design
decision: add it here with the reason, or move the shared piece to envserve.common."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
TRAINER = ROOT / "trainer" / "envserve_trainer"

# part -> the parts it may import. "v1" is the generated protocol, "common" the neutral home of
# shared pieces, "rpc" the gRPC plumbing servers share (auth, parsing, metrics, TLS, value codecs),
# "directory" the replica registry that servers write and clients read.
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "v1": set(),
    "core": {"common"},
    "envs": {"core", "common"},
    "rpc": {"v1", "common"},
    "directory": {"common"},
    "server": {"core", "directory", "rpc", "v1", "common"},
    "client": {"v1", "directory", "common"},
    "judge": {"client", "rpc", "v1", "common"},
    "integrations": {"client", "common"},
    "web": {"client", "directory", "rpc", "v1", "common", "package"},
    "demo": {"client"},
    "containers": {"directory"},
    "package": set(),                       # envserve/__init__.py: the version only
    "scaffold": set(),                      # `new-env`: writes a package's files, imports nothing of envserve
    # The trainer reaches envserve through the client alone (the HTTP retry loop it shares with the
    # judge is client.http_retry).
    "trainer": {"client"},
}
# The command line is the composition root: it starts servers, the judge, the facade and clients.
ROOTS = {"cli"}


def part_of(module: str) -> str:
    """envserve.<part>.… -> <part>; envserve itself -> "package"."""
    parts = module.split(".")
    if parts[0] != "envserve":
        return ""
    return parts[1] if len(parts) > 1 else "package"


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in `source`, at any depth; relative imports are
    resolved against `module` (a package's own name when is_package)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base)
                if node.module:
                    out.append((node.lineno, f"{prefix}.{node.module}"))
                else:
                    out += [(node.lineno, f"{prefix}.{a.name}") for a in node.names]
            elif node.module:
                out.append((node.lineno, node.module))
    return out


def violations(part: str, source: str, module: str, is_package: bool = False) -> list[str]:
    if part in ROOTS:
        return []
    allowed = ALLOWED.get(part)
    if allowed is None:
        return [f"{module}: part {part!r} has no arrows declared"]
    bad = []
    for line, target in imported_modules(source, module, is_package):
        to = part_of(target)
        if to and to != part and to not in allowed:
            bad.append(f"{module}:{line} imports {target} ({part} -> {to})")
    return bad


def _modules():
    for path in sorted((SERVICES / "envserve").rglob("*.py")):
        rel = path.relative_to(SERVICES).with_suffix("")
        is_package = rel.name == "__init__"
        module = ".".join(rel.parts[:-1] if is_package else rel.parts)
        yield part_of(module) if "." in module else "package", path, module, is_package
    for path in sorted(TRAINER.rglob("*.py")):
        rel = path.relative_to(TRAINER.parent).with_suffix("")
        is_package = rel.name == "__init__"
        yield "trainer", path, ".".join(rel.parts[:-1] if is_package else rel.parts), is_package


def test_every_import_follows_the_arrows():
    found = [v for part, path, module, pkg in _modules() for v in violations(part, path.read_text(), module, pkg)]
    assert not found, "imports against the arrows:\n" + "\n".join(found)


def test_every_part_is_declared_and_the_walk_sees_them():
    parts = {part for part, *_ in _modules()}
    assert {"core", "envs", "server", "client", "judge", "trainer", "common"} <= parts
    assert parts - ROOTS <= set(ALLOWED), f"undeclared parts: {parts - ROOTS - set(ALLOWED)}"


@pytest.mark.parametrize("part,module,source", [
    # core naming a concrete env, inside a function (a lazy import the registry once had)
    ("core", "envserve.core.registry", "def f():\n    import envserve.envs\n"),
    # a relative import that climbs out of its part
    ("judge", "envserve.judge.relations", "from ..core.relations import indexed_names\n"),
    ("trainer", "envserve_trainer.process.montecarlo", "from envserve.v1 import envserve_pb2\n"),
    ("client", "envserve.client.aio", "from envserve.server import app\n"),
])
def test_the_check_catches_a_backward_arrow(part, module, source):
    assert violations(part, source, module), "the checker missed a backward import"


def test_the_check_resolves_relative_imports_within_a_part():
    assert not violations("core", "from .env import Environment\nfrom . import formats\n", "envserve.core.registry")
    assert not violations("core", "from . import registry\n", "envserve.core", is_package=True)
