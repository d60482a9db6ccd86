"""Untrusted SVG in, a checked and re-serialized SVG out, or UnsafeSvg with the reason.

The model's SVG (and any user file) is hostile until proven otherwise. The checks run on the
parsed tree before anything renders, and what renders is our own serialization of that checked
tree, so the renderer never sees text we did not look at:
- XML: defusedxml refuses DTDs, entity declarations (billion laughs, XXE) and external references.
- References: every href must point inside the document (#id); url(...) in attributes and CSS
  only to #id; no @import; no <image>, <foreignObject>, <script>, event handlers.
- Elements: an allowlist of plain vector elements (no filters, patterns, masks or markers, which
  make cairo allocate intermediate surfaces or repeat content per vertex).
- Size: bytes, nesting depth, element count with every <use> expanded (a chain of <use> is the
  SVG form of billion laughs), reference cycles, canvas width/height/viewBox, number magnitudes.
What the static checks cannot bound (cairo's own running time) the renderer's time limit does.
"""
from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any

SVG_NS = "http://www.w3.org/2000/svg"
XLINK_NS = "http://www.w3.org/1999/xlink"
XML_NS = "http://www.w3.org/XML/1998/namespace"

DRAWABLE = ("circle", "ellipse", "rect", "line", "polyline", "polygon", "path", "text")
ALLOWED_ELEMENTS = frozenset({
    "svg", "g", "defs", "symbol", "use", "title", "desc", "style",
    "linearGradient", "radialGradient", "stop", "clipPath", "tspan", *DRAWABLE,
})
# Elements that are dropped with their content: they never render.
DROPPED_ELEMENTS = frozenset({"metadata"})
_WHY_NOT = {
    "image": "<image> loads external or embedded pictures",
    "foreignObject": "<foreignObject> embeds non-SVG content",
    "script": "<script> is code",
    "feImage": "<feImage> loads pictures",
    "filter": "filters are not supported",
    "pattern": "patterns are not supported",
    "mask": "masks are not supported",
    "marker": "markers are not supported",
    "a": "links are not supported",
}
# Attributes whose value is a name, not geometry: skipped by the number check.
_NAME_ATTRS = frozenset({"id", "class", "href", "font-family"})
_URL_RE = re.compile(r"url\(\s*(['\"]?)(.*?)\1\s*\)", re.IGNORECASE | re.DOTALL)
_NUMBER_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_HEX_RE = re.compile(r"#[0-9a-fA-F]+\b")
_LENGTH_RE = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(px|pt|pc|mm|cm|in|em|ex|%)?\s*$")
_UNIT_PX = {None: 1.0, "px": 1.0, "pt": 96 / 72, "pc": 16.0, "mm": 96 / 25.4, "cm": 96 / 2.54, "in": 96.0,
            "em": 16.0, "ex": 8.0}


class UnsafeSvg(Exception):
    """The SVG is refused; str(e) says why, in words for the agent."""


@dataclass(frozen=True)
class Limits:
    max_bytes: int = 32768
    max_elements: int = 512
    max_depth: int = 32
    max_canvas: float = 4096.0
    max_number: float = 1e6


@dataclass
class CheckedSvg:
    # What renders: our serialization of the checked tree.
    text: str
    canvas: tuple[float, float]
    elements: int
    shapes: list[dict[str, Any]] = field(default_factory=list)


def _local(name: str) -> tuple[str, str]:
    if name.startswith("{"):
        ns, _, local = name[1:].partition("}")
        return ns, local
    return "", name


def extract_svg(text: str) -> str:
    """The <svg>...</svg> part of an answer (models wrap it in prose or code fences)."""
    low = text.lower()
    if "<!doctype" in low or "<!entity" in low:
        raise UnsafeSvg("DTDs and entity declarations (<!DOCTYPE>, <!ENTITY>) are not allowed")
    start = low.find("<svg")
    end = low.rfind("</svg>")
    if start < 0:
        raise UnsafeSvg("no <svg> element found; answer with SVG code <svg ...>...</svg>")
    if end < start:
        # A self-closed root (<svg .../>) is an empty picture but well-formed.
        return text[start:].strip()
    return text[start:end + len("</svg>")]


