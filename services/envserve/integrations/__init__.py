"""Thin adapters that let other trainers use envserve sessions, built only on envserve.client.

trl: `environment_factory(address, env_id, ...)` for `trl.GRPOTrainer(environment_factory=...)`.
"""
