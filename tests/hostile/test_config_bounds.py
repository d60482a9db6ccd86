"""Hostile session configs against a real replica: values out of bounds, NaN and infinities, deep
nesting and paths on the server answer INVALID_ARGUMENT naming the field, never INTERNAL or UNKNOWN;
an operator's --config-limits file raises and lowers bounds, published in GetSpec and enforced."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import pytest
from google.protobuf import struct_pb2

from envserve.client import EnvClient
from envserve.client.errors import EnvServeError
from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc
from serverproc import ServerProcess

ENVS = ["sokoban", "svg"]
SVG = '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 64 64"><rect x="8" y="8" width="30" height="20" fill="red"/></svg>'


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("cairosvg")
    with ServerProcess(ENVS, workers=1, metrics=False) as s:
        yield s


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.EnvServiceStub(channel)


def open_raw(stub, env_id: str, config: dict) -> grpc.RpcError:
    """Open with config as a Struct built here (NaN and infinities go on the wire as they are)."""
    s = struct_pb2.Struct()
    s.update(config)
    with pytest.raises(grpc.RpcError) as e:
        stub.Open(pb.OpenRequest(env_id=env_id, count=1, config=s), timeout=60)
    return e.value


@pytest.mark.parametrize("env_id, config, message", [
    ("sokoban", {"dim_room": 1e300}, "config.dim_room: 1e+300 is greater than the maximum of 12"),
    ("sokoban", {"image_size": -5}, "config.image_size: -5 is less than the minimum of 16"),
    ("sokoban", {"image_size": 1e9}, "config.image_size: 1000000000 is greater than the maximum of 1024"),
    ("sokoban", {"image_size": float("nan")}, "config.image_size: nan is not a finite number"),
    ("sokoban", {"image_size": float("inf")}, "config.image_size: inf is not a finite number"),
    ("sokoban", {"dim_room": 6, "penalty_for_step": float("-inf")}, "config.penalty_for_step: -inf is not a finite number"),
    ("sokoban", {"num_boxes": 6, "dim_room": 10}, "config.num_boxes: 6 is greater than the maximum of 4"),
    # A cross-field rule: the env's own check, in the worker.
    ("sokoban", {"num_boxes": 3, "dim_room": 10}, "num_boxes 3 is too many for dim_room 10: at most 2"),
    ("svg", {"render_timeout_s": 600}, "config.render_timeout_s: 600.0 is greater than the maximum of 5.0"),
    ("svg", {"render_memory_mb": 1e6}, "config.render_memory_mb: 1000000 is greater than the maximum of 1024"),
    ("svg", {"max_depth": 10_000}, "config.max_depth: 10000 is greater than the maximum of 32"),
])
def test_bad_values_are_invalid_argument_naming_the_field(stub, env_id, config, message):
    e = open_raw(stub, env_id, config)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    assert message in e.details()


def test_nan_deep_inside_and_deep_nesting(stub):
    e = open_raw(stub, "sokoban", {"cell_separator": {"a": [1, float("nan")]}})
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details() == "config.cell_separator.a[1]: nan is not a finite number"
    # Lists nest in two message levels each (a Struct in three), so 40 of them still parse: past
    # protobuf's 100 levels a request does not parse at all (INVALID_ARGUMENT from rpc/parsing.py).
    deep = [1]
    for _ in range(40):
        deep = [deep]
    e = open_raw(stub, "sokoban", {"cell_separator": deep})
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "nested deeper than 32 levels" in e.details()


def test_a_server_path_never_reveals_whether_it_exists(stub, tmp_path):
    (tmp_path / "a.svg").write_text(SVG)
    answers = {}
    for name, path in (("folder", str(tmp_path)), ("missing", str(tmp_path / "nope")), ("system", "/etc")):
        e = open_raw(stub, "svg", {"svg_dir": path})
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        answers[name] = e.details().replace(repr(path), "PATH")
    assert answers["folder"] == answers["missing"] == answers["system"] == "config.svg_dir: PATH is not one of ['']"


def test_restore_refuses_a_bad_config_alone(stub):
    """A history whose config holds a NaN, or a value out of bounds, fails alone with its status."""
    histories = []
    for config in ({"dim_room": float("nan")}, {"dim_room": 40}, {"dim_room": 7}):
        h = pb.SessionHistory(env_id="sokoban", action_format="free_think")
        h.config.update(config)
        histories.append(h)
    reply = stub.Restore(pb.RestoreRequest(sessions=histories), timeout=60)
    nan, big, good = (s.status for s in reply.sessions)
    assert nan.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and nan.message == "config.dim_room: nan is not a finite number"
    assert big.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "config.dim_room: 40 is greater" in big.message
    assert good.code == 0 and reply.sessions[2].session_id
    stub.CloseSessions(pb.CloseRequest(session_ids=[reply.sessions[2].session_id]), timeout=60)


def test_the_largest_sokoban_config_resets(server, report):
    """The largest config each room side allows (most boxes, the longest walk, every attempt):
    reset over a few seeds succeeds. The figures are reported, not asserted."""
    largest = [{"dim_room": 12, "num_boxes": 2}, {"dim_room": 8, "num_boxes": 3}, {"dim_room": 6, "num_boxes": 4}]
    with EnvClient(server.address) as client:
        for config in largest:
            config = {**config, "num_gen_steps": 40, "gen_attempts": 20, "p_change_directions": 0.35}
            sid = client.open("sokoban", 1, config)[0]
            seconds = []
            for seed in range(5):
                t0 = time.perf_counter()
                r = client.reset([sid], seeds=[seed])[0]
                seconds.append(time.perf_counter() - t0)
                assert r.status.code == 0, r.status.message
                assert len(r.observation.text.splitlines()) == config["dim_room"]
            client.close_sessions([sid])
            report(f"sokoban reset {config['dim_room']}x{config['dim_room']} with {config['num_boxes']} boxes, "
                   f"num_gen_steps 40, gen_attempts 20: slowest of 5 seeds {max(seconds):.2f} s, "
                   f"mean {sum(seconds) / len(seconds):.2f} s")


# -- an operator's limits ------------------------------------------------------------------------------
def test_config_limits_are_published_and_enforced(tmp_path):
    pytest.importorskip("cairosvg")
    icons = tmp_path / "icons"
    icons.mkdir()
    (icons / "a.svg").write_text(SVG)
    limits = {"sokoban": {"dim_room": {"maximum": 8}, "num_boxes": {"maximum": 5}},
              "svg": {"svg_dir": {"enum": ["", str(icons)]}},
              "*": {"image_size": {"maximum": 256}}}
    path = tmp_path / "limits.json"
    path.write_text(json.dumps(limits))
    with ServerProcess(ENVS, workers=1, metrics=False, extra=["--config-limits", str(path)]) as s, \
            EnvClient(s.address) as client:
        props = json.loads(client.get_spec("sokoban").config_schema_json)["properties"]
        assert props["dim_room"]["maximum"] == 8 and props["dim_room"]["minimum"] == 5
        assert props["num_boxes"]["maximum"] == 5 and props["image_size"]["maximum"] == 256
        svg_props = json.loads(client.get_spec("svg").config_schema_json)["properties"]
        assert svg_props["svg_dir"]["enum"] == ["", str(icons)] and svg_props["image_size"]["maximum"] == 256
        with pytest.raises(EnvServeError) as e:
            client.open("sokoban", 1, {"dim_room": 9})
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "config.dim_room: 9 is greater than the maximum of 8" in e.value.message
        with pytest.raises(EnvServeError) as e:
            client.open("sokoban", 1, {"image_size": 300})
        assert "config.image_size: 300 is greater than the maximum of 256" in e.value.message
        # Raised: 5 boxes in a 6x6 room (the built-in bound is 4); the workers apply the limits too.
        sid = client.open("sokoban", 1, {"dim_room": 6, "num_boxes": 5})[0]
        r = client.reset([sid], seeds=[0])[0]
        assert r.status.code == 0, r.status.message
        assert sum(row.count("X") + row.count("√") for row in r.observation.text.splitlines()) == 5
        # The allowed folder serves its file; any other stays refused.
        sid = client.open("svg", 1, {"svg_dir": str(icons)})[0]
        r = client.reset([sid], seeds=[0])[0]
        assert r.status.code == 0, r.status.message
        with pytest.raises(EnvServeError) as e:
            client.open("svg", 1, {"svg_dir": str(tmp_path)})
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("limits, message", [
    ({"sokobam": {"dim_room": {"maximum": 8}}}, "unknown env id 'sokobam'"),
    ({"sokoban": {"dim_rooom": {"maximum": 8}}}, "sokoban has no config key 'dim_rooom'"),
])
def test_a_bad_limits_file_stops_the_replica_with_one_line(tmp_path, limits, message):
    path = tmp_path / "limits.json"
    path.write_text(json.dumps(limits))
    proc = subprocess.run([sys.executable, "-m", "envserve.cli", "serve", "sokoban", "--port", "0",
                           "--config-limits", str(path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("envserve: config limits "), proc.stderr
