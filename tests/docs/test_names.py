"""Every command, flag, config key, ENVSERVE_* variable and repository path that README.md and the
docs name exists: the subcommands and flags in the commands' own --help, the config keys in the
env specs and the trainer's and judge's config classes, the variables in the code, the paths in the
tree. Names are read from code spans and code blocks (and link targets, for paths), so prose may use
ordinary words freely while anything written as code must be real."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Files a reader creates or a run writes, named in the docs as examples of a user's own files: a
# config, a run's outputs, the files of a generated ALFWorld game.
USER_FILES = {"my.yaml", "demos.jsonl", "eval.json", "judge.json", "agent_loops.yaml", "tools.yaml",
              "metrics.jsonl", "curves.png", "summary.json", "checkpoint-N/", "reference/", "policy/",
              "traj_data.json", "initial_state.pddl", "game.tw-pddl"}
# Keys that belong to a framework's own files, shown where the docs explain how envserve reads them.
FRAMEWORK_KEYS = {"tools_kwargs", "create_kwargs"}
# Commands of other tools, whose flags are theirs (docker, kubectl, torchrun...): not checked.
FOREIGN = {"docker", "podman", "kubectl", "curl", "grpcurl", "pip", "git", "torchrun", "helm", "apt-get",
           "sudo", "export", "cd", "ls", "cat", "echo", "python3", "podman-compose", "uv"}
PATH_EXT = r"(?:py|yaml|yml|md|sh|json|jsonl|toml|proto|cff|txt|cfg|png|svg|pddl|conf)"
PATH_RE = re.compile(rf"^(?:\.{{0,2}}/)?[\w.-]+(?:/[\w.-]+)*(?:/|\.{PATH_EXT})$")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT / "services"), str(ROOT / "trainer"), os.environ.get("PYTHONPATH", "")])))


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)]


def spans(text: str) -> list[str]:
    """Inline code spans, and the lines of code blocks that are not Python, YAML or JSON."""
    out, in_block, lang = [], False, ""
    prose = []
    for line in text.splitlines():
        fence = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", line)
        if fence:
            in_block, lang = (not in_block, fence.group(2)) if not in_block else (False, "")
            continue
        if in_block:
            if lang in ("", "bash", "sh", "shell", "console", "text"):
                out.append(re.sub(r"\s+#.*$", "", line).strip())
        else:
            prose.append(line)
    joined = "\n".join(prose)
    out += [m.group(2).strip() for m in re.finditer(r"(`+)(.+?)\1", joined, flags=re.S)]
    return [s for s in out if s]


def link_targets(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)", text)]


# -- what exists ----------------------------------------------------------------------------------
def _help(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300).stdout


def _subcommands(help_text: str) -> list[str]:
    m = re.search(r"\{([\w,-]+)\}", help_text)
    return m.group(1).split(",") if m else []


@functools.lru_cache(maxsize=None)
def cli_helps() -> dict[str, dict[str, str]]:
    """{'envserve': {'': top help, 'serve': its help, ...}, 'envserve-train': {...}}"""
    tools = {"envserve": [sys.executable, "-m", "envserve.cli"],
             "envserve-train": [sys.executable, "-m", "envserve_trainer"]}
    out = {}
    with ThreadPoolExecutor(4) as pool:
        for name, cmd in tools.items():
            top = _help([*cmd, "--help"])
            subs = _subcommands(top)
            assert subs, f"{name} --help lists no subcommands:\n{top}"
            helps = dict(zip(subs, pool.map(lambda s: _help([*cmd, s, "--help"]), subs)))
            # A subcommand with subcommands of its own (`tasks list|export`): its help gets theirs,
            # so a doc's `envserve tasks export --split` finds the flag.
            for sub, text in list(helps.items()):
                m = re.search(r"\{([\w,-]+)\} \.\.\.", text)   # argparse's usage of a subparser
                nested = m.group(1).split(",") if m else []
                helps[sub] += "".join(pool.map(lambda n: _help([*cmd, sub, n, "--help"]), nested))
            out[name] = {"": top, **helps}
    return out


def flags_of(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", text))


@functools.lru_cache(maxsize=None)
def tracked() -> list[str]:
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return [f for f in files if (ROOT / f).exists()]


@functools.lru_cache(maxsize=None)
def tracked_dirs() -> set[str]:
    dirs = set()
    for f in tracked():
        parts = f.split("/")[:-1]
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return dirs


@functools.lru_cache(maxsize=None)
def source_text() -> str:
    """The code and configuration of the tree (not README.md or docs/, which are what is checked)."""
    keep = (".py", ".sh", ".yaml", ".yml", ".toml", ".conf", ".json", "Dockerfile", "Makefile", "run")
    return "\n".join((ROOT / f).read_text(errors="replace") for f in tracked()
                     if not f.startswith(("docs/", "tests/docs/")) and f != "README.md" and f.endswith(keep))


def script_flags() -> set[str]:
    """Flags that the repository's own scripts (bench/, deploy/, tests/ helpers) define."""
    out = set()
    for f in tracked():
        if f.startswith(("bench/", "deploy/", "tests/", ".ci/")) and f.endswith((".py", ".sh", "run")):
            out |= flags_of((ROOT / f).read_text(errors="replace"))
    return out


