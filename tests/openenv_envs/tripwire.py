"""A module that says it was imported: it writes the file $ENVSERVE_TRIPWIRE names. A replica must
never import it because a caller asked to open `openenv:openenv_envs.tripwire:Anything`."""
import os

if os.environ.get("ENVSERVE_TRIPWIRE"):
    with open(os.environ["ENVSERVE_TRIPWIRE"], "a") as f:
        f.write(f"imported by pid {os.getpid()}\n")
