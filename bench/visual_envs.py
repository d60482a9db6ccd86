"""The visual environments: step and render latency through the gRPC service, each against its
package's own loop run alongside in the same process tree.

- svg: `svg_render_ms` is the env's render path (sanitizer, then cairosvg in the killable child,
  the pipe included); baseline: cairosvg rendering the same SVG in-process. `svg_step_ms` is a
  whole gRPC step (check, render, score, 256 px PNG back).
- navigation (MiniWorld backend): `navigation_step_ms` is a gRPC step of one action with a 128 px
  image; baseline: a stock MiniWorld env (MiniWorld-OneRoom-v0, 128 px observations, which it
  renders every step) stepping in-process.
- primitive_skill (ManiSkill3): `maniskill_step_ms` is a gRPC step of one pick skill without an
  image; baseline: the same env class executing the same skill in-process (no server), so the
  ratio is what serving adds. `maniskill_render_ms` is one image at the configured size through the
  service; baseline: the env's render in-process.

Run: `.venv/bin/python bench/visual_envs.py [--steps 100] [--json]` (primitive_skill needs Vulkan:
`make bench-visual` runs it with lavapipe where no GPU driver is present). With --json the last line is
one JSON object. Medians of `--steps` timed calls after warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from envserve.client import EnvClient, state_dict  # noqa: E402
from serverproc import ServerProcess  # noqa: E402


def answer(a: str) -> str:
    return f"<answer>{a}</answer>"


def median_ms(fn, n: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


# -- svg ------------------------------------------------------------------------------------------
def bench_svg(client: EnvClient, n: int) -> dict:
    from envserve.envs.svg.generate import generate_icon
    from envserve.envs.svg.render import render_rgb, shared_renderer
    from envserve.envs.svg.sanitize import Limits, check_svg

    target = generate_icon(0)
    base = median_ms(lambda: render_rgb(target, 256), n)
    renderer = shared_renderer(1024)
    limits = Limits()

    def served_render():
        checked = check_svg(target, limits)
        renderer.render(checked.text, 256, 5.0)

    ours = median_ms(served_render, n)
    renderer.close()
    sid = client.open("svg", 1, {"end_on_success": False, "max_turns": 10_000}, "no_think")[0]
    client.reset_one(sid, seed=0)
    step = median_ms(lambda: client.step_one(sid, answer(target)), n)
    client.close_sessions([sid])
    return {"svg_render_ms": round(ours, 2), "svg_render_baseline_ms": round(base, 2),
            "ratio_svg_render": round(ours / base, 2), "svg_step_ms": round(step, 2)}


# -- navigation -----------------------------------------------------------------------------------
def bench_navigation(client: EnvClient, n: int) -> dict:
    os.environ.setdefault("PYGLET_HEADLESS", "1")
    import gymnasium as gym
    import miniworld  # noqa: F401  (registers the MiniWorld ids)

    raw = gym.make("MiniWorld-OneRoom-v0", obs_width=128, obs_height=128)
    raw.reset(seed=0)
    turns = iter(range(10**9))
    # Turning left and right in place: no episode ends, every step renders its observation.
    base = median_ms(lambda: raw.step(next(turns) % 2), n)
    raw.close()
    sid = client.open("navigation", 1, {"image_size": 128, "max_turns": 10_000, "max_env_steps": 0},
                      "no_think")[0]
    client.reset_one(sid, seed=0)
    flip = iter(range(10**9))
    step = median_ms(lambda: client.step_one(sid, answer("rotateleft" if next(flip) % 2 else "rotateright")), n)
    client.close_sessions([sid])
    return {"navigation_step_ms": round(step, 2), "navigation_step_baseline_ms": round(base, 2),
            "ratio_navigation_step": round(step / base, 2)}


# -- primitive_skill ------------------------------------------------------------------------------
def bench_maniskill(client: EnvClient, n: int) -> dict:
    from envserve.core.session import Session

    n = max(5, n // 10)  # a pick is ~60 physics control steps
    config = {"task": "stack", "render_image": False, "image_size": 300}
    pick = "<answer>pick({},{},{})</answer>"

    def picks(reset, step, truth) -> list[float]:
        """Times a pick of the red cube, each from a fresh episode (reset not timed)."""
        times = []
        for seed in range(n + 1):
            reset(seed)
            x, y, z = truth()["objects"]["red_cube"]
            t0 = time.perf_counter()
            step(pick.format(x, y, z))
            times.append(time.perf_counter() - t0)
        return times[1:]  # the first episode pays the shader compile

    local = Session("primitive_skill", config, "no_think")
    base = picks(local.reset, local.step, lambda: local.env.ground_truth().state)
    render_base = median_ms(lambda: local.env.render_image(300), n)
    local.close()

    sid = client.open("primitive_skill", 1, config, "no_think")[0]
    served = picks(lambda seed: client.reset_one(sid, seed=seed), lambda a: client.step_one(sid, a),
                   lambda: state_dict(client.get_state(sid)))
    img = client.open("primitive_skill", 1, {**config, "render_image": True, "max_turns": 10**6}, "no_think")[0]
    client.reset_one(img, seed=0)
    # An invalid action moves nothing: the step is the observation's image alone.
    render = median_ms(lambda: client.step_one(img, "<answer>pick(0,0)</answer>"), n)
    client.close_sessions([sid, img])
    step, step_base = 1000 * statistics.median(served), 1000 * statistics.median(base)
    return {"maniskill_step_ms": round(step, 1), "maniskill_step_baseline_ms": round(step_base, 1),
            "ratio_maniskill_step": round(step / step_base, 2),
            "maniskill_render_ms": round(render, 1), "maniskill_render_baseline_ms": round(render_base, 1),
            "ratio_maniskill_render": round(render / render_base, 2)}


BENCHES = {"svg": bench_svg, "navigation": bench_navigation, "primitive_skill": bench_maniskill}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--only", choices=sorted(BENCHES), action="append")
    args = ap.parse_args()
    names = args.only or list(BENCHES)
    out: dict = {"steps": args.steps, "cpus": os.cpu_count()}
    with ServerProcess(names, workers=1, metrics=False) as server, EnvClient(server.address) as client:
        for name in names:
            out.update(BENCHES[name](client, args.steps))
    for k, v in out.items():
        print(f"{k:32s} {v}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
