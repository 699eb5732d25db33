"""The draft policy (an ``edge.planner.Planner``): ``closed_form`` the maths, ``evidence`` what it learns and whose,
``planner`` the decisions, ``config`` the settings."""

from .config import PolicyConfig
from .planner import DraftPolicy

__all__ = ["DraftPolicy", "PolicyConfig"]
