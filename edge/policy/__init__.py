"""The draft policy (an ``edge.planner.Planner``): ``closed_form`` the maths, ``evidence`` what it learns and whose,
``planner`` its settings and decisions."""

from .planner import DraftPolicy, PolicyConfig

__all__ = ["DraftPolicy", "PolicyConfig"]
