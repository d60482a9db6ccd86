"""Prints the requirements of the envserve package for the given extras, one a line, from pyproject.toml.

The Dockerfiles install these in a layer of their own before copying the source, so a code change
rebuilds only the small layer that installs envserve itself. The build-system requirements come too:
envserve is then installed with --no-build-isolation and needs nothing from the network.
Usage: python3 deploy/requirements.py pyproject.toml [EXTRA ...]
"""
import sys
import tomllib


def requirements(path: str, extras: list[str]) -> list[str]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    optional = data["project"].get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extras {unknown}; pyproject lists {sorted(optional)}")
    reqs = list(data.get("build-system", {}).get("requires", []))
    reqs += data["project"].get("dependencies", [])
    for extra in extras:
        reqs += optional[extra]
    return list(dict.fromkeys(reqs))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print("\n".join(requirements(sys.argv[1], sys.argv[2:])))