def check_svg(text: str, limits: Limits) -> CheckedSvg:
    """Parses and checks `text` (an SVG document); raises UnsafeSvg with the reason."""
    from defusedxml import DefusedXmlException
    from defusedxml.ElementTree import fromstring

    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise UnsafeSvg(f"the SVG is {size} bytes; at most {limits.max_bytes} are allowed")
    try:
        root = fromstring(text, forbid_dtd=True, forbid_entities=True, forbid_external=True)
    except DefusedXmlException as e:
        raise UnsafeSvg(f"forbidden XML construct ({type(e).__name__}): DTDs, entities and external "
                        "references are not allowed") from None
    except ET.ParseError as e:
        raise UnsafeSvg(f"the SVG is not well-formed XML: {e}") from None
    except (ValueError, UnicodeError) as e:
        raise UnsafeSvg(f"the SVG cannot be read: {e}") from None
    ns, tag = _local(root.tag)
    if tag != "svg" or ns not in ("", SVG_NS):
        raise UnsafeSvg(f"the root element must be <svg>, not <{tag}>")

    clean = _clean_tree(root, limits)
    canvas = _canvas(clean, limits)
    count = _expanded_count(clean, limits)
    clean.set("xmlns", SVG_NS)
    serialized = ET.tostring(clean, encoding="unicode")
    return CheckedSvg(serialized, canvas, count, describe_shapes(clean))


def _clean_tree(root: ET.Element, limits: Limits) -> ET.Element:
    """A namespace-free copy of the tree with every element and attribute checked.
    Iterative (no recursion): a hostile depth must give a reason, not a RecursionError."""
    out_root = ET.Element("svg")
    stack = [(root, out_root, 1)]
    seen = 0
    while stack:
        src, dst, depth = stack.pop()
        if depth > limits.max_depth:
            raise UnsafeSvg(f"elements are nested more than {limits.max_depth} levels deep")
        seen += 1
        if seen > limits.max_elements:
            raise UnsafeSvg(f"the SVG has more than {limits.max_elements} elements")
        tag = dst.tag
        for key, value in src.attrib.items():
            ans, name = _local(key)
            if ans not in ("", XLINK_NS, XML_NS):
                continue  # editor metadata (inkscape:, sodipodi:): never rendered
            if ans == XML_NS and name != "space":
                raise UnsafeSvg(f"attribute xml:{name} is not allowed")
            _check_attribute(tag, name, value, limits)
            dst.set(name if ans != XML_NS else "xml:space", value)
        if src.text and tag in ("style", "text", "tspan", "title", "desc"):
            if tag == "style":
                _check_css(src.text, limits)
            dst.text = src.text
        for child in src:
            if not isinstance(child.tag, str):
                continue  # comments and processing instructions
            cns, ctag = _local(child.tag)
            if cns not in ("", SVG_NS) or ctag in DROPPED_ELEMENTS:
                continue  # foreign namespaces and <metadata> never render
            if ctag not in ALLOWED_ELEMENTS:
                why = _WHY_NOT.get(ctag, "it is not in the allowed set")
                raise UnsafeSvg(f"element <{ctag}> is not allowed: {why}; allowed elements: "
                                + ", ".join(sorted(ALLOWED_ELEMENTS)))
            out = ET.SubElement(dst, ctag)
            if tag in ("text", "tspan"):
                out.tail = child.tail
            stack.append((child, out, depth + 1))
    return out_root


def _check_attribute(tag: str, name: str, value: str, limits: Limits) -> None:
    low = name.lower()
    if low.startswith("on"):
        raise UnsafeSvg(f"event handler attribute {name!r} is not allowed")
    if low == "href":
        if not value.strip().startswith("#"):
            raise UnsafeSvg(f"external reference {value[:80]!r} is not allowed: href must point inside "
                            "the document (#id)")
        if tag not in ("use", "linearGradient", "radialGradient"):
            raise UnsafeSvg(f"href is not allowed on <{tag}>")
        return
    if low == "style":
        _check_css(value, limits)
        return
    _check_urls(value)
    if low not in _NAME_ATTRS:
        _check_numbers(name, value, limits)


def _check_urls(value: str) -> None:
    if "url(" not in value.lower().replace(" ", ""):
        return
    for m in _URL_RE.finditer(value):
        if not m.group(2).strip().startswith("#"):
            raise UnsafeSvg(f"external reference url({m.group(2)[:80]}) is not allowed: only url(#id)")
    if value.lower().count("url(") != len(_URL_RE.findall(value)):
        raise UnsafeSvg("malformed url(...) reference")


