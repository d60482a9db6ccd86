"""Thin adapters that let other trainers use envserve sessions, built only on envserve.client.

trl: `environment_factory(address, env_id, ...)` for `trl.GRPOTrainer(environment_factory=...)`.
skyrl: `register(address, env_ids)` and `EnvServeTextEnv`, a skyrl_gym BaseTextEnv (`skyrl_gym.make`).
gem: `register(address, env_ids)` and `EnvServeEnv`, a gem.Env (`gem.make`, `gem.make_vec`).
verl: `EnvServeAgentLoop` (verl's agent loop `envserve_agent`) and `EnvServeTool` (a verl BaseTool);
imports verl, so only where verl is installed (deploy/trainer/verl-venv.sh).
Each takes one replica's address, several, or a directory URL. What they share (one client per
address and process, on the replicas' Interact streams, with recovery; the session wrapper) is in
`_common`; `close_channels()` closes the shared clients (they close at exit anyway).
"""
from ._common import close_channels

__all__ = ["close_channels"]
