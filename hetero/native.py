"""The C++ extension ``hetero._C``, imported once for every module that calls into it.

``INTERFACE`` is a number that ``csrc/bindings.cpp`` compiles in; the two are raised together
whenever a binding changes in a way older Python code or an older build cannot handle. A build
from other sources (typically an editable install whose extension was not rebuilt after a pull)
is refused as a whole at import, with the reason in ``ERROR``, and every user falls back to its
Python path (the swap engine's ``python`` backend, the Python copy engine, torch-ops Adam) rather
than failing at its first call into a binding that changed.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

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
