"""Seeded simple SVG icons: a few filled or stroked shapes in named colours on a square canvas.

The generator draws from random.Random seeded with a string (hashed with SHA-512 by Python,
not with the per-process hash seed), so the same seed gives the same SVG text in any process.
Coordinates are integers and colours are CSS names, so a model can write them back exactly.
"""
from __future__ import annotations

import math
import random

FILL_COLOURS = (
    "red", "crimson", "orange", "gold", "yellowgreen", "green", "teal", "deepskyblue", "blue", "navy",
    "purple", "magenta", "hotpink", "brown", "chocolate", "black", "gray", "darkslategray", "tomato", "orchid",
)
BACKGROUNDS = ("white", "ivory", "lavender", "honeydew", "aliceblue", "mistyrose", "lightyellow", "linen")
STROKES = ("black", "darkslategray", "navy", "white", "maroon")
SHAPE_TYPES = ("circle", "rect", "ellipse", "triangle", "polygon", "star", "blob", "curve", "line")


def _fmt(v: float) -> str:
    return str(int(round(v)))


def _points(pts) -> str:
    return " ".join(f"{_fmt(x)},{_fmt(y)}" for x, y in pts)


def generate_icon(seed: int, canvas: int = 256, min_shapes: int = 2, max_shapes: int = 5) -> str:
    rng = random.Random(f"envserve-svg-icon:{seed}")
    n = rng.randint(min_shapes, max_shapes)
    colours = rng.sample(FILL_COLOURS, k=min(n, len(FILL_COLOURS)))
    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{canvas}" height="{canvas}" '
             f'viewBox="0 0 {canvas} {canvas}">']
    if rng.random() < 0.6:
        lines.append(f'  <rect x="0" y="0" width="{canvas}" height="{canvas}" fill="{rng.choice(BACKGROUNDS)}"/>')
    c = canvas
    lo, hi = c * 0.08, c * 0.3
    for i in range(n):
        kind = rng.choice(SHAPE_TYPES)
        colour = colours[i % len(colours)]
        cx, cy = rng.uniform(c * 0.2, c * 0.8), rng.uniform(c * 0.2, c * 0.8)
        stroke = ""
        if kind not in ("curve", "line") and rng.random() < 0.35:
            stroke = f' stroke="{rng.choice(STROKES)}" stroke-width="{rng.randint(2, 8)}"'
        if kind == "circle":
            r = rng.uniform(lo, hi)
            lines.append(f'  <circle cx="{_fmt(cx)}" cy="{_fmt(cy)}" r="{_fmt(r)}" fill="{colour}"{stroke}/>')
        elif kind == "rect":
            w, h = rng.uniform(2 * lo, 2 * hi), rng.uniform(2 * lo, 2 * hi)
            rx = f' rx="{rng.randint(4, 20)}"' if rng.random() < 0.4 else ""
            lines.append(f'  <rect x="{_fmt(cx - w / 2)}" y="{_fmt(cy - h / 2)}" width="{_fmt(w)}" '
                         f'height="{_fmt(h)}"{rx} fill="{colour}"{stroke}/>')
        elif kind == "ellipse":
            rx, ry = rng.uniform(lo, hi), rng.uniform(lo, hi)
            lines.append(f'  <ellipse cx="{_fmt(cx)}" cy="{_fmt(cy)}" rx="{_fmt(rx)}" ry="{_fmt(ry)}" '
                         f'fill="{colour}"{stroke}/>')
        elif kind in ("triangle", "polygon", "star"):
            r = rng.uniform(lo * 1.2, hi)
            sides = 3 if kind == "triangle" else rng.randint(5, 8) if kind == "polygon" else rng.randint(5, 7)
            turn = rng.uniform(0, 2 * math.pi)
            pts = []
            corners = sides * (2 if kind == "star" else 1)
            for k in range(corners):
                radius = r if kind != "star" or k % 2 == 0 else r * 0.45
                a = turn + 2 * math.pi * k / corners
                pts.append((cx + radius * math.cos(a), cy + radius * math.sin(a)))
            lines.append(f'  <polygon points="{_points(pts)}" fill="{colour}"{stroke}/>')
        elif kind == "blob":
            r = rng.uniform(lo, hi)
            k = rng.randint(3, 5)
            pts = [(cx + r * rng.uniform(0.7, 1.2) * math.cos(2 * math.pi * j / k),
                    cy + r * rng.uniform(0.7, 1.2) * math.sin(2 * math.pi * j / k)) for j in range(k)]
            d = [f"M {_fmt(pts[0][0])} {_fmt(pts[0][1])}"]
            for j in range(k):
                (x0, y0), (x1, y1) = pts[j], pts[(j + 1) % k]
                mx, my = (x0 + x1) / 2, (y0 + y1) / 2
                # Bulge each side outwards from the centre.
                qx, qy = cx + (mx - cx) * 1.6, cy + (my - cy) * 1.6
                d.append(f"Q {_fmt(qx)} {_fmt(qy)} {_fmt(x1)} {_fmt(y1)}")
            lines.append(f'  <path d="{" ".join(d)} Z" fill="{colour}"{stroke}/>')
        elif kind == "curve":
            x0, y0 = rng.uniform(c * 0.1, c * 0.9), rng.uniform(c * 0.1, c * 0.9)
            x1, y1 = rng.uniform(c * 0.1, c * 0.9), rng.uniform(c * 0.1, c * 0.9)
            d = (f"M {_fmt(x0)} {_fmt(y0)} C {_fmt(rng.uniform(0, c))} {_fmt(rng.uniform(0, c))} "
                 f"{_fmt(rng.uniform(0, c))} {_fmt(rng.uniform(0, c))} {_fmt(x1)} {_fmt(y1)}")
            lines.append(f'  <path d="{d}" fill="none" stroke="{colour}" stroke-width="{rng.randint(4, 12)}" '
                         f'stroke-linecap="round"/>')
        else:  # line
            a = rng.uniform(0, math.pi)
            half = rng.uniform(c * 0.15, c * 0.35)
            lines.append(f'  <line x1="{_fmt(cx - half * math.cos(a))}" y1="{_fmt(cy - half * math.sin(a))}" '
                         f'x2="{_fmt(cx + half * math.cos(a))}" y2="{_fmt(cy + half * math.sin(a))}" '
                         f'stroke="{colour}" stroke-width="{rng.randint(4, 12)}" stroke-linecap="round"/>')
    lines.append("</svg>")
    return "\n".join(lines)
