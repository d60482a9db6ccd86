"""The committed Python stubs must be exactly what grpcio-tools generates from the .proto."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_stubs_match_proto(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
                    f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    str(ROOT / "proto/envserve/v1/envserve.proto")], check=True)
    for name in ("envserve_pb2.py", "envserve_pb2.pyi", "envserve_pb2_grpc.py"):
        generated = (tmp_path / "envserve/v1" / name).read_text()
        committed = (ROOT / "services/envserve/v1" / name).read_text()
        assert generated == committed, f"{name} is stale: run `make proto`"


def test_every_rpc_is_served():
    from envserve.v1 import envserve_pb2 as pb
    from envserve.server.monitor import MonitorService
    from envserve.server.service import EnvService, StateService
    for service, impl in (("EnvService", EnvService), ("StateService", StateService),
                          ("MonitorService", MonitorService)):
        for method in pb.DESCRIPTOR.services_by_name[service].methods:
            assert method.name in impl.__dict__, f"{service}.{method.name} has no implementation"
