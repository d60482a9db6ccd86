"""Imports flow one way (docs/ARCHITECTURE.md): every `import envserve...` of every module, those
inside functions included, read with `ast`, must follow the arrows below. A new arrow is a design
decision: add it here with the reason, or move the shared piece to envserve.common.

The trainer has stages of its own (TRAINER_ALLOWED): each `envserve_trainer.<stage>` imports only the
stages below it, and the entry points on top import them all. `trainer_report()` draws those arrows."""
from __future__ import annotations

import ast
import re
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
    "containers": {"directory", "common"},
    # The Ray fleet starts replicas as processes (`envserve serve`) and reads the directory.
    "ray": {"directory", "common"},
    "package": set(),                       # envserve/__init__.py: the version only
    "scaffold": set(),                      # `new-env`: writes a package's files, imports nothing of envserve
    # The trainer reaches envserve through the client alone (the HTTP retry loop it shares with the
    # judge is client.http_retry).
    "trainer": {"client"},
}
# The command line is the composition root: it starts servers, the judge, the facade and clients.
ROOTS = {"cli"}

# The trainer's stages, bottom up: stage -> the stages it may import. A run's settings come first,
# then the networks, the policies that sample from them, the methods that score what they did, the
# rollouts that play, the samples built from the trials, the update that learns from them. "entry"
# is every module directly under envserve_trainer (cli, train, sft, collect, evaluation, curves,
# process_training, api, __main__): the commands, which may import every stage.
TRAINER_STAGES = ("config", "models", "policies", "methods", "rollout", "samples", "update")
TRAINER_ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "models": {"config"},
    "policies": {"models", "config"},
    "methods": {"config"},
    "rollout": {"policies", "models", "methods", "config"},
    "samples": {"rollout", "methods", "config"},
    "update": {"samples", "rollout", "policies", "models", "methods", "config"},
    "entry": {*TRAINER_STAGES, "package"},
    "package": set(),                       # envserve_trainer/__init__.py: the version only
}


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


def stage_of(module: str) -> str:
    """envserve_trainer.<stage>.… -> <stage>; a module directly under envserve_trainer -> "entry";
    envserve_trainer itself -> "package"; "" outside the trainer."""
    parts = module.split(".")
    if parts[0] != "envserve_trainer":
        return ""
    if len(parts) == 1:
        return "package"
    return parts[1] if parts[1] in TRAINER_STAGES else "entry"


def violations(part: str, source: str, module: str, is_package: bool = False) -> list[str]:
    if part in ROOTS:
        return []
    bad = arrow_violations(source, module, is_package, part, ALLOWED, part_of, "part")
    if part == "trainer":
        bad += trainer_violations(source, module, is_package)
    return bad


def trainer_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """The trainer's own arrows: an import of another stage that TRAINER_ALLOWED does not list."""
    return arrow_violations(source, module, is_package, stage_of(module), TRAINER_ALLOWED, stage_of, "stage")


def arrow_violations(source: str, module: str, is_package: bool, here: str, table: dict[str, set[str]],
                     where, kind: str) -> list[str]:
    """Imports of `source` (module `module`, in `here`) landing in a place `table[here]` does not list;
    `where` names the place of a module ("" outside the table's world)."""
    allowed = table.get(here)
    if allowed is None:
        return [f"{module}: {kind} {here!r} has no arrows declared"]
    bad = []
    for line, target in imported_modules(source, module, is_package):
        to = where(target)
        if to and to != here and to not in allowed:
            bad.append(f"{module}:{line} imports {target} ({here} -> {to})")
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


def _trainer_modules():
    return [(path, module, pkg) for part, path, module, pkg in _modules() if part == "trainer"]


def trainer_arrows() -> dict[str, dict[str, list[str]]]:
    """stage -> the stages it imports -> the modules that do (sorted), from the trainer's sources."""
    arrows: dict[str, dict[str, set[str]]] = {}
    for path, module, pkg in _trainer_modules():
        stage = stage_of(module)
        arrows.setdefault(stage, {})
        for _, target in imported_modules(path.read_text(), module, pkg):
            to = stage_of(target)
            if to and to != stage:
                arrows[stage].setdefault(to, set()).add(module)
    return {s: {t: sorted(m) for t, m in sorted(d.items())} for s, d in arrows.items()}