@functools.lru_cache(maxsize=None)
def make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


@functools.lru_cache(maxsize=None)
def compose_profiles() -> set[str]:
    text = "\n".join(p.read_text() for p in ROOT.glob("docker-compose*.yml"))
    return {p for group in re.findall(r"profiles:\s*\[([^\]]*)\]", text) for p in re.findall(r"[\w-]+", group)}


def _dataclass_fields(module_names) -> set[str]:
    names = set()
    for mod in module_names:
        m = importlib.import_module(mod)
        for _, cls in inspect.getmembers(m, inspect.isclass):
            if dataclasses.is_dataclass(cls):
                names |= {f.name for f in dataclasses.fields(cls)}
    return names


@functools.lru_cache(maxsize=None)
def config_keys() -> set[str]:
    """Keys a user may write in a config: every env's session config, the trainer's sections and
    methods, the judge's settings, and the keys of the bundled YAML configs."""
    import yaml

    import envserve.envs  # noqa: F401
    from envserve.core.registry import env_ids, get_env_class
    from envserve.core.session import full_spec

    keys = set()
    for env_id in env_ids():
        keys |= set(full_spec(get_env_class(env_id).spec).config_defaults)
    keys |= _dataclass_fields(["envserve_trainer.config.train_config", "envserve_trainer.config.algo",
                               "envserve_trainer.config.process", "envserve.judge.config",
                               "envserve.judge.llm_judge"])

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                keys.add(str(k))
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    for f in tracked():
        if f.endswith((".yaml", ".yml")) and f.startswith("trainer/"):
            walk(yaml.safe_load((ROOT / f).read_text()))
    # What an env author writes in a spec, and the fields of the protocol's messages.
    from envserve import v1  # noqa: F401
    from envserve.core.env import EnvSpec
    from envserve.v1 import envserve_pb2
    keys |= {f.name for f in dataclasses.fields(EnvSpec)}
    for message in envserve_pb2.DESCRIPTOR.message_types_by_name.values():
        keys |= {f.name for f in message.fields}
    keys |= FRAMEWORK_KEYS
    # The framework adapters' config keys (verl's agent-loop and tool YAML, SkyRL's env_config).
    for f in tracked():
        if f.startswith("services/envserve/integrations/") and f.endswith(".py"):
            keys |= set(re.findall(r"""(?:get|pop)\(\s*["'](\w+)["']""", (ROOT / f).read_text()))
            keys |= set(re.findall(r"""\[\s*["'](\w+)["']\s*\]""", (ROOT / f).read_text()))
    return keys


