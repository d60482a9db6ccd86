import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """`mkdocs build --strict` of this checkout into a temporary folder: (exit code, output, folder).
    The environment pages come from live runs of the installed envs (cached in .docs-cache/)."""
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    site = tmp_path_factory.mktemp("site")
    # A simulator that hangs gets its page marked "not generated" instead of holding the suite.
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", ENVSERVE_DOCS_ENV_TIMEOUT="180",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "services"), str(ROOT / "trainer"),
                                                        os.environ.get("PYTHONPATH", "")])))
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr, site
