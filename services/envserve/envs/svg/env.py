"""SVG reconstruction (VAGEN's svg env): the observation is a target picture, the action is
SVG code, the reward is how similar its rendering is to the target.

Targets are seeded generated icons (generate.py) or the SVG files of a folder (svg_dir).
Every SVG, the model's and the folder's, passes the sanitizer (sanitize.py) and renders in a
killable child process with a time limit (render.py); a hostile or broken SVG is an invalid
action with the reason as feedback, and the session goes on.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from envserve.core.env import SERVER_PATH_BOUNDS, ActionOutcome, Environment, EnvSpec, GroundTruth, seeded_splits
from envserve.core.session import SessionError

from .generate import generate_icon
from .render import RenderError, shared_renderer
from .sanitize import CheckedSvg, Limits, UnsafeSvg, check_svg, extract_svg
from .score import METRICS, Scorer

SYSTEM_PROMPT = """You are an SVG artist reconstructing pictures as SVG code.
The image you are shown is the target picture: simple shapes (circles, rectangles, ellipses, polygons, paths, lines) in solid colours, sometimes on a coloured background.
Answer with one complete SVG document, <svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 W H">...</svg>, using the canvas size you are told; it is rendered and compared with the target.
Use plain shapes with fill, stroke and stroke-width; colours may be CSS names or hex codes.
Not allowed (the answer is rejected): external references or links, <image>, <foreignObject>, <script>, filters, patterns, masks, markers, DOCTYPE or entities, more than a few hundred elements, very deep nesting or huge canvases.
After each attempt you get its similarity score (1 is a perfect copy) and, by default, the image of how your SVG renders; you may then improve it."""

_DEFAULTS: dict[str, Any] = {
    # Common session keys, set as VAGEN's svg env: the target image is the observation, one SVG
    # per turn (SVG contains commas, so no separator), format reward 0.5 for a usable SVG and
    # no penalty (VAGEN's format_reward / format_penalty).
    "render_image": True,
    "image_size": 256,
    "action_separator": "",
    "format_reward": 0.5,
    "format_penalty": 0.0,
    "invalid_action_penalty": 0.0,
    "max_action_chars": 65536,
    # Targets.
    "svg_dir": "",
    "canvas_size": 256,
    "min_shapes": 2,
    "max_shapes": 5,
    # Score: weights of the metric mix (score.py). Their sum (5.0) is the most a turn earns,
    # as with VAGEN's published svg configs (dino_weight 5.0 alone).
    "ssim_weight": 1.0,
    "edge_weight": 2.5,
    "pixel_weight": 1.5,
    "dino_weight": 0.0,
    "dreamsim_weight": 0.0,
    "edge_tolerance_px": 1,
    "pixel_error_clip": 0.25,
    "dino_model_path": "",
    "dreamsim_model_path": "",
    "learned_device": "cpu",
    "score_size": 256,
    "success_threshold": 0.95,
    "end_on_success": True,
    "observation_image": "rendering",
    # Untrusted SVG.
    "max_svg_bytes": 32768,
    "max_elements": 512,
    "max_depth": 32,
    "max_canvas_px": 4096,
    "render_timeout_s": 5.0,
    "render_memory_mb": 1024,
}
_DOCS = {
    "svg_dir": "a folder of .svg files to serve as targets instead of generated icons: files sorted by "
               "name, task seed s is file s mod n; each file passes the same sanitizer",
    "canvas_size": "side of the generated icons' square canvas (viewBox units)",
    "min_shapes": "fewest shapes in a generated icon",
    "max_shapes": "most shapes in a generated icon",
    "ssim_weight": "weight of SSIM (structural similarity, RGB) in the score and reward",
    "edge_weight": "weight of the IoU of Canny edge maps (VAGEN's structural score)",
    "pixel_weight": "weight of 1 - mean absolute RGB error / pixel_error_clip, clipped to [0, 1]",
    "dino_weight": "weight of DINOv2 feature similarity (needs transformers and dino_model_path)",
    "dreamsim_weight": "weight of DreamSim similarity (needs the dreamsim package and dreamsim_model_path)",
    "edge_tolerance_px": "edges within this many pixels count as matching (0: VAGEN's exact edge IoU)",
    "pixel_error_clip": "mean absolute RGB error (0-1) at which the pixel metric reaches 0",
    "dino_model_path": "local folder of a Hugging Face DINOv2 model; never downloaded",
    "dreamsim_model_path": "local folder holding DreamSim's weights (its cache_dir); never downloaded",
    "learned_device": "torch device of the learned metrics",
    "score_size": "side in pixels of the square renderings that are compared",
    "success_threshold": "score (weighted mean of the metrics, 0-1) from which an attempt is a success",
    "end_on_success": "end the episode at a successful attempt (VAGEN never ends early: set false to match)",
    "observation_image": "rendering: after a valid attempt the image is its rendering (VAGEN), before it "
                         "the target; target: always the target",
    "max_svg_bytes": "longest SVG accepted, in UTF-8 bytes",
    "max_elements": "most elements in an SVG, counting each <use> copy",
    "max_depth": "deepest element nesting",
    "max_canvas_px": "largest width, height and viewBox side",
    "render_timeout_s": "a render running longer is stopped (its process killed): invalid action",
    "render_memory_mb": "address-space cap of the renderer process",
}
_OBSERVATION_IMAGES = ("rendering", "target")
_WEIGHT = {"minimum": 0.0, "maximum": 100.0}
_BOUNDS: dict[str, dict[str, Any]] = {
    # Files and model folders on the server: the operator's allow-list only (SERVER_PATH_BOUNDS).
    "svg_dir": SERVER_PATH_BOUNDS,
    "dino_model_path": SERVER_PATH_BOUNDS,
    "dreamsim_model_path": SERVER_PATH_BOUNDS,
    # At most max_canvas_px too (the env's own check).
    "canvas_size": {"minimum": 16, "maximum": 4096},
    "min_shapes": {"minimum": 1, "maximum": 50},
    "max_shapes": {"minimum": 1, "maximum": 50},
    "ssim_weight": _WEIGHT, "edge_weight": _WEIGHT, "pixel_weight": _WEIGHT,
    "dino_weight": _WEIGHT, "dreamsim_weight": _WEIGHT,
    # Each pixel of tolerance is one more dilation of both edge maps.
    "edge_tolerance_px": {"minimum": 0, "maximum": 8},
    "pixel_error_clip": {"exclusiveMinimum": 0.0, "maximum": 1.0},
    "learned_device": {"enum": ["cpu", "cuda"]},
    # On a 2-core machine a turn at score_size and image_size 1024 (50-shape icons on a 4096 canvas,
    # edge_tolerance_px 8) renders and scores in at most 0.9 s; 0.4 s at the defaults.
    "score_size": {"minimum": 32, "maximum": 1024},
    "success_threshold": {"exclusiveMinimum": 0.0, "maximum": 1.0},
    "observation_image": {"enum": list(_OBSERVATION_IMAGES)},
    # Limits on untrusted SVG protect the server: a caller may lower them, never raise them.
    "max_svg_bytes": {"minimum": 1, "maximum": _DEFAULTS["max_svg_bytes"]},
    "max_elements": {"minimum": 1, "maximum": _DEFAULTS["max_elements"]},
    "max_depth": {"minimum": 1, "maximum": _DEFAULTS["max_depth"]},
    "max_canvas_px": {"minimum": 16, "maximum": _DEFAULTS["max_canvas_px"]},
    "render_timeout_s": {"exclusiveMinimum": 0.0, "maximum": _DEFAULTS["render_timeout_s"]},
    # Each worker keeps one renderer process per value in use (render.py's shared_renderer), so the
    # values are few: 256 MiB is the least the renderer starts in (128 fails to import cairo).
    "render_memory_mb": {"minimum": 256, "maximum": _DEFAULTS["render_memory_mb"], "multipleOf": 256},
}


class SvgEnv(Environment):
    spec = EnvSpec(
        env_id="svg",
        description=("VAGEN's SVG reconstruction: the observation is a target picture (a seeded generated "
                     "icon, or a file of svg_dir), the action is SVG code, rendered with cairosvg in a "
                     "sandboxed, time-limited process. Reward per valid attempt: the weighted sum of "
                     "similarity metrics between the rendering and the target (default SSIM 1.0, edge IoU "
                     "2.5, clipped pixel error 1.5; DINOv2 and DreamSim optional with local weights), plus "
                     "format_reward 0.5; success when the weighted mean reaches success_threshold. "
                     "Hostile SVG (external references, entities, huge canvases, deep nesting, too many "
                     "elements, slow renders) is an invalid action."),
        system_prompt=SYSTEM_PROMPT,
        action_space="one SVG document <svg ...>...</svg> (see valid_actions for a blank canvas of the target's size)",
        # VAGEN's svg runs: rollout_manager.max_turns=2, one SVG per turn.
        max_turns=2,
        max_actions_per_turn=1,
        modalities=("text", "image"),
        config_defaults=_DEFAULTS,
        difficulty_keys=("min_shapes", "max_shapes"),
        config_docs=_DOCS,
        config_bounds=_BOUNDS,
        splits=seeded_splits("generated icons (or svg_dir files, seed mod n)"),
        default_action_format="free_think",
    )

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        c = self.config
        self.limits = Limits(max_bytes=int(c["max_svg_bytes"]), max_elements=int(c["max_elements"]),
                             max_depth=int(c["max_depth"]), max_canvas=float(c["max_canvas_px"]))
        if int(c["min_shapes"]) > int(c["max_shapes"]):
            raise ValueError("need min_shapes <= max_shapes")
        if int(c["canvas_size"]) > self.limits.max_canvas:
            raise ValueError(f"canvas_size must be at most max_canvas_px ({self.limits.max_canvas:g})")
        self.scorer = Scorer(c)
        self.files: list[str] = []
        if c["svg_dir"]:
            folder = os.path.expanduser(str(c["svg_dir"]))
            if not os.path.isdir(folder):
                raise ValueError(f"svg_dir {folder!r} is not a folder")
            self.files = sorted(os.path.join(folder, f) for f in os.listdir(folder)
                                if f.lower().endswith(".svg") and os.path.isfile(os.path.join(folder, f)))
            if not self.files:
                raise ValueError(f"svg_dir {folder!r} holds no .svg files")
        self._size = int(c["score_size"])
        self._timeout = float(c["render_timeout_s"])
        self._state: dict[str, Any] | None = None
        self._images: dict[tuple[str, int], np.ndarray] = {}
        self._target_edges: np.ndarray | None = None

    # -- rendering ---------------------------------------------------------------------------
    def _render(self, svg_text: str, size: int) -> np.ndarray:
        return shared_renderer(int(self.config["render_memory_mb"])).render(svg_text, size, self._timeout)

    # -- setup -------------------------------------------------------------------------------
    def _target_source(self, seed: int) -> tuple[str, str]:
        """(task name, SVG text) of a seed."""
        if not self.files:
            c = self.config
            return f"icon-{seed}", generate_icon(seed, int(c["canvas_size"]), int(c["min_shapes"]),
                                                 int(c["max_shapes"]))
        path = self.files[seed % len(self.files)]
        name = os.path.basename(path)
        size = os.path.getsize(path)
        if size > self.limits.max_bytes:
            raise SessionError("FAILED_PRECONDITION", f"target file {name} is {size} bytes; max_svg_bytes is "
                                                      f"{self.limits.max_bytes}")
        try:
            with open(path, encoding="utf-8") as f:
                return name, f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise SessionError("FAILED_PRECONDITION", f"target file {name} cannot be read: {e}") from None

    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        seed = int(seed)
        name, source = self._target_source(seed)
        try:
            checked = check_svg(extract_svg(source), self.limits)
            image = self._render(checked.text, self._size)
        except (UnsafeSvg, RenderError) as e:
            raise SessionError("FAILED_PRECONDITION", f"target {name} is not a usable SVG: {e}") from None
        self._state = {
            "seed": seed, "task": name, "source": "folder" if self.files else "generated",
            "target_svg": source, "target": _checked_dict(checked),
            "attempts": 0, "last_svg": "", "last_checked": "", "last_metrics": {}, "last_score": None,
            "best_score": None, "last_error": "", "success": False, "done": False,
        }
        self._images = {("target", self._size): image}
        self._target_edges = None

    # -- the step ----------------------------------------------------------------------------
    def step(self, action: str) -> ActionOutcome:
        st = self._state
        if st is None or st["done"]:
            return ActionOutcome(valid=False, feedback="The episode is over; reset the environment.")
        st["attempts"] += 1
        try:
            checked = check_svg(extract_svg(action), self.limits)
            image = self._render(checked.text, self._size)
        except (UnsafeSvg, RenderError) as e:
            kind = "rejected" if isinstance(e, UnsafeSvg) else "could not be rendered"
            st["last_error"] = f"Invalid SVG: {kind}: {e}"
            return ActionOutcome(valid=False, feedback=st["last_error"], info={"svg_error": str(e)})
        target = self._images[("target", self._size)]
        if self._target_edges is None and self.scorer.weights["edge"] > 0:
            self._target_edges = self.scorer.target_edges(target)
        metrics = self.scorer.metrics(target, image, self._target_edges)
        score = self.scorer.score(metrics)
        success = score >= float(self.config["success_threshold"])
        st.update(last_svg=action, last_checked=checked.text, last_metrics=metrics, last_score=score,
                  best_score=score if st["best_score"] is None else max(st["best_score"], score),
                  last_error="", success=st["success"] or success)
        st["done"] = success and bool(self.config["end_on_success"])
        self._images = {k: v for k, v in self._images.items() if k[0] == "target"}
        self._images[("attempt", self._size)] = image
        parts = self.scorer.reward_parts(metrics)
        return ActionOutcome(
            reward=sum(parts.values()), done=st["done"], success=success, components=parts,
            feedback=f"Score {score:.3f}" + (" (success)." if success else "."),
            info={"score": score, "metrics": dict(metrics),
                  "success_threshold": float(self.config["success_threshold"])})

    # -- observations ------------------------------------------------------------------------
    def render_text(self) -> str:
        st = self._state
        if st is None:
            return ""
        w, h = st["target"]["canvas"]
        task = (f"The target picture is drawn on a {w:g} x {h:g} canvas: write SVG code "
                f'(<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w:g} {h:g}">...</svg>) that '
                "reproduces it, with the same shapes, positions, sizes and colours.")
        if st["attempts"] == 0:
            return "The image is the target picture. " + task
        lines = []
        if st["last_error"]:
            lines.append(f"Attempt {st['attempts']}: {st['last_error']}")
        if st["last_score"] is not None:
            parts = ", ".join(f"{m} {v:.3f}" for m, v in st["last_metrics"].items())
            which = "latest valid attempt" if st["last_error"] else f"attempt {st['attempts']}"
            lines.append(f"Your {which} scored {st['last_score']:.3f} (1 is a perfect copy; {parts}).")
            if self.config["observation_image"] == "rendering":
                lines.append("The image shows how that SVG renders; the target is the first image.")
            else:
                lines.append("The image is the target picture.")
        else:
            lines.append("The image is the target picture.")
        lines.append(task)
        return " ".join(lines)

    def render_image(self, size: int) -> np.ndarray:
        st = self._state
        use_attempt = (st is not None and st["last_checked"] and self.config["observation_image"] == "rendering")
        kind = "attempt" if use_attempt else "target"
        key = (kind, int(size))
        if key not in self._images:
            text = st["last_checked"] if use_attempt else st["target"]["text"]
            try:
                self._images[key] = self._render(text, int(size))
            except RenderError:
                # It rendered at score_size already; scale that picture instead.
                from PIL import Image
                base = self._images[(kind, self._size)]
                self._images[key] = np.asarray(Image.fromarray(base).resize((size, size), Image.BILINEAR))
        return self._images[key]

    def ground_truth(self) -> GroundTruth:
        st = self._state
        if st is None:
            return GroundTruth({})
        shapes = st["target"]["shapes"]
        state = {
            "source": st["source"], "task": st["task"], "seed": st["seed"],
            "target_svg": st["target_svg"], "canvas": list(st["target"]["canvas"]),
            "shapes": shapes, "attempts": st["attempts"], "last_svg": st["last_svg"],
            "last_score": st["last_score"], "last_metrics": dict(st["last_metrics"]),
            "best_score": st["best_score"], "success": st["success"], "last_error": st["last_error"],
            "weights": {m: self.scorer.weights[m] for m in METRICS if self.scorer.weights[m] > 0},
        }
        return GroundTruth(state, _relations(shapes, st["target"]["canvas"]))

    def anchor_data(self) -> Any:
        st = self._state
        if st is None:
            return ""
        # The target and what the agent last drew make the state; errors change nothing.
        return f"{st['target']['text']}\x1f{st['last_checked']}"

    def valid_actions(self) -> list[str]:
        """Any safe SVG is a legal action; the one listed is a blank canvas of the target's size
        (a starting point, not a hint)."""
        st = self._state
        if st is None or st["done"]:
            return []
        w, h = st["target"]["canvas"]
        return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w:g}" height="{h:g}" viewBox="0 0 {w:g} {h:g}">'
                f'<rect x="0" y="0" width="{w:g}" height="{h:g}" fill="white"/></svg>']

    # -- copies ------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        import copy
        return {"state": copy.deepcopy(self._state),
                "images": {k: v for k, v in self._images.items() if k[1] == self._size}}

    def restore(self, snap: dict) -> None:
        import copy
        self._state = copy.deepcopy(snap["state"])
        self._images = {k: v.copy() for k, v in snap["images"].items()}
        self._target_edges = None


def _checked_dict(c: CheckedSvg) -> dict:
    return {"text": c.text, "canvas": [float(c.canvas[0]), float(c.canvas[1])], "elements": c.elements,
            "shapes": c.shapes}


def _region(x: float, y: float, w: float, h: float) -> str:
    col = "left" if x < w / 3 else "right" if x > 2 * w / 3 else ""
    row = "top" if y < h / 3 else "bottom" if y > 2 * h / 3 else ""
    return f"{row}-{col}" if row and col else row or col or "center"


def _a(word: str) -> str:
    return f"an {word}" if word[:1].lower() in "aeiou" else f"a {word}"


def _relations(shapes: list[dict], canvas) -> list[str]:
    """One sentence per shape (colour, kind, where), then left/right and above/below between
    consecutive shapes, for judges comparing what the agent says it sees."""
    w, h = canvas
    out, centres = [], []
    for i, s in enumerate(shapes):
        colour = s["fill"] if s["fill"] not in (None, "none") else f"{s['stroke']}-stroked"
        box = s["bbox"]
        if box is None:
            out.append(f"shape{i} is {_a(colour)} {s['type']}")
            centres.append(None)
            continue
        cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        centres.append((cx, cy))
        where = _region(cx, cy, w, h)
        out.append(f"shape{i} is {_a(colour)} {s['type']} in the {where} part of the canvas" if where != "center"
                   else f"shape{i} is {_a(colour)} {s['type']} in the center of the canvas")
    for i in range(1, len(shapes)):
        a, b = centres[i - 1], centres[i]
        if a is None or b is None:
            continue
        side = "left of" if b[0] < a[0] else "right of"
        vertical = "above" if b[1] < a[1] else "below"
        out.append(f"shape{i} is {vertical} and to the {side} shape{i - 1}")
    return out
