"""Argument parsing and validation for ``hetero.wrap``.

Everything a user passes is checked here, before a single byte moves, and turned into a frozen
:class:`Config`. Each failure is a :class:`~hetero.errors.HeteroConfigError` that names the
argument, the value it got and what would be accepted.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import os
import re
import shutil
from typing import Any, Callable, Optional, Union

import psutil
import torch
import torch.distributed as dist

from . import engine
from .errors import HeteroConfigError

SizeLike = Union[int, str, None]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "p": 1000**5, "pb": 1000**5,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")

POLICIES = ("auto", "opt", "hotness", "lru", "static")
SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
#: Memory kept free on a CUDA device for activations and the allocator when no budget is given.
DEVICE_RESERVE_FRACTION = 0.2
HOST_DEFAULT_FRACTION = 0.8
NVME_DEFAULT_FRACTION = 0.9


def _integer(value: Any) -> Optional[int]:
    """``value`` as an int where it is a whole number of any kind Python can index with (int,
    numpy's integers, a one-element integer tensor; not bool), else None."""
    if isinstance(value, (bool, str)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except (TypeError, RuntimeError, ValueError):
        return None


def parse_size(value: SizeLike, name: str, *, allow_none: bool = True) -> Optional[int]:
    """Parse ``4096``, ``"512MiB"``, ``"8GB"`` or ``"1.5GiB"`` into bytes.

    Decimal units (KB, MB, GB) are powers of 1000 and binary units (KiB, MiB, GiB) powers of 1024,
    as in ``numfmt``.
    """
    accepted = "an int number of bytes or a string such as '512MiB', '8GB', '1.5GiB'"
    if value is None:
        if allow_none:
            return None
        raise HeteroConfigError(f"{name}=None is not accepted; expected {accepted}")
    if isinstance(value, bool):
        raise HeteroConfigError(f"{name}={value!r} is not a size; expected {accepted}")
    whole = _integer(value)  # (an int, numpy's, a one-element integer tensor)
    if whole is not None:
        nbytes = whole
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise HeteroConfigError(f"{name}={value!r} is not a size; expected {accepted}")
        nbytes = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise HeteroConfigError(f"{name}={value!r} ({type(value).__name__}) is not a size; "
                                f"expected {accepted}")
    if nbytes <= 0:
        whole = " (sizes are whole bytes: it rounds down to 0)" if isinstance(value, str) and float(m.group(1)) > 0 else ""
        raise HeteroConfigError(f"{name}={value!r} must be a positive size{whole}; expected {accepted}")
    return nbytes


def file_path(method: str, path: Any) -> Any:
    """``path`` for ``open`` if it names a file (a str or an os.PathLike); else HeteroConfigError.
    An int would be taken as an open file descriptor, written to and closed: one of the swap
    files', say, which the engine would go on using under that number for another file."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, (str, bytes)) or not path:
        raise HeteroConfigError(f"{method}(path={path!r}): expected a file path (a non-empty str or "
                                "os.PathLike), not an open file or descriptor")
    return path


#: The CPU "device" tier's default budget: none (it is bounded by the host's RAM)
UNLIMITED = 1 << 62


def format_budget(nbytes: int) -> str:
    """A budget, human-readable: ``format_size``, or 'unlimited' (:data:`UNLIMITED`)."""
    return "unlimited" if nbytes >= UNLIMITED else format_size(nbytes)


def format_size(nbytes: int) -> str:
    """Human-readable binary size, e.g. ``'1.50 MiB'``."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def exact_size(nbytes: int) -> str:
    """Bytes, exactly and readably (``'1572864 bytes (1.50 MiB)'``): what error messages give, so
    that the figure can be passed back as a budget."""
    return f"{nbytes} bytes ({format_size(nbytes)})"


def raise_budget_advice(nvme: bool) -> str:
    """What to change when the tiers together are too small."""
    if nvme:
        return "raise device_budget, host_budget or nvme_budget"
    return "raise device_budget or host_budget, or set nvme_path to add an NVMe tier"


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Dtypes used for compute (``param_dtype``), gradient reduction and buffers.

    Mirrors ``torch.distributed.fsdp.MixedPrecision``; ``None`` keeps the parameter's own dtype.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None


class ShardingStrategy(enum.Enum):
    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"


@dataclasses.dataclass(frozen=True)
class Config:
    """Validated arguments of ``hetero.wrap``; every budget is resolved to bytes."""

    device: torch.device
    device_budget: int  # bytes; for device="cpu" without a budget this is effectively unbounded
    host_budget: int
    nvme_path: Optional[str]
    nvme_budget: int  # 0 when the NVMe tier is disabled
    policy: Any  # a policy name or a hetero.Policy instance
    chunk_size: int
    prefetch: int
    auto_wrap_policy: Optional[Callable[..., bool]]
    sharding_strategy: ShardingStrategy
    mixed_precision: Optional[MixedPrecision]
    process_group: Any
    param_init_fn: Optional[Callable[[torch.nn.Module], None]]
    log_steps: Optional[int] = None  # the report's logs keep the last this many steps (None: all)


def default_device() -> torch.device:
    """Where a model computes by default: GPU ``LOCAL_RANK`` (torchrun's, 0 without it) when CUDA
    is available, else the CPU. HeteroConfigError where that GPU is not visible (a launcher
    that shows each rank only its own GPU)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        index = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        index = -1
    if not 0 <= index < torch.cuda.device_count():
        raise HeteroConfigError(
            f"the default device is the GPU numbered LOCAL_RANK ({os.environ.get('LOCAL_RANK')!r}), "
            f"but {torch.cuda.device_count()} CUDA device(s) are visible (cuda:0..cuda:"
            f"{torch.cuda.device_count() - 1}); expected the device given explicitly (device='cuda:N', "
            "or --device cuda:N)")
    return torch.device("cuda", index)


def _parse_device(device: Any) -> torch.device:
    accepted = "'cpu', 'cuda', 'cuda:N', a torch.device or None"
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise HeteroConfigError(f"device={device!r} is not a device; expected {accepted}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise HeteroConfigError(f"device={device!r} but CUDA is not available on this machine; "
                                    "use device='cpu' (a full mode: the device tier is a budgeted "
                                    "region of host memory)")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise HeteroConfigError(f"device={device!r} but only {torch.cuda.device_count()} CUDA "
                                    f"device(s) exist; expected cuda:0..cuda:{torch.cuda.device_count() - 1}")
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise HeteroConfigError(f"device={device!r} is not supported; expected {accepted}")
    return dev


def local_world_size() -> int:
    """Ranks sharing this machine, among which the default host and NVMe budgets are divided:
    torchrun's LOCAL_WORLD_SIZE, else (mp.spawn, srun) every rank of the default group, as if on
    one machine (too cautious across machines, never oversubscribed); 1 without
    torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    try:
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):
        return dist.get_world_size()


def _default_device_budget(device: torch.device) -> int:
    if device.type == "cpu":
        return UNLIMITED
    free, _total = torch.cuda.mem_get_info(device)
    return int(free * (1 - DEVICE_RESERVE_FRACTION))


def parse_policy(policy: Any, name: str = "policy") -> Any:
    """A policy name in POLICIES, or a hetero.Policy instance that can choose victims (what
    ``wrap`` and ``Report.simulate`` accept)."""
    from .policies import Policy  # local import: keeps config importable on its own

    if isinstance(policy, Policy):
        cls = type(policy)
        if cls.victim is Policy.victim and cls.victim_key is Policy.victim_key:
            raise HeteroConfigError(
                f"{name}={cls.__name__}() defines neither victim() nor victim_key(), so it cannot "
                "choose which block leaves a full tier; expected a hetero.Policy subclass that "
                "overrides one of them (or a subclass of a built-in, e.g. hetero.policies.LRU)")
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return policy
    hint = ""
    if isinstance(policy, type) and issubclass(policy, Policy):
        hint = f" ({policy.__name__} is a class: pass an instance, {policy.__name__}())"
    raise HeteroConfigError(f"{name}={policy!r} is not accepted{hint}; expected one of "
                            f"{', '.join(repr(p) for p in POLICIES)} or a hetero.Policy instance")


def parse_prefetch(prefetch: Any, name: str = "prefetch") -> int:
    """Units fetched ahead of use: an int >= 0."""
    depth = _integer(prefetch)
    if depth is None or depth < 0:
        raise HeteroConfigError(f"{name}={prefetch!r} is not accepted; expected an int >= 0 "
                                "(0 disables prefetch)")
    return depth


def _parse_sharding(strategy: Any) -> ShardingStrategy:
    name = getattr(strategy, "name", strategy)  # torch's ShardingStrategy enum carries .name
    if isinstance(name, str) and name.upper() in SHARDING:
        return ShardingStrategy(name.upper())
    raise HeteroConfigError(f"sharding_strategy={strategy!r} is not accepted; expected one of "
                            f"{', '.join(repr(s) for s in SHARDING)} or torch's ShardingStrategy of those names")


def _parse_mixed_precision(mp: Any) -> Optional[MixedPrecision]:
    if mp is None:
        return None
    accepted = "hetero.MixedPrecision(param_dtype, reduce_dtype, buffer_dtype) or torch's fsdp.MixedPrecision"
    fields = ("param_dtype", "reduce_dtype", "buffer_dtype")
    if not all(hasattr(mp, f) for f in fields):
        raise HeteroConfigError(f"mixed_precision={mp!r} is not accepted; expected {accepted}")
    floats = (torch.float32, torch.float16, torch.bfloat16)
    for f in fields:
        dtype = getattr(mp, f)
        if dtype is not None and dtype not in floats:
            raise HeteroConfigError(f"mixed_precision.{f}={dtype!r} is not accepted; expected "
                                    "torch.float32, torch.float16, torch.bfloat16 or None")
    return MixedPrecision(mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype)


def _check_nvme_path(nvme_path: Any) -> Optional[str]:
    if nvme_path is None:
        return None
    if not isinstance(nvme_path, (str, os.PathLike)) or not os.fspath(nvme_path):
        raise HeteroConfigError(f"nvme_path={nvme_path!r} is not a path; expected a directory path "
                                "(created if missing) or None to disable the NVMe tier")
    path = os.path.abspath(os.fspath(nvme_path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise HeteroConfigError(f"nvme_path={nvme_path!r} exists and is not a directory; expected a "
                                "directory (created if missing) or None")
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK | os.X_OK):
        raise HeteroConfigError(f"nvme_path={nvme_path!r} is not writable (no write permission on "
                                f"{probe!r}); expected a directory this process can create files in")
    return path


def _free_space_under(path: str) -> int:
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return shutil.disk_usage(probe).free


def _check_callable(value: Any, name: str, accepted: str) -> None:
    if value is not None and not callable(value):
        raise HeteroConfigError(f"{name}={value!r} is not accepted; expected {accepted}")


def _parse_auto_wrap_policy(policy: Any) -> Optional[Callable[..., bool]]:
    accepted = ("a callable(module, recurse, nonwrapped_numel) -> bool, a set of nn.Module "
                "classes, one of FSDP's policy objects (ModuleWrapPolicy, CustomPolicy), or None "
                "for the default (transformer-block-sized children)")
    if policy is None:
        return None
    if callable(getattr(policy, "_run_policy", None)):  # FSDP's _Policy: run on the root at wrap
        return policy
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        if not classes or not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
            raise HeteroConfigError(f"auto_wrap_policy={policy!r} is not accepted; expected {accepted}")

        def by_class(module: torch.nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
            return True if recurse else isinstance(module, classes)

        return by_class
    if isinstance(policy, type) and issubclass(policy, torch.nn.Module):  # (callable, as a constructor)
        raise HeteroConfigError(f"auto_wrap_policy={policy!r} (a module class) is not accepted; "
                                f"expected a set of classes such as {{{policy.__name__}}}, or {accepted}")
    if callable(policy):
        return policy
    raise HeteroConfigError(f"auto_wrap_policy={policy!r} is not accepted; expected {accepted}")


def resolve(
    *,
    device: Any,
    device_budget: SizeLike,
    host_budget: SizeLike,
    nvme_path: Any,
    nvme_budget: SizeLike,
    policy: Any,
    chunk_size: SizeLike,
    prefetch: Any,
    auto_wrap_policy: Any,
    sharding_strategy: Any,
    mixed_precision: Any,
    process_group: Any,
    param_init_fn: Any,
    log_steps: Any = None,
) -> Config:
    """Validate every argument of ``hetero.wrap`` and resolve defaults; raises HeteroConfigError."""
    if log_steps is not None and (isinstance(log_steps, bool) or not isinstance(log_steps, int) or log_steps < 1):
        raise HeteroConfigError(f"log_steps={log_steps!r} is not accepted; expected an int >= 1 (the "
                                "steps the report's logs keep) or None to keep them all")
    dev = _parse_device(device)
    dev_budget = parse_size(device_budget, "device_budget")
    host = parse_size(host_budget, "host_budget")
    path = _check_nvme_path(nvme_path)
    nvme = parse_size(nvme_budget, "nvme_budget")
    if nvme is not None and path is None:
        raise HeteroConfigError(f"nvme_budget={nvme_budget!r} was given without nvme_path; pass "
                                "nvme_path=DIR to enable the NVMe tier, or leave nvme_budget=None")
    if path is not None:
        engine.check_environment()  # the HETERO_IO_* settings the swap files will be used with
    chunk = parse_size(chunk_size, "chunk_size", allow_none=False)
    prefetch = parse_prefetch(prefetch)
    policy = parse_policy(policy)
    if not isinstance(policy, str):
        from .policies import check_free

        check_free(policy)
    _check_callable(param_init_fn, "param_init_fn",
                    "a callable(module) that initializes a meta-device module in place, or None")
    return Config(
        device=dev,
        device_budget=dev_budget if dev_budget is not None else _default_device_budget(dev),
        host_budget=host if host is not None
        else int(psutil.virtual_memory().available * HOST_DEFAULT_FRACTION) // local_world_size(),
        nvme_path=path,
        nvme_budget=0 if path is None else
        (nvme if nvme is not None else int(_free_space_under(path) * NVME_DEFAULT_FRACTION) // local_world_size()),
        policy=policy,
        chunk_size=chunk,
        prefetch=prefetch,
        auto_wrap_policy=_parse_auto_wrap_policy(auto_wrap_policy),
        sharding_strategy=_parse_sharding(sharding_strategy),
        mixed_precision=_parse_mixed_precision(mixed_precision),
        process_group=process_group,
        param_init_fn=param_init_fn,
        log_steps=log_steps,
    )
