import importlib.util
import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "containers"))

from serverproc import ServerProcess, redis_or_skip  # noqa: E402

GRID_ENVS = ["sokoban", "frozenlake", "minesweeper"]

# Generated ALFWorld games of every test server land in one folder that outlives the run, so a
# second run on the same machine reads them instead of generating again (CI starts empty).
os.environ.setdefault("ENVSERVE_ALFWORLD_GAMES", os.path.join(tempfile.gettempdir(), "envserve-test-alfworld-games"))


def pytest_configure(config):
    config.addinivalue_line("markers", "last_in_module: runs after every other test of its module, "
                                       "because it takes down what they share (a module's stack)")


def pytest_itemcollected(item):
    """Tests that build and run images share one engine's image store and pods: under pytest-xdist
    they all go to one worker (see pytest_xdist_make_scheduler)."""
    if item.get_closest_marker("containers"):
        item.add_marker(pytest.mark.xdist_group("podman"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """After pytest-randomly's shuffle (which keeps each module's tests together): a module's
    last_in_module tests move behind the module's others, and the modules that take minutes (marked
    slow, or building images) go first, so test processes beside each other (pytest-xdist) do not
    end with one of them still running a long module alone."""
    blocks: dict = {}
    for item in items:
        blocks.setdefault(item.module, []).append(item)

    def takes_minutes(block) -> bool:
        return any(i.get_closest_marker("slow") or i.get_closest_marker("containers") for i in block)

    ordered = sorted(blocks.values(), key=lambda block: not takes_minutes(block))
    items[:] = [i for block in ordered for i in sorted(block, key=lambda i: bool(i.get_closest_marker(
        "last_in_module")))]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless chromium (tests/browserproc.py), one per test module; skips where it is missing."""
    import browserproc
    if not browserproc.AVAILABLE:
        pytest.skip(browserproc.MISSING)
    driver = browserproc.start_browser(tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield driver
    finally:
        driver.quit()


# Figures tests measure (success rates, timings), shown at the end of every run, with or without -s.
# They travel as the test's user_properties, so a pytest-xdist worker's figures reach the summary too.
_FIGURES: list[str] = []


@pytest.fixture
def report(request):
    """report(line): prints the line and repeats it in the run's summary."""
    def add(line: str) -> None:
        print(line)
        request.node.user_properties.append(("figure", line))
    return add


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        _FIGURES.extend(value for name, value in report.user_properties if name == "figure")


def pytest_terminal_summary(terminalreporter):
    if _FIGURES:
        terminalreporter.section("reported figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)


if importlib.util.find_spec("xdist"):
    def pytest_xdist_make_scheduler(config, log):
        """`-n N --dist loadgroup` (make test): a worker takes a whole module at a time, so module
        fixtures (servers, stacks) start once, and the tests of one xdist_group (the podman ones)
        go to one worker together."""
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadScopeScheduling
        # Modules are handed out in the collection's order (slow ones first, see above), not
        # sorted by how many tests they hold.
        config.option.loadscopereorder = False

        class ModuleOrGroupScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                # loadgroup appends "@<group>" to a grouped test's id
                head, at, group = nodeid.rpartition("@")
                if at and "::" in head and not any(c in group for c in "[]:"):
                    return "group:" + group
                return nodeid.split("::", 1)[0]

        return ModuleOrGroupScheduling(config, log)


@pytest.fixture(scope="session")
def grid_server():
    """One real server process on loopback serving the grid environments, shared by the session."""
    with ServerProcess(GRID_ENVS, workers=2) as server:
        yield server


@pytest.fixture
def redis_server():
    """A real redis-server on a loopback port, empty, for this test (skips where none is installed)."""
    with redis_or_skip() as server:
        yield server


@pytest.fixture
def client(grid_server):
    from envserve.client import EnvClient
    with EnvClient(grid_server.address) as c:
        yield c


@pytest.fixture(scope="session")
def engine():
    """podman or docker, for the container tests (skips where neither is installed)."""
    from stack import Unavailable, find_engine
    try:
        return find_engine()
    except Unavailable as e:
        pytest.skip(f"container tests need podman or docker: {e}")


@pytest.fixture(scope="session")
def built(engine):
    """The images, built once a session with the deploy scripts: (base kind, compose files, timings)."""
    from stack import build_images, choose_base
    base = choose_base()
    timings: dict[str, float] = {}
    files = build_images(engine, base, "latest", timings)
    return base, files, timings


@pytest.fixture(scope="session")
def trainer_built(engine, built):
    """The CPU trainer image (localhost/envserve-trainer:latest), built once a session like the others."""
    from stack import build_trainer_image
    base, _, timings = built
    return build_trainer_image(engine, base, "latest", timings)
