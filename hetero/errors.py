"""Exceptions raised by hetero.

Each one subclasses the builtin a caller would already catch for that kind of failure, so code
written for plain PyTorch keeps working: bad arguments are ``ValueError``, running out of every
tier is ``MemoryError``, a failed swap read or write is ``OSError``.
"""

from __future__ import annotations


class HeteroError(Exception):
    """Base class of every error hetero raises on purpose."""


class HeteroConfigError(HeteroError, ValueError):
    """An argument of ``hetero.wrap`` (or an optimizer) is invalid; raised before anything moves."""


class HeteroOOMError(HeteroError, MemoryError):
    """The tiers together cannot hold the model state that has to be placed."""


class HeteroIOError(HeteroError, OSError):
    """A swap-file read or write failed (disk full, I/O error, short transfer)."""


class HeteroStateError(HeteroError, RuntimeError):
    """Model state was used in a way the runtime cannot serve (e.g. a plain torch optimizer
    stepping parameters whose data is not resident)."""
