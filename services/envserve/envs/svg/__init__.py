"""VAGEN's SVG reconstruction on cairosvg, with a sanitizer and a sandboxed renderer; see env.py."""
from .env import SvgEnv

__all__ = ["SvgEnv"]
