"""verl's trainer (`verl.trainer.main_ppo`, the same hydra overrides) with envserve as a fleet on
its Ray cluster: this driver starts Ray, then an envserve.ray Fleet (FLEET_FAMILIES, default
sokoban; FLEET_REPLICAS_PER_NODE replicas on each node, each a real `envserve serve` in a Ray
actor), then verl's main_ppo on that Ray. verl's agent-loop workers, Ray actors of the cluster, find
the replicas at ray://, since agent_loops.yaml gives no address. The fleet is drained at the end.

    FLEET=1 MODEL=Qwen/Qwen2.5-0.5B-Instruct examples/verl/run_sokoban.sh    # runs this script
    python examples/verl/main_ppo_fleet.py <main_ppo's overrides>

Ray is started as ray.init() starts it: RAY_ADDRESS, or a cluster started with `ray start` on this
machine, is joined instead (ray_kwargs.ray_init overrides do not apply: Ray is up before verl reads
them).
"""
from __future__ import annotations

import os

import ray
from verl.trainer import main_ppo
from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

from envserve.ray import Fleet, FleetConfig


def main() -> None:
    runtime_env = get_ppo_ray_runtime_env()              # what main_ppo's own ray.init would pass
    # The workers' agent loops go to the fleet, whatever ENVSERVE_ADDRESS the shell (or a node) has.
    runtime_env["env_vars"]["ENVSERVE_ADDRESS"] = ""
    ray.init(runtime_env=runtime_env)
    families = [f.strip() for f in os.environ.get("FLEET_FAMILIES", "sokoban").split(",") if f.strip()]
    fleet = Fleet(FleetConfig(families=families, replicas_per_node=int(os.environ.get("FLEET_REPLICAS_PER_NODE", "1"))))
    try:
        for r in fleet.start():
            print(f"envserve fleet: {r['family']} replica {r['replica_id']} at {r['address']}", flush=True)
        main_ppo.main()                                  # hydra reads the overrides from the command line
    finally:
        fleet.shutdown()


if __name__ == "__main__":
    main()
