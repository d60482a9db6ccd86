"""Serve the test games with ors-sdk's Server on 127.0.0.1:PORT."""
import sys

from ors import Server

from ors_envs.games import ENVIRONMENTS

if __name__ == "__main__":
    Server(ENVIRONMENTS).run(host="127.0.0.1", port=int(sys.argv[1]))