@functools.lru_cache(maxsize=None)
def trainer_sections() -> dict[str, set[str]]:
    from envserve_trainer.config.train_config import TrainConfig

    out = {}
    for f in dataclasses.fields(TrainConfig):
        names = set()
        todo = [f.default_factory()]
        while todo:
            obj = todo.pop()
            for g in dataclasses.fields(obj):
                names.add(g.name)
                value = getattr(obj, g.name)
                if dataclasses.is_dataclass(value):
                    todo.append(value)
        out[f.name] = names
    return out


# -- checks ----------------------------------------------------------------------------------------
def _tokens(span: str) -> list[str]:
    try:
        tokens = shlex.split(span, comments=False)
    except ValueError:
        tokens = span.split()
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):      # VAR=value before a command
        tokens.pop(0)
    return tokens


def check_command(span: str) -> list[str]:
    """Problems with a command line: an unknown subcommand, a flag its --help does not list, a make
    target or compose profile that does not exist, a script that is not in the tree."""
    tokens = _tokens(span)
    if not tokens:
        return []
    # `python -m envserve_trainer train ...`, `torchrun ... -m envserve_trainer train ...`
    for i, t in enumerate(tokens[:-1]):
        if t == "-m" and tokens[i + 1] in ("envserve_trainer", "envserve.cli"):
            tokens = ["envserve-train" if tokens[i + 1] == "envserve_trainer" else "envserve", *tokens[i + 2:]]
            break
    head = tokens[0].rsplit("/", 1)[-1] if tokens[0].endswith(("envserve", "envserve-train")) else tokens[0]
    problems = []
    if head in ("envserve", "envserve-train"):
        helps = cli_helps()[head]
        subs = [s for s in re.split(r"[|]", tokens[1])] if len(tokens) > 1 and not tokens[1].startswith("-") else [""]
        for sub in subs:
            if sub not in helps:
                problems.append(f"`{head} {sub}` is not a subcommand ({', '.join(k for k in helps if k)})")
                continue
            for flag in flags_of(" ".join(tokens[1:])):
                if flag not in flags_of(helps[sub]):
                    problems.append(f"`{head} {sub}` has no flag {flag}")
    elif head == "make":
        for target in tokens[1:]:
            if not target.startswith("-") and "=" not in target and target not in make_targets():
                problems.append(f"`make {target}`: no such target in the Makefile")
    elif head in ("python", "bash", "sh") or head.endswith("/python") or head.endswith(".sh"):
        script = tokens[0] if head.endswith(".sh") else next((t for t in tokens[1:] if t.endswith((".py", ".sh"))), None)
        if script and not script.startswith(("-", "/")):
            if not (ROOT / script).is_file():
                problems.append(f"{script}: no such file")
            else:
                known = flags_of((ROOT / script).read_text(errors="replace"))
                for flag in flags_of(" ".join(tokens[tokens.index(script) + 1:])):
                    if flag not in known:
                        problems.append(f"{script} defines no flag {flag}")
    elif head in ("docker", "podman", "podman-compose"):
        for i, t in enumerate(tokens[:-1]):
            if t == "--profile" and tokens[i + 1] not in compose_profiles():
                problems.append(f"compose profile {tokens[i + 1]!r} does not exist ({sorted(compose_profiles())})")
    return problems


def check_flags(span: str) -> list[str]:
    """A span that is flags only (`--inline`, `--llm-model NAME`): each flag is one of envserve's."""
    known = set().union(*(flags_of(h) for tool in cli_helps().values() for h in tool.values()), script_flags())
    return [f"flag {f} is no flag of envserve, envserve-train or the repository's scripts"
            for f in flags_of(span) if f not in known]


