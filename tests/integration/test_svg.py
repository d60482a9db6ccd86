"""SVG reconstruction through the real gRPC server: the target's own code is a perfect score,
blank and wrong pictures score low, targets are the same in any process, a folder of user SVGs
is served, every class of hostile SVG is an invalid action that leaves the session (and the
worker) working, and a render past its time limit is stopped. Needs cairosvg and defusedxml."""
import json
import math
import os
import subprocess
import sys

import grpc
import numpy as np
import psutil
import pytest

pytest.importorskip("cairosvg")
pytest.importorskip("defusedxml")

from envserve.client import EnvClient, decode_image, state_dict  # noqa: E402
from envserve.client.errors import EnvServeError  # noqa: E402
from envserve.envs.svg import SvgEnv  # noqa: E402
from envserve.envs.svg.generate import generate_icon  # noqa: E402
from envserve.envs.svg.sanitize import Limits, UnsafeSvg, check_svg  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

DEFAULTS = SvgEnv.spec.config_defaults
MAX_REWARD = DEFAULTS["ssim_weight"] + DEFAULTS["edge_weight"] + DEFAULTS["pixel_weight"]
HEAD = ('<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
        'viewBox="0 0 256 256">')


def answer(svg: str) -> str:
    return f"<answer>{svg}</answer>"


def wrap(body: str) -> str:
    return HEAD + body + "</svg>"