def _check_css(css: str, limits: Limits) -> None:
    low = css.lower()
    if "@import" in low or "@font-face" in low or "\\" in css:
        raise UnsafeSvg("CSS @import, @font-face and escapes are not allowed")
    if "expression(" in low or "javascript:" in low:
        raise UnsafeSvg("scripting in CSS is not allowed")
    _check_urls(css)
    _check_numbers("style", css, limits)


def _check_numbers(name: str, value: str, limits: Limits) -> None:
    for token in _NUMBER_RE.findall(_HEX_RE.sub(" ", value)):
        v = float(token)
        if not math.isfinite(v) or abs(v) > limits.max_number:
            raise UnsafeSvg(f"number {token} in {name!r} is out of range (at most {limits.max_number:g})")


def parse_length(value: str | None) -> float | None:
    """A length in px, or None where it is absent or relative (%)."""
    if value is None:
        return None
    m = _LENGTH_RE.match(value)
    if not m:
        raise UnsafeSvg(f"cannot read the length {value[:40]!r}")
    if m.group(2) == "%":
        return None
    return float(m.group(1)) * _UNIT_PX[m.group(2)]


def _canvas(root: ET.Element, limits: Limits) -> tuple[float, float]:
    """(width, height) of the drawing in user units; bounded so that nothing asks for a huge canvas."""
    vb = root.get("viewBox")
    width, height = parse_length(root.get("width")), parse_length(root.get("height"))
    for what, v in (("width", width), ("height", height)):
        if v is not None and not 0 < v <= limits.max_canvas:
            raise UnsafeSvg(f"canvas {what} {v:g} px is out of range (0, {limits.max_canvas:g}]")
    if vb is not None:
        parts = [p for p in re.split(r"[\s,]+", vb.strip()) if p]
        try:
            x, y, w, h = (float(p) for p in parts)
        except ValueError:
            raise UnsafeSvg(f"viewBox {vb[:60]!r} must be four numbers") from None
        if not (0 < w <= limits.max_canvas and 0 < h <= limits.max_canvas):
            raise UnsafeSvg(f"viewBox size {w:g} x {h:g} is out of range (0, {limits.max_canvas:g}]")
        return (w, h)
    if width is None or height is None:
        raise UnsafeSvg("the <svg> needs a viewBox or a width and height")
    return (width, height)


def _expanded_count(root: ET.Element, limits: Limits) -> int:
    """Elements drawn once every <use> is replaced by what it references; refuses cycles."""
    by_id = {el.get("id"): el for el in root.iter() if el.get("id")}
    memo: dict[int, int] = {}
    active: set[int] = set()

    def count(el: ET.Element) -> int:
        key = id(el)
        if key in memo:
            return memo[key]
        if key in active:
            raise UnsafeSvg("reference cycle: an element refers back to itself through href")
        active.add(key)
        total = 1
        for child in el:
            total += count(child)
        ref = el.get("href")
        if ref is not None:
            target = by_id.get(ref.strip()[1:])
            if target is None:
                raise UnsafeSvg(f"href {ref[:40]!r} names no element of the document")
            total += count(target) if el.tag == "use" else 0
            if el.tag != "use":
                count(target)  # gradient chains: checked for cycles only
        active.discard(key)
        if total > limits.max_elements:
            raise UnsafeSvg(f"the SVG expands to more than {limits.max_elements} elements "
                            "(counting every <use> copy)")
        memo[key] = total
        return total

    try:
        return count(root)
    except RecursionError:
        raise UnsafeSvg("references are chained too deeply") from None


# -- what the picture holds, for the ground truth ---------------------------------------------

