"""hetero: heterogeneous-memory placement of PyTorch training state (device / host / NVMe).

Public names only; see shared/API.md for the contract.
"""

from . import optim
from .config import MixedPrecision
from .errors import HeteroConfigError, HeteroError, HeteroIOError, HeteroOOMError, HeteroStateError
from .policies import Policy
from .profiler import Report
from .wrap import HeteroModule, wrap

__all__ = [
    "wrap", "HeteroModule", "MixedPrecision", "Policy", "Report", "optim",
    "HeteroError", "HeteroConfigError", "HeteroOOMError", "HeteroIOError", "HeteroStateError",
]
