"""OpenEnv environments written the way OpenEnv's users write them (typed Action, Observation
and State models, an Environment subclass), served by envserve unchanged in the tests."""
# The ids envserve serves them under; tests/ must be on the server's import path.
ECHO = "openenv:openenv_envs.echo:EchoEnvironment"
GUESS = "openenv:openenv_envs.guess:GuessEnvironment"
GRID = "openenv:openenv_envs.grid:GridEnvironment"
ALL = (ECHO, GUESS, GRID)
# One that cannot be copied (forks replay it), kept out of ALL's examples.
LOCKED = "openenv:openenv_envs.locked:LockedCounterEnvironment"


def on_path() -> dict:
    """Environment variables that let a server process import this package."""
    import os
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {"PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)}
