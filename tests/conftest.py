import torch

# The test models are tiny: one thread avoids oversubscribing a 2-core machine.
torch.set_num_threads(1)


# Swap I/O in tests: every swapped block is checksummed (off by default in the library), and the
# tuning probe's results go to a throwaway cache instead of the user's ~/.cache.
import atexit  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

os.environ.setdefault("HETERO_IO_CHECKSUM", "1")
if "HETERO_IO_TUNING_CACHE" not in os.environ:
    _tuning_dir = tempfile.mkdtemp(prefix="hetero-test-tuning-")
    atexit.register(shutil.rmtree, _tuning_dir, True)
    os.environ["HETERO_IO_TUNING_CACHE"] = os.path.join(_tuning_dir, "io_tuning.json")


import pytest  # noqa: E402

from helpers import tight_budgets  # noqa: E402


@pytest.fixture(params=["device25_host", "device20_host30_nvme"])
def tight(request, tmp_path) -> dict:
    """Budgets that force movement (:func:`helpers.tight_budgets`), both with and without NVMe."""
    return tight_budgets(request.param, tmp_path)