def stage_cycle(arrows: dict[str, dict[str, list[str]]]) -> list[str]:
    """One cycle of the stage graph (its stages in order, the first repeated at the end), or []."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(stage: str) -> list[str]:
        state[stage] = 1
        path.append(stage)
        for to in arrows.get(stage, {}):
            if state.get(to) == 1:
                return path[path.index(to):] + [to]
            if not state.get(to):
                found = visit(to)
                if found:
                    return found
        path.pop()
        state[stage] = 2
        return []

    for stage in sorted(arrows):
        if not state.get(stage):
            found = visit(stage)
            if found:
                return found
    return []


def trainer_report(arrows: dict[str, dict[str, list[str]]] | None = None) -> str:
    """The trainer's stages bottom up, each with the stages it imports and may import; an arrow
    TRAINER_ALLOWED does not list is marked UPWARD."""
    arrows = trainer_arrows() if arrows is None else arrows
    lines = ["envserve_trainer stages (bottom up): stage -> imports [may import]"]
    for stage in (*TRAINER_STAGES, "entry", "package"):
        allowed = TRAINER_ALLOWED[stage]
        used = [t if t in allowed else f"{t} (UPWARD)" for t in arrows.get(stage, {})]
        lines.append(f"  {stage:9} -> {', '.join(used) or '-'}   [{', '.join(sorted(allowed)) or 'nothing'}]")
    cycle = stage_cycle(arrows)
    lines.append(f"  cycle: {' -> '.join(cycle) if cycle else 'none'}")
    return "\n".join(lines)


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
    ("trainer", "envserve_trainer.methods.process.montecarlo", "from envserve.v1 import envserve_pb2\n"),
    ("client", "envserve.client.aio", "from envserve.server import app\n"),
    # the trainer's own stages: a lower stage reaching up, absolute, relative and lazy
    ("trainer", "envserve_trainer.config.loading", "from envserve_trainer.train import Connection\n"),
    ("trainer", "envserve_trainer.methods.grpo", "from ..rollout.trajectory import Trial\n"),
    ("trainer", "envserve_trainer.rollout.engine", "def f():\n    from ..update.learner import Learner\n"),
    ("trainer", "envserve_trainer.models.small", "from .. import policies\n"),
    ("trainer", "envserve_trainer.samples.build", "import envserve_trainer.cli\n"),
])
def test_the_check_catches_a_backward_arrow(part, module, source):
    assert violations(part, source, module), "the checker missed a backward import"


def test_the_trainer_stages_form_no_cycle_and_no_upward_arrow():
    arrows = trainer_arrows()
    report = trainer_report(arrows)
    print(report)
    assert set(arrows) <= set(TRAINER_ALLOWED), f"undeclared trainer stages: {set(arrows) - set(TRAINER_ALLOWED)}"
    assert {*TRAINER_STAGES, "entry"} <= set(arrows), "the walk missed a trainer stage"
    assert not stage_cycle(arrows), report
    assert "UPWARD" not in report, report
    # the table itself is a one-way order: every stage imports only stages listed before it
    order = (*TRAINER_STAGES, "entry")
    for stage in TRAINER_STAGES:
        assert TRAINER_ALLOWED[stage] <= set(order[:order.index(stage)]), stage


def test_the_trainer_modules_form_no_cycle():
    """No circle between modules either, inside a stage or among the entry points (collect does not
    reach back to cli or train): lazy imports count."""
    sources = {module: (path, pkg) for path, module, pkg in _trainer_modules()}
    graph: dict[str, dict[str, list[str]]] = {}
    for module, (path, pkg) in sources.items():
        for _, target in imported_modules(path.read_text(), module, pkg):
            while target and target not in sources:
                target = target.rpartition(".")[0]
            if target and target != module:
                graph.setdefault(module, {})[target] = []
    cycle = stage_cycle(graph)
    assert not cycle, "trainer modules import each other in a circle: " + " -> ".join(cycle)


def test_the_report_shows_a_cycle_and_an_upward_arrow():
    arrows = {"config": {"update": ["envserve_trainer.config.x"]}, "update": {"config": ["envserve_trainer.update.y"]}}
    report = trainer_report(arrows)
    assert "update (UPWARD)" in report
    assert "cycle: config -> update -> config" in report


# `from envserve_trainer.x import _name` or `envserve_trainer.x._name` outside the trainer
_PRIVATE_ATTR = re.compile(r"\benvserve_trainer(?:\.\w+)*\._\w+")


def private_trainer_imports(source: str) -> list[str]:
    """Every use of a leading-underscore name of the trainer in `source`: imported by name, a private
    module in the path, or reached as an attribute in a dotted path."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "envserve_trainer":
            if any(p.startswith("_") and not p.startswith("__") for p in node.module.split(".")):
                found.append(f"{node.lineno}: {node.module}")
            found += [f"{node.lineno}: {node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: {a.name}" for a in node.names if a.name.split(".")[0] == "envserve_trainer"
                      and any(p.startswith("_") and not p.startswith("__") for p in a.name.split("."))]
    found += [m.group(0) for m in _PRIVATE_ATTR.finditer(source) if not m.group(0).split(".")[-1].startswith("__")]
    return found


def test_nothing_outside_the_trainer_imports_its_private_names():
    found = []
    for folder in ("bench", "examples", "tests", "services"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__):
                continue
            found += [f"{path.relative_to(ROOT)}:{hit}" for hit in private_trainer_imports(path.read_text())]
    assert not found, "private trainer names used outside trainer/:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "from envserve_trainer.cli import _config\n",
    "def f():\n    from envserve_trainer.policies.hf import _load_state\n",
    "import envserve_trainer.policies.hf\nx = envserve_trainer.policies.hf._load_state\n",
])
def test_the_private_name_check_catches_one(source):
    assert private_trainer_imports(source)


def test_the_check_resolves_relative_imports_within_a_part():
    assert not violations("core", "from .env import Environment\nfrom . import formats\n", "envserve.core.registry")
    assert not violations("core", "from . import registry\n", "envserve.core", is_package=True)
