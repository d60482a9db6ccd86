"""A split's tasks as the dataset rows each trainer reads (`envserve tasks export`).

Every row names its task by `task_id` and `seed`, where envserve's adapters look for them
(`row_reset_args`): TRL's environment_factory gets a row's columns, verl's agent loop and tool its
`extra_info`, SkyRL its extras. So a trainer that reads the file plays exactly the listed tasks.

  tasks   JSON lines: env_id, split, task_id, seed, description, task_type, parameters
  trl     JSON lines for `datasets.load_dataset("json", ...)`: prompt (a chat) and the task's columns
  verl    parquet as verl's RLHFDataset reads it: data_source, prompt, ability, reward_model,
          agent_name, extra_info {index, split, env_id, seed, task_id, tools_kwargs}
  skyrl   parquet as SkyRL's dataset reads it: prompt, env_class (register()'s envserve-<env>),
          task_id, seed, extra_info
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from ._common import action_choices, is_cell_space

FORMATS = {"tasks": "jsonl", "trl": "jsonl", "verl": "parquet", "skyrl": "parquet"}
INSTRUCTION = "Solve the task. Answer in the format the rules ask for."


def task_dict(env_id: str, task) -> dict[str, Any]:
    """A ListTasks Task (the wire's, or any object with its fields) as plain values."""
    params = task.parameters
    if hasattr(params, "fields"):   # the wire's Task: its JSON text keeps integers
        from envserve.client import json_field
        params = json_field(task, "parameters")
    return {"env_id": env_id, "split": task.split, "task_id": task.task_id, "seed": int(task.seed),
            "description": task.description, "task_type": task.task_type, "parameters": dict(params)}


def tool_name(spec) -> str:
    """The name EnvServeTool (verl) gives its tool for this env's spec."""
    return "move" if action_choices(spec) else "reveal" if is_cell_space(spec) else "act"


def _prompt(task: Mapping[str, Any]) -> list[dict[str, str]]:
    # The adapters show the model the env's rules and first observation themselves (TRL appends
    # them to this message as they are, hence its closing break); the row's prompt only says what
    # to do, with the task's own words where the env has them.
    text = INSTRUCTION + (f"\n\nTask: {task['description']}" if task["description"] else "") + "\n\n"
    return [{"role": "user", "content": text}]


def rows(fmt: str, spec, tasks: Iterable[Mapping[str, Any]], agent_name: str = "envserve_agent") -> list[dict]:
    """The rows of `fmt` for plain tasks (task_dict) of the env `spec` describes."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {sorted(FORMATS)}")
    out = []
    for index, t in enumerate(tasks):
        if fmt == "tasks":
            out.append(dict(t))
        elif fmt == "trl":
            out.append({"prompt": _prompt(t), "env_id": t["env_id"], "split": t["split"], "task_id": t["task_id"],
                        "seed": t["seed"], "task_type": t["task_type"]})
        else:
            extra = {"index": index, "split": t["split"], "env_id": t["env_id"], "seed": t["seed"],
                     "task_id": t["task_id"], "task_type": t["task_type"]}
            if fmt == "verl":
                extra["tools_kwargs"] = {tool_name(spec): {"create_kwargs": {"seed": t["seed"]}}}
                out.append({"data_source": f"envserve/{t['env_id']}", "prompt": _prompt(t), "ability": "agent",
                            "reward_model": {"style": "rule", "ground_truth": ""}, "agent_name": agent_name,
                            "extra_info": extra})
            else:
                out.append({"prompt": _prompt(t), "env_class": f"envserve-{t['env_id']}", "task_id": t["task_id"],
                            "seed": t["seed"], "extra_info": extra})
    return out


def write(fmt: str, data: list[dict], path: str) -> None:
    """Writes rows as the file their format is read from (JSON lines or parquet)."""
    if FORMATS[fmt] == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for row in data:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        return
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise SystemExit(f"{fmt} rows are parquet: pip install 'envserve[datasets]' (pyarrow)") from None
    pq.write_table(pa.Table.from_pylist(data), path)
