"""PIL drawing of small symbol grids into RGB arrays, shared by the grid environments.

Each cell token maps to a Tile: a background colour plus optional marks (shapes drawn
inset in the cell) and an optional text label. The image is exactly size x size; cells
stretch to fill it, so non-square boards get non-square cells.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

RGB = tuple[int, int, int]

GRID_LINE: RGB = (40, 40, 40)


@dataclass(frozen=True)
class Mark:
    # "square", "ring" (square outline), "circle", "diamond" or "cross".
    kind: str
    color: RGB
    # Fraction of the cell left free on each side.
    inset: float = 0.2


@dataclass(frozen=True)
class Tile:
    fill: RGB
    marks: tuple[Mark, ...] = ()
    label: str = ""
    label_color: RGB = (0, 0, 0)


@lru_cache(maxsize=32)
def _font(px: int):
    try:
        return ImageFont.load_default(size=max(6, px))
    except (TypeError, OSError):  # Pillow without FreeType: fixed bitmap font
        return ImageFont.load_default()


def _draw_mark(draw: ImageDraw.ImageDraw, mark: Mark, x0: int, y0: int, x1: int, y1: int) -> None:
    dx = int((x1 - x0) * mark.inset)
    dy = int((y1 - y0) * mark.inset)
    box = (x0 + dx, y0 + dy, max(x0 + dx, x1 - dx), max(y0 + dy, y1 - dy))
    width = max(1, (x1 - x0) // 10)
    if mark.kind == "square":
        draw.rectangle(box, fill=mark.color)
    elif mark.kind == "ring":
        draw.rectangle(box, outline=mark.color, width=width)
    elif mark.kind == "circle":
        draw.ellipse(box, fill=mark.color)
    elif mark.kind == "diamond":
        cx, cy = (box[0] + box[2]) // 2, (box[1] + box[3]) // 2
        draw.polygon([(cx, box[1]), (box[2], cy), (cx, box[3]), (box[0], cy)], fill=mark.color)
    elif mark.kind == "cross":
        draw.line((box[0], box[1], box[2], box[3]), fill=mark.color, width=width)
        draw.line((box[0], box[3], box[2], box[1]), fill=mark.color, width=width)
    else:
        raise ValueError(f"unknown mark kind {mark.kind!r}")


def render_grid(rows: Sequence[Sequence[str]], size: int, tiles: Mapping[str, Tile],
                grid_line: RGB | None = GRID_LINE) -> np.ndarray:
    """Draw `rows` (each a string of one-character tokens or a list of tokens) as a
    size x size RGB uint8 array; every token must be a key of `tiles`."""
    size = int(size)
    if size <= 0:
        raise ValueError(f"image size must be positive, got {size}")
    h = len(rows)
    w = max((len(r) for r in rows), default=0)
    img = Image.new("RGB", (size, size), grid_line or (0, 0, 0))
    if h == 0 or w == 0:
        return np.array(img, dtype=np.uint8)
    draw = ImageDraw.Draw(img)
    # Grid lines are the background showing through a 1-pixel gap, when cells are big enough.
    gap = 1 if grid_line is not None and size >= 4 * max(h, w) else 0
    font = None
    for r, row in enumerate(rows):
        y0, y1 = r * size // h, (r + 1) * size // h - 1 - gap
        for c, token in enumerate(row):
            x0, x1 = c * size // w, (c + 1) * size // w - 1 - gap
            if x1 < x0 or y1 < y0:
                continue  # board larger than the image: this cell has no pixels
            tile = tiles[token]
            draw.rectangle((x0, y0, x1, y1), fill=tile.fill)
            for mark in tile.marks:
                _draw_mark(draw, mark, x0, y0, x1, y1)
            if tile.label:
                if font is None:
                    font = _font(int(min(size / h, size / w) * 0.7))
                draw.text(((x0 + x1 + 1) / 2, (y0 + y1 + 1) / 2), tile.label, fill=tile.label_color,
                          font=font, anchor="mm")
    return np.array(img, dtype=np.uint8)
