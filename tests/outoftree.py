"""Environment packages outside envserve's tree, made importable and registered for subprocesses
the way an installed distribution is: a folder on PYTHONPATH holding the code and a .dist-info
whose entry_points.txt names the env (what pip writes for a pyproject's entry points)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping


def register_on_path(root: Path, dist: str, entry_points: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """Writes root/<dist>-0.1.dist-info (METADATA, entry_points.txt) and returns the environment
    variables that put root on a subprocess's path (before what PYTHONPATH holds already)."""
    info = Path(root) / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    sections = [f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in eps.items())
                for group, eps in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(sections))
    return {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
