"""mkdocs hook: one page per environment family, written from a live run of the environment.

For every family folder under services/envserve/envs/, docs/hooks/run_env.py serves the env on a
real replica and plays one turn through the client; the page shows the spec GetSpec returned
(prompt, actions, config keys with their defaults, splits), the first observation, GetState of
turns 0 and 1 with their relation sentences, and the prompt an LLM judge builds from that state.
A family whose simulator package is not installed here gets a page saying so instead.

Runs are cached under .docs-cache/ by a digest of the package's sources, so a rebuild that changed
only pages does not replay the envs. ENVSERVE_DOCS_ENV_TIMEOUT (seconds, default 600) bounds a run.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mkdocs.structure.files import File


log = logging.getLogger("mkdocs.hooks.env_pages")
ROOT = Path(__file__).resolve().parents[2]
ENVS_DIR = ROOT / "services" / "envserve" / "envs"
CACHE = ROOT / ".docs-cache" / "envs"
RUNNER = Path(__file__).with_name("run_env.py")
# This checkout's envserve, whatever the venv has installed (the runs get the same PYTHONPATH).
if str(ROOT / "services") not in sys.path:
    sys.path.insert(0, str(ROOT / "services"))
# The states shown on a page are cut here (the whole state is what GetState returns).
STATE_CHARS = 3000
RELATIONS_SHOWN = 25


def families() -> list[str]:
    return sorted(p.name for p in ENVS_DIR.iterdir() if (p / "__init__.py").exists())


def registered() -> set[str]:
    import envserve.envs  # noqa: F401  (registers the installed families)
    from envserve.core.registry import env_ids
    return set(env_ids())


def sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted([*(ROOT / "services" / "envserve").rglob("*.py"), RUNNER]):
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def run_env(env_id: str, digest: str) -> dict:
    cached = CACHE / f"{env_id}-{digest}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "services"), env.get("PYTHONPATH", "")]))
    timeout = float(os.environ.get("ENVSERVE_DOCS_ENV_TIMEOUT", "600"))
    try:
        proc = subprocess.run([sys.executable, str(RUNNER), env_id], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"the run did not finish within {timeout:.0f} s"}
    if proc.returncode != 0:
        last = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
        return {"error": last[0]}
    data = json.loads(proc.stdout)
    CACHE.mkdir(parents=True, exist_ok=True)
    for old in CACHE.glob(f"{env_id}-*.json"):
        old.unlink()
    cached.write_text(json.dumps(data))
    return data


def fence(text: str, lang: str = "text") -> str:
    ticks = "````" if "```" in text else "```"
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}\n"


def compact_json(value, indent: str = "") -> str:
    """JSON with one key a line, but a list of plain values (a position, a grid row) on one line."""
    plain = lambda v: not isinstance(v, (dict, list))  # noqa: E731
    if isinstance(value, dict) and value:
        inner = indent + "  "
        items = [f"{inner}{json.dumps(str(k), ensure_ascii=False)}: {compact_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and value and not all(plain(v) or (isinstance(v, list) and all(map(plain, v)))
                                                     for v in value):
        inner = indent + "  "
        return "[\n" + ",\n".join(inner + compact_json(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value, ensure_ascii=False, default=str)


def cut_json(value, limit: int = STATE_CHARS) -> str:
    text = compact_json(value)
    if len(text) > limit:
        text = text[:limit] + f"\n... (cut for this page: {len(text) - limit} more characters)"
    return text


def relations_list(relations: list[str]) -> str:
    if not relations:
        return "*(no relation sentences for this state)*\n"
    lines = [f"- {r}" for r in relations[:RELATIONS_SHOWN]]
    if len(relations) > RELATIONS_SHOWN:
        lines.append(f"- ... and {len(relations) - RELATIONS_SHOWN} more")
    return "\n".join(lines) + "\n"


def judge_prompt(env_id: str, data: dict) -> str:
    from envserve.judge.prompts import yesno_prompt
    record = {"state": data["state0"]["state"], "relations": data["state0"]["relations"],
              "observation_text": data.get("observation", "")}
    text = "\n".join(data["state0"]["relations"][:2]) or "I see the start of the task."
    prompt = yesno_prompt(env_id, "grounding", text, record)
    return "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in prompt.messages)


def _number(value) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def bounds_text(p: dict) -> str:
    """A key's bounds as a reader wants them: 5 to 12, at most 16 characters, one of a / b..."""
    parts = []
    if "enum" in p:
        values = ["`" + (json.dumps(v, ensure_ascii=False) if v != "" else '""').replace("|", "/") + "`" for v in p["enum"]]
        if p["enum"] == [""]:  # a path on the server (core/env.py's SERVER_PATH_BOUNDS)
            parts.append('only `""` (a path on the server is the operator\'s to allow)')
        else:
            parts.append("one of " + ", ".join(values) if len(values) > 1 else f"only {values[0]}")
    low = ("≥ " + _number(p["minimum"])) if "minimum" in p else ("> " + _number(p["exclusiveMinimum"])) \
        if "exclusiveMinimum" in p else ""
    high = ("≤ " + _number(p["maximum"])) if "maximum" in p else ("< " + _number(p["exclusiveMaximum"])) \
        if "exclusiveMaximum" in p else ""
    if "minimum" in p and "maximum" in p:
        parts.append(f"{_number(p['minimum'])} to {_number(p['maximum'])}")
    elif low or high:
        parts.append(", ".join(x for x in (low, high) if x))
    if "multipleOf" in p:
        parts.append(f"a multiple of {_number(p['multipleOf'])}")
    if "maxLength" in p:
        parts.append(f"at most {p['maxLength']:,} characters")
    if "pattern" in p:
        parts.append(f"matching `{p['pattern'].replace('|', '/')}`")
    if "maxProperties" in p:
        parts.append(f"at most {p['maxProperties']} arguments (numbers, short texts without '/', lists)")
    if "maxItems" in p:
        parts.append(f"at most {p['maxItems']} items")
    return "; ".join(parts)


