"""Image similarity between a rendering and the target, each metric in [0, 1].

VAGEN scores SVG reconstructions with DINOv2 and DreamSim similarity plus a "structural"
score (the IoU of Canny edge maps). The learned models' weights cannot be downloaded here, so
the default mix is three pixel metrics (the learned ones stay available where their weights
are on disk):
- ssim:  structural similarity (per RGB channel, averaged; scikit-image's window and constants),
         clipped to [0, 1].
- edge:  IoU of the Canny edge maps (VAGEN's structural score), each edge map first dilated by
         `edge_tolerance_px` so that a one-pixel shift is not a total miss (0 = VAGEN's exact IoU).
         Two images without edges count as identical (1.0).
- pixel: 1 - mean absolute RGB error / `pixel_error_clip`, clipped to [0, 1]: colour fidelity.
- dino:  (cos(mean DINOv2 patch features) + 1) / 2, as VAGEN computes it (transformers).
- dreamsim: 1 - DreamSim distance, clipped to [0, 1], as VAGEN computes it (dreamsim package).
The score is the weighted mean of the metrics with a weight above 0; the reward is the
weighted sum (VAGEN's total_score), reported per metric.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

import numpy as np

METRICS = ("ssim", "edge", "pixel", "dino", "dreamsim")


def ssim_score(a: np.ndarray, b: np.ndarray, win: int = 7) -> float:
    """Mean SSIM over the RGB channels (Wang et al. 2004; uniform 7x7 window and constants as
    scikit-image's structural_similarity), in float32: about 5x faster than scikit-image's."""
    from scipy.ndimage import uniform_filter
    x = a.astype(np.float32)
    y = b.astype(np.float32)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    size = (win, win, 1)
    mx, my = uniform_filter(x, size), uniform_filter(y, size)
    # Sample covariances (scikit-image's default), not population ones.
    cov_norm = win * win / (win * win - 1.0)
    vx = cov_norm * (uniform_filter(x * x, size) - mx * mx)
    vy = cov_norm * (uniform_filter(y * y, size) - my * my)
    vxy = cov_norm * (uniform_filter(x * y, size) - mx * my)
    s = ((2 * mx * my + c1) * (2 * vxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    pad = (win - 1) // 2
    inner = s[pad:-pad, pad:-pad] if pad else s
    return float(np.clip(inner.mean(dtype=np.float64), 0.0, 1.0))


def _edges(img: np.ndarray, tolerance: int) -> np.ndarray:
    from scipy.ndimage import binary_dilation
    from skimage.feature import canny
    gray = img.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)
    # Thresholds on the 0-255 scale, as VAGEN's cv2.Canny(gray, 100, 200).
    edges = canny(gray, sigma=1.0, low_threshold=100.0, high_threshold=200.0)
    if tolerance > 0:
        edges = binary_dilation(edges, iterations=tolerance)
    return edges


def edge_score(a: np.ndarray, b: np.ndarray, tolerance: int, edges_a: np.ndarray | None = None) -> float:
    """`edges_a`: a's edge map when the caller kept it (the target's is the same every turn)."""
    ea = _edges(a, tolerance) if edges_a is None else edges_a
    eb = _edges(b, tolerance)
    union = np.logical_or(ea, eb).sum()
    if union == 0:
        return 1.0
    return float(np.logical_and(ea, eb).sum() / union)


def pixel_score(a: np.ndarray, b: np.ndarray, clip: float) -> float:
    mae = float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean()) / 255.0
    return float(np.clip(1.0 - mae / clip, 0.0, 1.0))


# -- learned metrics (optional) ------------------------------------------------------------

_MODELS: dict[tuple, Any] = {}
_MODELS_LOCK = threading.Lock()


def _cached(key: tuple, load: Callable[[], Any]) -> Any:
    with _MODELS_LOCK:
        if key not in _MODELS:
            _MODELS[key] = load()
        return _MODELS[key]


def _weights_folder(path: str, needs: str) -> None:
    """Learned metrics load local weights only: `path` must be a folder. `needs` says which setting
    wants it and what it holds."""
    if not path or not os.path.isdir(path):
        raise ValueError(f"{needs}; {path!r} is not a folder (weights cannot be downloaded here)")


def load_dino(path: str, device: str) -> Callable[[np.ndarray, np.ndarray], float]:
    """A DINOv2 similarity from a local Hugging Face model folder (never downloads).
    Raises ValueError when transformers or the weights are missing."""
    _weights_folder(path, "dino_weight > 0 needs dino_model_path, a local DINOv2 model folder")
    try:
        import torch
        from transformers import AutoImageProcessor, AutoModel
    except ImportError as e:
        raise ValueError(f"the DINO metric needs torch and transformers: {e}") from None

    def load():
        try:
            model = AutoModel.from_pretrained(path, local_files_only=True).to(device).eval()
            processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load a DINOv2 model from {path!r}: {e}") from None
        return model, processor

    model, processor = _cached(("dino", path, device), load)

    def score(a: np.ndarray, b: np.ndarray) -> float:
        with torch.no_grad():
            inputs = processor(images=[a, b], return_tensors="pt").to(device)
            feats = model(**inputs).last_hidden_state.mean(dim=1)
            cos = torch.nn.functional.cosine_similarity(feats[0:1], feats[1:2]).item()
        return float(np.clip((cos + 1.0) / 2.0, 0.0, 1.0))

    return score


def load_dreamsim(path: str, device: str) -> Callable[[np.ndarray, np.ndarray], float]:
    """DreamSim similarity with weights from a local cache folder (never downloads).
    Raises ValueError when the dreamsim package or the weights are missing."""
    _weights_folder(path, "dreamsim_weight > 0 needs dreamsim_model_path, a folder holding DreamSim's weights")
    try:
        import torch
        from dreamsim import dreamsim
    except ImportError as e:
        raise ValueError(f"the DreamSim metric needs the dreamsim package: {e}") from None
    if not any(name.endswith((".pth", ".pt", ".safetensors", ".bin")) for _, _, files in os.walk(path)
               for name in files):
        raise ValueError(f"no DreamSim weight files under {path!r}")

    def load():
        return dreamsim(pretrained=True, cache_dir=path, device=device)

    model, preprocess = _cached(("dreamsim", path, device), load)

    def score(a: np.ndarray, b: np.ndarray) -> float:
        from PIL import Image
        with torch.no_grad():
            d = model(preprocess(Image.fromarray(a)).to(device), preprocess(Image.fromarray(b)).to(device)).item()
        return 1.0 - float(np.clip(d, 0.0, 1.0))

    return score


class Scorer:
    """The configured metric mix. Raises ValueError for bad weights or a missing learned backend."""

    def __init__(self, config: dict) -> None:
        # Each weight's range, edge_tolerance_px's and pixel_error_clip's are the config schema's
        # (env.py); their sum is a cross-field rule.
        self.weights = {m: float(config[f"{m}_weight"]) for m in METRICS}
        if sum(self.weights.values()) <= 0:
            raise ValueError("at least one metric weight must be above 0")
        self.edge_tolerance = int(config["edge_tolerance_px"])
        self.pixel_clip = float(config["pixel_error_clip"])
        device = str(config["learned_device"])
        self._learned: dict[str, Callable] = {}
        if self.weights["dino"] > 0:
            self._learned["dino"] = load_dino(str(config["dino_model_path"]), device)
        if self.weights["dreamsim"] > 0:
            self._learned["dreamsim"] = load_dreamsim(str(config["dreamsim_model_path"]), device)

    @property
    def active(self) -> list[str]:
        return [m for m in METRICS if self.weights[m] > 0]

    def target_edges(self, target: np.ndarray) -> np.ndarray:
        return _edges(target, self.edge_tolerance)

    def metrics(self, target: np.ndarray, attempt: np.ndarray,
                target_edges: np.ndarray | None = None) -> dict[str, float]:
        out = {}
        for m in self.active:
            if m == "ssim":
                out[m] = ssim_score(target, attempt)
            elif m == "edge":
                out[m] = edge_score(target, attempt, self.edge_tolerance, target_edges)
            elif m == "pixel":
                out[m] = pixel_score(target, attempt, self.pixel_clip)
            else:
                out[m] = self._learned[m](target, attempt)
        return out

    def score(self, metrics: dict[str, float]) -> float:
        """The weighted mean in [0, 1]."""
        total = sum(self.weights[m] for m in metrics)
        return sum(self.weights[m] * v for m, v in metrics.items()) / total

    def reward_parts(self, metrics: dict[str, float]) -> dict[str, float]:
        """weight x metric per metric: their sum is VAGEN's total_score."""
        return {m: self.weights[m] * v for m, v in metrics.items()}
