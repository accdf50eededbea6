"""Placement policies: pure functions of block metadata and access history (see ``base``)."""

from __future__ import annotations

import copy

from .auto import Auto
from .base import BlockInfo, Policy, Timeline
from .hotness import Hotness
from .lru import LRU
from .opt import Opt
from .static import Static

POLICIES = {"auto": Auto, "opt": Opt, "hotness": Hotness, "lru": LRU, "static": Static}


def make_policy(policy: "str | Policy") -> Policy:
    """A fresh policy object for a ``policy=`` argument: a name in POLICIES, or an instance,
    which is copied (a policy learns from what it observes: the caller's instance stays the
    template every run and replay starts from)."""
    if isinstance(policy, Policy):
        return copy.deepcopy(policy)
    return POLICIES[policy]()


__all__ = ["Policy", "BlockInfo", "Timeline", "make_policy", "POLICIES",
           "Auto", "Opt", "Hotness", "LRU", "Static"]
