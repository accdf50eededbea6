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
    """The policy object for a ``policy=`` argument: a fresh one for a name in POLICIES; an
    instance is used as given (it is the run's live policy, and learns from what it observes)."""
    if isinstance(policy, Policy):
        return policy
    return POLICIES[policy]()


def starting_copy(policy: "str | Policy") -> "str | Policy | None":
    """What a replay of a run can start from: the name, or a copy of the instance taken before
    the run uses it (None where it cannot be copied, e.g. it holds a lock)."""
    if not isinstance(policy, Policy):
        return policy
    try:
        return copy.deepcopy(policy)
    except Exception:  # noqa: BLE001 - any object a policy may hold
        return None


__all__ = ["Policy", "BlockInfo", "Timeline", "make_policy", "starting_copy", "POLICIES",
           "Auto", "Opt", "Hotness", "LRU", "Static"]