def config_table(schema: dict) -> str:
    props = schema.get("properties", {})
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for key, p in props.items():
        default = json.dumps(p.get("default"), ensure_ascii=False)
        doc = str(p.get("description", "")).replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{key}` | {p.get('type', '')} | `{default.replace('|', '/')}` | {bounds_text(p)} | {doc} |")
    return "\n".join(rows) + "\n"


def page(env_id: str, data: dict | None, reason: str = "") -> str:
    head = f"# {env_id}\n\n"
    if data is None or "error" in data:
        why = reason or f"running it failed here: `{data['error'] if data else 'unknown'}`"
        return (head + f"!!! note \"Not generated on this machine\"\n    This page is written from a live run of "
                f"the `{env_id}` environment, and {why}. Install the family's extra (see "
                f"[Install](../install.md)) and run `make docs` again.\n\n"
                f"What the family does is described in the [environments overview](index.md).\n")
    out = [head, f"{data['description']}\n\n",
           "*Generated by `make docs` from a live run: a replica served this env, and everything below came "
           "back through the client (GetSpec, Open, Reset on seed 0, GetState, one Step).*\n\n",
           "## At a glance\n\n", "| property | value |\n|---|---|\n",
           f"| actions | {data['action_space']} |\n",
           f"| turns, actions per turn | {data['max_turns']}, {data['max_actions_per_turn']} |\n",
           f"| observation | {', '.join(data['modalities'])} |\n",
           f"| action formats | default `{data['default_action_format']}`; "
           + ", ".join(f"`{f}`" for f in data["action_formats"]) + " |\n",
           f"| fork | {'snapshot' if data['supports_snapshot'] else 'replay of (seed, actions)'} |\n",
           f"| replay rebuilds the state exactly | {'yes' if data['replay_exact'] else 'no'} |\n\n",
           "## Splits\n\n"]
    out += [f"- `{s['name']}`: {s['description'] or '-'}\n" for s in data["splits"]]
    out += ["\n## Config keys\n\nOpen's `config` overrides any of these per session, within the allowed values; "
            "an unknown key, a value of the wrong type or one out of bounds is INVALID_ARGUMENT naming the key. "
            "These are the built-in bounds: a replica's operator may set others (`--config-limits`, see "
            "[the server](../server.md#config-limits)), and GetSpec returns the ones in force.\n\n",
            config_table(data["config_schema"]),
            "\n## System prompt\n\nWhat Open returns as `system_prompt` in the default action format "
            f"(`{data['default_action_format']}`):\n\n", fence(data["session_system_prompt"]),
            "\n## First observation (seed 0)\n\n", fence(data["observation"])]
    if data.get("images"):
        out.append("\nWith " + ", ".join(f"{i['width']}x{i['height']}" for i in data["images"])
                   + " image(s) (PNG) in the same result.\n")
    if data.get("session_config"):
        out.append(f"\nThe session was opened with `{json.dumps(data['session_config'])}` "
                   "(what the scripted expert needs).\n")
    s0, s1, step = data["state0"], data["state1"], data["step"]
    out += ["\n## GetState, turn 0\n\nThe ground truth a judge reads (`StateService.GetState`), "
            f"anchor `{s0['anchor']}`.\n\n**Relation sentences**\n\n", relations_list(s0["relations"]),
            "\n**State** (a `google.protobuf.Struct`, so every number arrives as a double)\n\n",
            fence(cut_json(s0["state"]), "json"),
            "\n## One turn\n\nThe answer sent (the env's scripted expert where it has one):\n\n",
            fence(data["answer"]),
            f"\nThe result: reward `{step['reward']:g}` (components "
            f"`{json.dumps({k: round(v, 6) for k, v in step['reward_components'].items()})}`), "
            f"valid `{str(step['action_valid']).lower()}`, done `{str(step['done']).lower()}`, parsed actions "
            f"`{json.dumps(step['parsed_actions'])}`"
            + (f", feedback \"{step['feedback']}\"" if step["feedback"] else "") + ". The next observation:\n\n",
            fence(step["observation"]),
            f"\n## GetState, turn 1\n\nAnchor `{s1['anchor']}`.\n\n", relations_list(s1["relations"]),
            "\n## What an LLM judge sees\n\nThe yes/no grounding prompt `envserve judge` would send for a "
            "description of turn 0 (see [Judge](../judge.md)):\n\n", fence(judge_prompt(env_id, data))]
    return "".join(out)


def on_files(files, config):
    digest = sources_digest()
    known = registered()
    fams = families()
    runnable = [f for f in fams if f in known]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(runnable, pool.map(lambda e: run_env(e, digest), runnable)))
    for env_id in fams:
        if env_id in runs:
            data = runs[env_id]
            if "error" in data:
                log.info("environment page %s: %s", env_id, data["error"])
            content = page(env_id, data)
        else:
            content = page(env_id, None, "its simulator package is not installed on the machine that built "
                                         "these pages, so the family is not registered")
        files.append(File.generated(config, f"environments/{env_id}.md", content=content))
    return files
