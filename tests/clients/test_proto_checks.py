"""The wire contract under buf (buf.yaml): it lints, it breaks nothing since the last release, and a
breaking change is caught."""
import json
import os
import re
import shutil
import subprocess

import pytest

from toolchains import REPO, buf, missing, run

PROTO = REPO / "proto" / "envserve" / "v1" / "envserve.proto"
RELEASE_0_1_0 = "447ec7cef75233849fcaa3a368addabb967e0f40"

# What STANDARD finds in envserve.v1 that only renaming could fix, which v1 takes no more (buf.yaml
# ignores these rules for the v1 file): (rule, the rpc or message it is about).
V1_NAMES = {
    ("RPC_RESPONSE_STANDARD_NAME", "EnvSpec"),            # GetSpec
    ("RPC_RESPONSE_STANDARD_NAME", "BatchResponse"),      # Reset, Step
    ("RPC_RESPONSE_STANDARD_NAME", "TaskStatsResponse"),  # GetTaskStats
    ("RPC_RESPONSE_STANDARD_NAME", "CloseResponse"),      # CloseSessions
    ("RPC_RESPONSE_STANDARD_NAME", "GetStateResponse"),   # ReadState
    ("RPC_RESPONSE_STANDARD_NAME", "JudgeResult"),        # Judge
    ("RPC_RESPONSE_STANDARD_NAME", "JudgeInfo"),          # GetJudgeInfo
    ("RPC_REQUEST_STANDARD_NAME", "CloseRequest"),        # CloseSessions
    ("RPC_REQUEST_RESPONSE_UNIQUE", "envserve.v1.BatchResponse"),
    ("RPC_REQUEST_RESPONSE_UNIQUE", "envserve.v1.GetStateResponse"),
}


def _findings(output: str) -> set:
    """(rule, first quoted name) of each finding of buf's --error-format json."""
    found = set()
    for line in output.splitlines():
        if line.startswith("{"):
            finding = json.loads(line)
            found.add((finding["type"], re.search(r'"([^"]+)"', finding["message"]).group(1)))
    return found


def test_proto_check_script_passes():
    """proto/check.sh, as CI runs it: buf lint, and buf breaking against release 0.1.0."""
    if subprocess.run(["git", "cat-file", "-e", f"{RELEASE_0_1_0}^{{commit}}"], cwd=REPO,
                      capture_output=True).returncode != 0:
        missing(f"release 0.1.0's commit in this clone (git fetch origin {RELEASE_0_1_0})")
    done = run([str(REPO / "proto" / "check.sh")], REPO, env={**os.environ, "BUF": buf()})
    assert done.returncode == 0, done.stdout


def test_lint_ignores_cover_only_the_names_v1_was_released_with():
    """Without buf.yaml's ignores STANDARD finds exactly V1_NAMES: an rpc added to v1 with a message
    not named after it, or shared with another rpc, fails here."""
    config = json.dumps({"version": "v2", "modules": [{"path": "proto"}], "lint": {"use": ["STANDARD"]}})
    done = run([buf(), "lint", "--error-format", "json", "--config", config], REPO)
    assert done.returncode != 0, "STANDARD finds the v1 names buf.yaml ignores"
    assert _findings(done.stdout) == V1_NAMES, done.stdout


# What FILE finds against release 0.1.0 that buf.yaml's breaking ignores let through: the language
# options added after it, and 0.1.0's Close, still served on the wire under that name.
SINCE_0_1_0 = {
    *(("FILE_SAME_" + o.upper(), o) for o in ("csharp_namespace", "go_package", "java_multiple_files",
                                              "java_outer_classname", "java_package", "objc_class_prefix",
                                              "php_namespace", "ruby_package")),
    ("RPC_NO_DELETE", "Close"),
}
NO_IGNORES = json.dumps({"version": "v2", "modules": [{"path": "proto"}], "breaking": {"use": ["FILE"]}})


def test_breaking_ignores_cover_only_what_changed_on_purpose_since_0_1_0():
    if subprocess.run(["git", "rev-parse", "-q", "--verify", "refs/tags/v0.1.0"], cwd=REPO,
                      capture_output=True).returncode == 0:
        against = ".git#tag=v0.1.0,subdir=proto"
    elif subprocess.run(["git", "cat-file", "-e", f"{RELEASE_0_1_0}^{{commit}}"], cwd=REPO,
                        capture_output=True).returncode == 0:
        against = f".git#ref={RELEASE_0_1_0},subdir=proto"
    else:
        missing(f"release 0.1.0's commit in this clone (git fetch origin {RELEASE_0_1_0})")
    done = run([buf(), "breaking", "--error-format", "json", "--config", NO_IGNORES, "--against", against], REPO)
    assert _findings(done.stdout) == SINCE_0_1_0, done.stdout


@pytest.mark.parametrize("change, pattern, replacement, rule", [
    pytest.param("a field renumbered", r"(\n  string config_json = )7;", r"\g<1>17;", "FIELD_NO_DELETE",
                 id="renumbered-field"),
    # WIRE_JSON, the other category a client could care for, lets this through.
    pytest.param("the rpc Fork deleted", r"\n  rpc Fork\(ForkRequest\) returns \(ForkResponse\);", "",
                 "RPC_NO_DELETE", id="deleted-rpc"),
])
def test_breaking_catches_a_breaking_change(tmp_path, change, pattern, replacement, rule):
    shutil.copy(REPO / "buf.yaml", tmp_path)
    shutil.copytree(REPO / "proto", tmp_path / "proto")
    changed = tmp_path / "proto" / "envserve" / "v1" / "envserve.proto"
    text, n = re.subn(pattern, replacement, PROTO.read_text(), count=1)
    assert n == 1, f"the .proto no longer has what the test changes for {change}"
    changed.write_text(text)
    # Against today's proto, so with no ignores: buf.yaml's let 0.1.0's changes through.
    done = run([buf(), "breaking", "--error-format", "json", "--config", NO_IGNORES, "--against", str(REPO)],
               tmp_path)
    assert done.returncode != 0, f"buf breaking let {change} through:\n{done.stdout}"
    assert rule in {r for r, _ in _findings(done.stdout)}, done.stdout
