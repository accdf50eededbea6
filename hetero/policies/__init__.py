"""Placement policies: pure functions of block metadata and access history (see ``base``)."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any, Optional

from ..errors import HeteroConfigError
from .auto import Auto
from .base import BlockInfo, Policy, Timeline
from .hotness import Hotness
from .lru import LRU
from .opt import Opt
from .static import Static

POLICIES = {"auto": Auto, "opt": Opt, "hotness": Hotness, "lru": LRU, "static": Static}

#: id of a policy instance -> the runtime of the wrapped model it is the live policy of (weak:
#: the entry goes with the runtime, which holds the policy, so the id is not reused meanwhile)
_LIVE: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def make_policy(policy: "str | Policy") -> Policy:
    """The policy object for a ``policy=`` argument: a fresh one for a name in POLICIES; an
    instance is used as given (it is the run's live policy, and learns from what it observes),
    unless a wrapped model runs it already (HeteroConfigError: see :func:`check_free`)."""
    if isinstance(policy, Policy):
        check_free(policy)
        return policy
    if policy not in POLICIES:
        raise HeteroConfigError(
            f"policy={policy!r} is not one of hetero's policies ({', '.join(map(repr, POLICIES))}); "
            "a run of a custom policy reports that policy's own name (or its class name), and "
            "replays with an instance of that class: pass one (a fresh one, as the run started)")
    return POLICIES[policy]()


def report_name(policy: Policy) -> str:
    """The name a run reports for its policy (``as_dict()["policy"]``, the event log's header):
    a built-in's own name; for any other class, the ``name`` it gave itself, or its class name
    where that name is a built-in's or the base's (a subclass of ``lru`` is not ``lru``: a
    replay by that name would give other traffic)."""
    if type(policy) in POLICIES.values():
        return policy.name
    name = getattr(policy, "name", None)
    if isinstance(name, str) and name and name not in POLICIES and name != Policy.name:
        return name
    return type(policy).__name__


def claim(policy: Policy, runtime: Any) -> None:
    """``runtime`` (a wrapped model's, not the simulator's) runs ``policy`` from now on, until it
    is closed: no other may (:func:`check_free`)."""
    _LIVE[id(policy)] = runtime


def owner(policy: Policy) -> Optional[Any]:
    """The runtime of the open wrapped model whose live policy ``policy`` is, or None."""
    runtime = _LIVE.get(id(policy))
    if runtime is None or runtime.policy is not policy or runtime.closed:
        return None
    return runtime


def check_free(policy: Policy, name: str = "policy") -> None:
    """HeteroConfigError where ``policy`` is the live policy of another open wrapped model. A
    runtime points the policy's ``sizes``, ``kinds`` and ``chunks`` at its own blocks and feeds
    it its accesses, so a second runtime would take the policy from the first and each would
    decide on the other's history. (A model dropped without ``close()`` may still be held by a
    reference cycle: those are collected before refusing.)"""
    if owner(policy) is not None:
        gc.collect()
    if owner(policy) is not None:
        raise HeteroConfigError(
            f"{name}={type(policy).__name__}() is the live policy of another wrapped model that is "
            "still open; expected an instance no open model uses (a policy learns from its own "
            "run): pass a fresh one or copy.deepcopy(policy), or close() that model first")


def starting_copy(policy: "str | Policy") -> "str | Policy | None":
    """What a replay of a run can start from: the name, or a copy of the instance taken before
    the run uses it (None where it cannot be copied, e.g. it holds a lock)."""
    if not isinstance(policy, Policy):
        return policy
    try:
        return copy.deepcopy(policy)
    except Exception:  # noqa: BLE001 - any object a policy may hold
        return None


__all__ = ["Policy", "BlockInfo", "Timeline", "make_policy", "starting_copy", "report_name",
           "claim", "check_free", "POLICIES", "Auto", "Opt", "Hotness", "LRU", "Static"]