def check_path(path: str, base: Path) -> list[str]:
    path = path.strip()
    if path.startswith(("http:", "https:", "~", "/", "$")) or not PATH_RE.match(path):
        return []
    if path in USER_FILES:
        return []
    rel = os.path.normpath(os.path.join(os.path.relpath(base, ROOT), path)).replace(os.sep, "/")
    candidates = [rel, path.rstrip("/").removeprefix("./")]
    for c in candidates:
        c = c.rstrip("/")
        if c in tracked() or c in tracked_dirs() or (ROOT / c).exists() and c != "..":
            if not c.startswith(".."):
                return []
    clean = path.rstrip("/").removeprefix("./")
    # A path written inside a package (`envs/webshop/generate.py`, `process/config.py`, `rollout.py`).
    if any(f.endswith("/" + clean) for f in tracked()) or any(d.endswith("/" + clean) for d in tracked_dirs()):
        return []
    # Something a run writes or a venv holds (runs/, .venv/, .wheelhouse/...): git ignores it.
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", clean + ("/" if path.endswith("/") else "")],
                             cwd=ROOT).returncode == 0
    if ignored:
        return []
    # The environment pages, which the docs build writes from live runs (docs/hooks/env_pages.py).
    m = re.match(r"^(?:docs/)?environments/(\w+)\.md$", rel.removeprefix("docs/") if rel.startswith("docs/") else clean)
    if m and (ROOT / "services" / "envserve" / "envs" / m.group(1) / "__init__.py").exists():
        return []
    return [f"path {path} does not exist in the repository"]


def problems_in(doc: Path) -> list[str]:
    return problems_in_text(doc.read_text(), doc.parent, str(doc.relative_to(ROOT)))


def problems_in_text(text: str, base: Path, where: str) -> list[str]:
    """What `text`, a page in the folder `base`, names that does not exist."""
    out = []
    for span in spans(text):
        first = span.split()[0] if span.split() else ""
        if re.match(r"^([A-Z_][A-Z0-9_]*=\S*\s+)*(\S*/)?(envserve|envserve-train|make|python|bash|docker|podman|"
                    r"podman-compose|torchrun)\b", span) or first.endswith((".sh", "/python")):
            out += check_command(span)
        elif span.startswith("--"):
            out += check_flags(span)
        m = re.match(r"^([a-z][a-z0-9_]*): ", span)
        if m and m.group(1) not in config_keys():
            out.append(f"config key {m.group(1)!r} (in `{span}`) is no env, trainer or judge config key")
        m = re.match(r"^(env|rollout|algo|update|model|run|sft|process)\.([a-z_]+)\b", span)
        if m and not PATH_RE.match(span) and m.group(2) not in trainer_sections()[m.group(1)]:
            out.append(f"trainer config has no {m.group(1)}.{m.group(2)}")
        if " " not in span:
            out += check_path(span, ROOT)
    for target in link_targets(text):
        if not re.match(r"^[a-z]+:", target):
            out += check_path(target, base)
    for var in set(re.findall(r"ENVSERVE_[A-Z0-9_*]+", text)):
        pattern = re.escape(var).replace(r"\*", r"[A-Z0-9_]+") + r"(?![A-Z0-9_])"
        if not re.search(pattern, source_text()):
            out.append(f"{var} is read nowhere in the code")
    return [f"{where}: {p}" for p in out]


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_names_in_docs_exist(doc):
    assert problems_in(doc) == []


def test_the_checks_catch_made_up_names():
    """The same checks on a page naming things that do not exist report each of them."""
    problems = problems_in_text(
        "Run `envserve serve sokoban --no-such-flag` or `envserve frobnicate`, then `make no-such-target`,\n"
        "`python bench/no_such_bench.py --json`, set `ENVSERVE_NO_SUCH_VARIABLE`, write `no_such_key: 3`\n"
        "and `rollout.no_such_field`, and read `services/envserve/no_such_module.py` and [x](../no/such/file.md).\n"
        "```\ndocker compose --profile no-such-profile up -d\n```\n", DOCS, "made-up page")
    for needle in ("--no-such-flag", "frobnicate", "no-such-target", "no_such_bench.py", "ENVSERVE_NO_SUCH_VARIABLE",
                   "no_such_key", "no_such_field", "no_such_module.py", "no/such/file.md", "no-such-profile"):
        assert any(needle in p for p in problems), (needle, problems)