def renderer_children(pid: int) -> list[int]:
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "envserve.envs.svg.render" in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The folders tests serve targets and model weights from, made before the replica starts."""
    root = tmp_path_factory.mktemp("svg-folders")
    paths = {name: root / name for name in ("icons", "empty", "dino", "learned")}
    for path in paths.values():
        path.mkdir()
    return paths


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    # A caller may name no folder on the server unless the operator allows it: this replica's
    # operator allows the test folders.
    limits = tmp_path_factory.mktemp("svg-limits") / "limits.json"
    limits.write_text(json.dumps({"svg": {
        "svg_dir": {"enum": ["", str(folders["icons"]), str(folders["empty"])]},
        "dino_model_path": {"enum": ["", str(folders["dino"]), str(folders["learned"])]},
        "dreamsim_model_path": {"enum": ["", str(folders["learned"])]}}}))
    with ServerProcess(["svg"], workers=1, metrics=False, extra=["--config-limits", str(limits)]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with EnvClient(server.address) as c:
        yield c


def open_session(client, **config):
    return client.open("svg", 1, {"max_turns": 50, **config}, "no_think")[0]


def target_of(client, sid) -> str:
    return state_dict(client.get_state(sid, 0))["target_svg"]


def test_perfect_reconstruction_scores_the_maximum_and_succeeds(client):
    sid = client.open("svg", 1, {}, "no_think")[0]
    first = client.reset_one(sid, seed=4)
    # The observation is the target picture.
    target_img = decode_image(first.observation.images[0])
    assert target_img.shape == (DEFAULTS["image_size"], DEFAULTS["image_size"], 3)
    assert len(np.unique(target_img.reshape(-1, 3), axis=0)) > 2, "the target shows shapes"
    truth = state_dict(client.get_state(sid, 0))
    assert truth["shapes"] and all(s["type"] and s["bbox"] for s in truth["shapes"])
    assert truth["last_score"] is None and truth["attempts"] == 0
    r = client.step_one(sid, answer(truth["target_svg"]))
    assert r.action_valid and r.done and r.success
    assert r.info["score"] == pytest.approx(1.0)
    assert r.reward == pytest.approx(MAX_REWARD + DEFAULTS["format_reward"])
    assert set(r.reward_components) == {"ssim", "edge", "pixel", "format"}
    after = state_dict(client.get_state(sid, -1))
    assert after["last_score"] == pytest.approx(1.0) and after["success"] is True
    assert after["last_metrics"] == {m: pytest.approx(1.0) for m in ("ssim", "edge", "pixel")}
    # The rendering shown after the attempt is the same picture as the target.
    assert np.abs(decode_image(r.observation.images[0]).astype(int) - target_img).max() <= 1
    client.close_sessions([sid])


def test_blank_wrong_and_near_svgs_score_in_order(client):
    sid = open_session(client, include_valid_actions=True)
    first = client.reset_one(sid, seed=11)
    target = target_of(client, sid)
    blank = list(first.info["valid_actions"])[0]
    scores = {}
    for name, svg in [("blank", blank), ("wrong", generate_icon(99_999)),
                      # The whole target moved by (3, 2): close, not exact.
                      ("near", target.replace('viewBox="0 0 256 256">',
                                              'viewBox="0 0 256 256"><g transform="translate(3 2)">', 1)
                       .replace("</svg>", "</g></svg>"))]:
        r = client.step_one(sid, answer(svg))
        assert r.action_valid, r.feedback
        scores[name] = r.info["score"]
        assert not r.success and not r.done
        assert r.reward == pytest.approx(sum(r.reward_components.values()))
    assert scores["blank"] < 0.4 and scores["wrong"] < 0.4
    assert scores["near"] > max(scores["blank"], scores["wrong"])
    # The score of the last attempt is shown in the text observation.
    assert f"{scores['near']:.3f}" in r.observation.text
    client.close_sessions([sid])


def test_observation_image_is_the_rendering_or_the_target(client):
    blank = wrap('<rect width="256" height="256" fill="white"/>')
    images = {}
    for mode in ("rendering", "target"):
        sid = open_session(client, observation_image=mode, image_size=64)
        first = client.reset_one(sid, seed=2)
        r = client.step_one(sid, answer(blank))
        images[mode] = (decode_image(first.observation.images[0]), decode_image(r.observation.images[0]))
        client.close_sessions([sid])
    assert (images["rendering"][1] == 255).all(), "the blank attempt's rendering is white"
    assert (images["target"][1] == images["target"][0]).all(), "target mode keeps showing the target"


def test_targets_are_the_same_svg_in_any_process(client):
    code = "from envserve.envs.svg.generate import generate_icon; import sys; sys.stdout.write(generate_icon(123))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED="7")).stdout
    assert other == generate_icon(123)
    sid = open_session(client)
    client.reset_one(sid, seed=123)
    assert target_of(client, sid) == other
    assert len({generate_icon(s) for s in range(20)}) == 20
    client.close_sessions([sid])


def test_user_folder_is_served_sorted_and_checked(client, folders):
    tmp_path = folders["icons"]
    files = {
        "b.svg": wrap('<circle cx="128" cy="128" r="90" fill="blue"/>'),
        "a.svg": '<?xml version="1.0"?>\n' + wrap('<rect x="20" y="20" width="100" height="60" fill="red"/>'),
        "c.svg": wrap('<use href="https://example.com/evil.svg#x"/>'),
        "notes.txt": "not an svg",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    sid = open_session(client, svg_dir=str(tmp_path))
    seen = []
    for seed in (0, 1, 3):
        client.reset_one(sid, seed=seed)
        truth = state_dict(client.get_state(sid, 0))
        assert truth["source"] == "folder"
        seen.append((truth["task"], truth["target_svg"], [s["type"] for s in truth["shapes"]]))
    assert seen[0] == ("a.svg", files["a.svg"], ["rect"])
    assert seen[1] == ("b.svg", files["b.svg"], ["circle"])
    assert seen[2] == seen[0], "task i is file i mod n"
    # A user file is scored like a generated one.
    r = client.step_one(sid, answer(files["a.svg"]))
    assert r.action_valid and r.success
    # A hostile file gives a clear error for that task, and the session goes on.
    bad = client.reset([sid], [2])[0]
    assert bad.status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "c.svg" in bad.status.message and "external reference" in bad.status.message
    assert client.reset_one(sid, seed=1).observation.text
    client.close_sessions([sid])
    with pytest.raises(EnvServeError) as e:
        client.open("svg", 1, {"svg_dir": str(folders["empty"])})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "no .svg files" in str(e.value)


def _use_bomb() -> str:
    # Each level uses the one below ten times: 10^7 rectangles from a few hundred bytes.
    levels = "".join(f'<g id="l{i}">' + f'<use href="#l{i - 1}"/>' * 10 + "</g>" for i in range(1, 8))
    return wrap(f'<defs><g id="l0"><rect width="1" height="1"/></g>{levels}</defs><use href="#l7"/>')


_LAUGHS = ('<?xml version="1.0"?><!DOCTYPE svg [<!ENTITY a "lol">'
           '<!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;"><!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;">'
           '<!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">]>' + wrap("<text>&d;</text>"))

HOSTILE = {
    "external_href_http": (wrap('<use href="http://evil.example/x.svg#a"/>'), "external reference"),
    "external_href_file": (wrap('<use xlink:href="file:///etc/passwd#a"/>'), "external reference"),
    "image_file": (wrap('<image href="file:///etc/passwd" width="9" height="9"/>'), "<image>"),
    "css_url": (wrap('<rect width="9" height="9" style="fill: url(http://evil.example/p.svg#g)"/>'),
                "external reference"),
    "css_import": (wrap("<style>@import url(http://evil.example/a.css);</style>"), "@import"),
    "xxe": ('<!DOCTYPE svg [<!ENTITY x SYSTEM "file:///etc/passwd">]>' + wrap("<text>&x;</text>"), "entity"),
    "billion_laughs": (_LAUGHS, "entity"),
    "use_bomb": (_use_bomb(), "expands to more than"),
    "reference_cycle": (wrap('<g id="g"><use href="#g"/></g>'), "cycle"),
    "huge_canvas": ('<svg xmlns="http://www.w3.org/2000/svg" width="100000" height="100000">'
                    '<rect width="9" height="9"/></svg>', "canvas width"),
    "huge_viewbox": ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 90000 90000"/>', "viewBox size"),
    "deep_nesting": (wrap("<g>" * 200 + '<rect width="9" height="9"/>' + "</g>" * 200), "nested"),
    "too_many_elements": (wrap("<g/>" * 3000), "more than 512 elements"),
    "oversized_text": (wrap("<desc>" + "x" * 40_000 + "</desc>"), "bytes"),
    "script": (wrap("<script>alert(1)</script>"), "<script>"),
    "event_handler": ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 9 9" onload="alert(1)"/>', "event handler"),
    "not_xml": ("<svg><rect></svg>", "not well-formed"),
}


@pytest.fixture(scope="module")
def hostile_session(client):
    sid = open_session(client, max_turns=1000, end_on_success=False)
    client.reset_one(sid, seed=7)
    yield sid, target_of(client, sid)
    client.close_sessions([sid])


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_svg_is_an_invalid_action_and_the_session_goes_on(client, hostile_session, name):
    sid, target = hostile_session
    svg, why = HOSTILE[name]
    before = client.get_state(sid, -1).anchor
    r = client.step_one(sid, answer(svg))
    assert r.status.code == 0 and not r.action_valid
    assert why.lower() in r.feedback.lower(), r.feedback
    assert r.reward == 0.0 and "Invalid SVG" in r.observation.text
    # Nothing the agent drew changed: the state key is the one before.
    assert r.anchor == before
    ok = client.step_one(sid, answer(target))
    assert ok.action_valid and ok.info["score"] == pytest.approx(1.0)


def test_the_sanitizer_refuses_dtds_itself():
    # The env strips nothing: even given to check_svg directly, defusedxml refuses the DTD.
    with pytest.raises(UnsafeSvg, match="forbidden XML construct"):
        check_svg(_LAUGHS, Limits())
    # Legitimate internal references pass and render: gradients, <use>, url(#id), CSS.
    ok = check_svg(wrap('<defs><linearGradient id="g"><stop offset="0" stop-color="red"/></linearGradient>'
                        '<circle id="c" r="9"/></defs><style>.a { fill: url(#g); }</style>'
                        '<use href="#c" x="20" y="20"/><rect class="a" width="50" height="50"/>'
                        '<path d="M 10 10 L 100 10 Q 150 100 10 200 Z" fill="url(#g)"/>'), Limits())
    assert ok.elements > 6 and [s["type"] for s in ok.shapes] == ["rect", "path"]
    assert ok.shapes[1]["bbox"][0] == 10 and ok.shapes[1]["bbox"][3] == 200


def _slow_svg() -> str:
    """About 15 KB that passes every static limit but keeps cairo busy for seconds: a 2000-corner
    self-crossing polygon (millions of edge crossings to tessellate), drawn 40 times by <use>."""
    n, k = 2000, 999
    pts = " ".join(f"{128 + 120 * math.cos(2 * math.pi * i * k / n):.0f},"
                   f"{128 + 120 * math.sin(2 * math.pi * i * k / n):.0f}" for i in range(n))
    return wrap(f'<defs><polygon id="p" points="{pts}" fill-rule="evenodd" stroke="red" stroke-width="3" '
                'stroke-linejoin="round"/></defs>' + '<use href="#p"/>' * 40)


def test_a_render_past_its_time_limit_is_stopped_and_the_worker_survives(server, client):
    slow = _slow_svg()
    check_svg(slow, Limits())  # passes the static checks
    sid = open_session(client, render_timeout_s=0.5)
    client.reset_one(sid, seed=5)
    target = target_of(client, sid)
    workers = server.worker_pids()
    renderers = renderer_children(server.proc.pid)
    assert renderers, "the worker renders in a child process"
    r = client.step_one(sid, answer(slow))
    assert not r.action_valid and "time limit" in r.feedback
    ok = client.step_one(sid, answer(target))
    assert ok.action_valid and ok.info["score"] == pytest.approx(1.0)
    assert server.worker_pids() == workers, "the worker lives on"
    now = renderer_children(server.proc.pid)
    assert now and not set(now) & set(renderers), "the stuck renderer was killed and replaced"
    client.close_sessions([sid])


def test_learned_metrics_need_local_weights(client, folders):
    tmp_path = folders["learned"]
    for key in ("dino", "dreamsim"):
        with pytest.raises(EnvServeError) as e:
            client.open("svg", 1, {f"{key}_weight": 1.0})
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and f"{key}_model_path" in str(e.value)
        with pytest.raises(EnvServeError) as e:
            client.open("svg", 1, {f"{key}_weight": 1.0, f"{key}_model_path": str(tmp_path)})
        # An empty folder: no DINOv2 weights to load; dreamsim is not installed here.
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert ("cannot load a DINOv2 model" in str(e.value)) if key == "dino" else ("dreamsim" in str(e.value))


def test_dino_metric_from_a_local_model(client, folders):
    """The DINO similarity with a tiny random-weight DINOv2 built here (no hub): identical images
    score 1 on it, and it joins the reported metrics."""
    pytest.importorskip("transformers")
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model
    import torch
    torch.manual_seed(0)
    tmp_path = folders["dino"]
    Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                             image_size=56, patch_size=14)).save_pretrained(tmp_path)
    BitImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}).save_pretrained(tmp_path)
    sid = client.open("svg", 1, {"dino_weight": 1.0, "dino_model_path": str(tmp_path)}, "no_think")[0]
    client.reset([sid], seeds=[0])
    truth = state_dict(client.get_state(sid))
    r = client.step_one(sid, answer(truth["target_svg"]))
    assert r.action_valid and set(r.reward_components) == {"ssim", "edge", "pixel", "dino", "format"}
    assert r.info["metrics"]["dino"] == pytest.approx(1.0, abs=1e-5) and r.info["score"] == pytest.approx(1.0)
    client.close_sessions([sid])


def test_bad_config_values_are_invalid_argument(client, folders):
    for config in ({"observation_image": "both"}, {"ssim_weight": -1.0}, {"min_shapes": 6, "max_shapes": 2},
                   {"svg_dir": "/no/such/folder"}, {"svg_dir": str(folders["dino"])}, {"render_timeout_s": 0.0},
                   {"render_timeout_s": 60.0}, {"max_svg_bytes": 10 ** 6}, {"render_memory_mb": 100_000}):
        with pytest.raises(EnvServeError) as e:
            client.open("svg", 1, config)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, config
