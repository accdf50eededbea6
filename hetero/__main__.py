"""``python -m hetero``: the same entry point as the ``hetero`` command."""

import sys

from .cli import main

sys.exit(main())
