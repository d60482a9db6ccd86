"""The task types of the installed `scienceworld` package and its own train/dev/test variation
lists, written once to variations.json so that mapping a seed to a task needs no JVM.

Regenerate after upgrading the package:  python -m envserve.envs.scienceworld.catalog
(tests/integration/test_scienceworld.py checks the file against the installed package).
"""
from __future__ import annotations

import json
import os
from functools import lru_cache

CATALOG_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "variations.json")


def build_catalog(sw_env) -> dict:
    """{"version", "tasks": [{"task_id", "topic", "name", "train", "dev", "test"}]} from a running
    ScienceWorldEnv, in the package's task order (tasks.json: topic-number ids like "3-2")."""
    import scienceworld
    from scienceworld.constants import TASKS
    tasks = []
    for t in TASKS:
        sw_env.load(t["task_name"], 0, "")
        tasks.append({"task_id": t["task_id"], "topic": t["task_id"].split("-")[0], "name": t["task_name"],
                      "train": sorted(sw_env.get_variations_train()),
                      "dev": sorted(sw_env.get_variations_dev()),
                      "test": sorted(sw_env.get_variations_test())})
    return {"version": scienceworld.__version__, "tasks": tasks}


@lru_cache(maxsize=1)
def load_catalog() -> dict:
    with open(CATALOG_PATH) as f:
        return json.load(f)


if __name__ == "__main__":
    from scienceworld import ScienceWorldEnv
    env = ScienceWorldEnv()
    try:
        catalog = build_catalog(env)
    finally:
        env.close()
    with open(CATALOG_PATH, "w") as f:
        json.dump(catalog, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {CATALOG_PATH}: {len(catalog['tasks'])} task types, scienceworld {catalog['version']}")
