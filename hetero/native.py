"""The C++ extension ``hetero._C``, imported once for every module that calls into it.

``INTERFACE`` is a number that ``csrc/bindings.cpp`` compiles in; the two are raised together
whenever a binding changes in a way older Python code or an older build cannot handle. A build
from other sources (typically an editable install whose extension was not rebuilt after a pull)
is refused as a whole at import, with the reason in ``ERROR``, and every user falls back to its
Python path (the swap engine's ``python`` backend, the Python copy engine, torch-ops Adam) rather
than failing at its first call into a binding that changed.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from types import ModuleType
from typing import Any, Optional

INTERFACE = 2

_C: Optional[ModuleType]
ERROR: Optional[str]  # why _C is None (None when it imported)

try:
    from hetero import _C
except (ImportError, OSError) as _exc:  # not built, or built against another torch
    _C, ERROR = None, f"{type(_exc).__name__}: {_exc}"
else:
    _built = getattr(_C, "INTERFACE", None)
    if _built != INTERFACE:
        _C, ERROR = None, (f"hetero._C was built from other sources (interface {_built}, these need "
                           f"{INTERFACE}); rebuild it: pip install --no-build-isolation -e .")
    else:
        ERROR = None


# ------------------------------------------------------------------ forked children
#
# The swap and copy engines run threads (C++ ones, or the Python fallbacks'), and a child forked
# from the process holding them has none of those: destroying an engine there would join a
# thread that does not exist (a hang or a crash at the child's exit, even one that never touched
# hetero), and using one would wait forever. So in a child each registered engine is swapped for
# a stand-in that refuses use (shutdown and close do nothing), and the real one is kept, never
# destroyed, in a list the interpreter cannot free at exit. (The Adam queue does the same in C++.)

_OWNERS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # objects whose ``_engine`` runs threads
_KEPT: list[Any] = []  # in a forked child: the parent's engines, never destroyed


class ParentOnly:
    """Stands in, in a forked child, for an engine whose threads exist only in the parent."""

    def __init__(self, what: str) -> None:
        self._what = what

    def shutdown(self) -> None:
        pass

    def close(self, *args: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        from .errors import HeteroStateError

        raise HeteroStateError(
            f"this {self._what} was made in the parent of this forked process, and its threads "
            "exist only there; expected hetero's objects used in the process that made them "
            "(make new ones in the child, or start workers with the 'spawn' method)")


def register_engine(owner: Any) -> None:
    """``owner._engine`` runs threads: replace it in forked children (see above)."""
    _OWNERS.add(owner)


def _after_fork_in_child() -> None:
    for owner in list(_OWNERS):
        engine = getattr(owner, "_engine", None)
        if engine is not None and not isinstance(engine, ParentOnly):
            _KEPT.append(engine)
            owner._engine = ParentOnly(type(owner).__name__)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT))  # survives interpreter shutdown