_PATH_TOKEN = re.compile(r"[MmLlHhVvCcSsQqTtAaZz]|[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_ARGS = {"m": 2, "l": 2, "h": 1, "v": 1, "c": 6, "s": 4, "q": 4, "t": 2, "a": 7, "z": 0}


def _num(el: ET.Element, name: str, default: float = 0.0) -> float:
    v = parse_length(el.get(name)) if el.get(name) is not None else default
    return default if v is None else v


def path_points(d: str) -> list[tuple[float, float]]:
    """Points on a path (curves sampled, arcs by their end points), for its bounding box."""
    tokens = _PATH_TOKEN.findall(d or "")
    pts: list[tuple[float, float]] = []
    x = y = sx = sy = 0.0
    i, cmd = 0, ""
    while i < len(tokens):
        if tokens[i].isalpha():
            cmd = tokens[i]
            i += 1
            if cmd in "Zz":
                x, y = sx, sy
                continue
        if not cmd or cmd in "Zz":
            break
        n = _ARGS[cmd.lower()]
        args = [float(t) for t in tokens[i:i + n]]
        if len(args) < n:
            break
        i += n
        rel = cmd.islower()
        c = cmd.lower()
        ox, oy = (x, y) if rel else (0.0, 0.0)
        if c == "h":
            x = args[0] + (x if rel else 0.0)
        elif c == "v":
            y = args[0] + (y if rel else 0.0)
        else:
            coords = [(args[k] + ox, args[k + 1] + oy) for k in range(0, n, 2)] if c != "a" \
                else [(args[5] + ox, args[6] + oy)]
            if c in "cqs":
                start = (x, y)
                ctrl = [start, *coords]
                for step in range(1, 9):
                    pts.append(_bezier(ctrl, step / 8))
            x, y = coords[-1]
            if c == "m":
                sx, sy = x, y
                cmd = "l" if rel else "L"  # further pairs after M are line-tos
        pts.append((x, y))
    return pts


def _bezier(ctrl: list[tuple[float, float]], t: float) -> tuple[float, float]:
    pts = list(ctrl)
    while len(pts) > 1:
        pts = [((1 - t) * a[0] + t * b[0], (1 - t) * a[1] + t * b[1]) for a, b in zip(pts, pts[1:])]
    return pts[0]


def _bbox(el: ET.Element) -> list[float] | None:
    tag = el.tag
    if tag == "circle":
        cx, cy, r = _num(el, "cx"), _num(el, "cy"), _num(el, "r")
        return [cx - r, cy - r, cx + r, cy + r]
    if tag == "ellipse":
        cx, cy, rx, ry = _num(el, "cx"), _num(el, "cy"), _num(el, "rx"), _num(el, "ry")
        return [cx - rx, cy - ry, cx + rx, cy + ry]
    if tag == "rect":
        x, y = _num(el, "x"), _num(el, "y")
        return [x, y, x + _num(el, "width"), y + _num(el, "height")]
    if tag == "line":
        xs, ys = [_num(el, "x1"), _num(el, "x2")], [_num(el, "y1"), _num(el, "y2")]
        return [min(xs), min(ys), max(xs), max(ys)]
    if tag in ("polygon", "polyline"):
        nums = [float(t) for t in _NUMBER_RE.findall(el.get("points", ""))]
        pts = list(zip(nums[0::2], nums[1::2]))
    elif tag == "path":
        pts = path_points(el.get("d", ""))
    else:
        return None
    if not pts:
        return None
    return [min(p[0] for p in pts), min(p[1] for p in pts), max(p[0] for p in pts), max(p[1] for p in pts)]


def _paint(el: ET.Element, inherited: dict, name: str) -> str | None:
    style = el.get("style", "")
    m = re.search(rf"(?:^|;)\s*{name}\s*:\s*([^;]+)", style)
    value = m.group(1).strip() if m else el.get(name)
    return value if value is not None else inherited.get(name)


def describe_shapes(root: ET.Element) -> list[dict[str, Any]]:
    """Each drawn shape outside <defs>: type, fill, stroke, bounding box in user units (None
    where a transform applies or the geometry is not readable)."""
    shapes: list[dict[str, Any]] = []
    stack = [(root, {"fill": "black", "stroke": None}, False)]
    while stack:
        el, inherited, transformed = stack.pop()
        if el.tag in ("defs", "clipPath", "symbol", "linearGradient", "radialGradient", "style"):
            continue
        paint = {k: _paint(el, inherited, k) for k in ("fill", "stroke")}
        transformed = transformed or el.get("transform") is not None
        if el.tag in DRAWABLE:
            try:
                box = None if transformed else _bbox(el)
            except (UnsafeSvg, ValueError):
                box = None
            shape = {"type": el.tag, "fill": paint["fill"], "stroke": paint["stroke"],
                     "bbox": [round(v, 2) for v in box] if box else None}
            if paint["stroke"] not in (None, "none"):
                shape["stroke_width"] = el.get("stroke-width", "1")
            shapes.append(shape)
        for child in reversed(list(el)):
            if el.tag not in ("text",):
                stack.append((child, paint, transformed))
    return shapes
