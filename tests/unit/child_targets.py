"""Children for test_child_process.py (imported by a fresh interpreter through PYTHONPATH)."""
import os
import time

from envserve.core.child import Refusal, serve


_state = {}


def _handle(op, args):
    if op == "set":
        _state[args[0]] = args[1]
        return None
    if op == "get":
        return _state.get(args[0])
    if op == "pid":
        return os.getpid()
    if op == "echo":
        return args
    if op == "sleep":
        time.sleep(float(args[0]))
        return "slept"
    if op == "die":
        os._exit(int(args[0]))
    if op == "refuse":
        raise Refusal("no, as such")
    raise ValueError(f"unknown op {op}")


def run(fd, greeting):
    serve(fd, _handle, hello=greeting)
