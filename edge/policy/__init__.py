"""The draft policy (an ``edge.planner.Planner``): which way of decoding and which tree, chosen in closed form from
acceptance, round trip and cost curves. ``closed_form``: the maths; ``evidence``: what it learns, and whose;
``planner``: the decisions; ``config``: the settings."""

from .config import PolicyConfig
from .planner import DraftPolicy

__all__ = ["DraftPolicy", "PolicyConfig"]
