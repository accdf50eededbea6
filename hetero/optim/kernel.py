"""The Adam(W) update of one flat chunk slice: the fused C++ kernel on the CPU, torch ops elsewhere.

:func:`adam_step_` is what :class:`hetero.optim.Adam` calls for every run of parameters it updates.
For CPU tensors, when the extension ``hetero._C`` is built, it runs ``csrc/cpu_adam.cpp``: one pass
that reads the gradient (fp32, bf16 or fp16) with the gradient scale folded in, updates the fp32
param/master, exp_avg and exp_avg_sq in place and, for mixed precision, writes the low-precision
param copy in the same pass; SIMD (AVX-512 / AVX2, picked at run time) over several threads with
the GIL released. Anywhere else (a GPU tier, a non-contiguous view, no extension) it runs the same
math as torch ops (:func:`adam_update_`). Both are torch's single-tensor Adam op for op, so either
equals ``torch.optim.Adam`` / ``AdamW`` (CPU, default options) bit for bit: the kernel measures once
how torch's own kernels round in this process (:func:`torch_numerics`: fused multiply-adds or not,
which square root) and does the same.

The square root: torch built with MKL (the x86 wheels) computes ``Tensor.sqrt`` with MKL's vmsSqrt,
which is not correctly rounded (on an AMD EPYC, 17% of all floats in [1, 4) get a result 1 ulp
off). Adam amplifies such differences wherever a gradient is rounding noise, so ``sqrt="torch"``
(the default) takes the square roots from that same function, a block at a time, to stay
bit-identical to torch. That costs a second pass over L1-resident blocks and MKL's slower sqrt;
``sqrt="ieee"`` uses the hardware instruction in one pass instead, which is what torch's
``fused=True`` CPU AdamW does (results equal it to float32 rounding). :class:`hetero.optim.Adam`
picks ``"ieee"`` for param groups with ``fused=True``. The torch path ignores ``sqrt`` (it is
torch's sqrt by definition).

Code path of the C++ kernel: the ``isa`` argument, else the environment variable
``HETERO_ADAM_ISA`` (``avx512``, ``avx2`` or ``scalar``; read at every call), else the best the CPU
supports; asking for one the CPU lacks raises ValueError. ``threads`` defaults to
``torch.get_num_threads()`` and then runs on torch's own thread pool (its threads are already
running after any torch op; threads of its own would oversubscribe the cores); another count
starts threads for the call. Threads take pieces of the range dynamically, so one the OS preempts
on a shared machine delays only its piece. Results are identical for every thread count.
"""

from __future__ import annotations

import torch

from hetero.native import ERROR as _EXT_ERROR, _C as _ext

def _unavailable(what: str) -> str:
    return (f"the C++ {what} is not available ({_EXT_ERROR or 'not built'}); build it: "
            "`pip install --no-build-isolation -e .`")


_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16)

Scale = float | torch.Tensor | None  # a one-element tensor is read with .item()


def has_kernel() -> bool:
    """Whether the C++ kernel is available (``hetero._C`` built with ``csrc/cpu_adam.cpp``)."""
    return _ext is not None


def available_isas() -> list[str]:
    """Code paths of the C++ kernel this CPU can run, best first (``[]`` without the kernel).

    A subset of ``["avx512", "avx2", "scalar"]``; ``"scalar"`` is always there when the kernel is.
    """
    return list(_ext.adam_isas()) if _ext is not None else []


def torch_numerics() -> dict:
    """How torch's own CPU kernels round in this process, which the C++ kernel mirrors (measured
    once against torch): ``{"sqrt": "mkl" | "ieee", "fma": bool}`` -- the square root
    ``sqrt="torch"`` computes (MKL's vmsSqrt, as torch's ``Tensor.sqrt``, or the IEEE
    instruction) and whether torch's add/lerp/addcmul fuse their multiply-adds (its AVX2 and
    AVX-512 kernels do, its DEFAULT-capability ones do not)."""
    if _ext is None:
        raise RuntimeError(_unavailable("Adam kernel"))
    return dict(_ext.adam_torch_numerics())


def selected_isa(isa: str | None = None) -> str:
    """The code path a call with ``isa`` takes now (``isa`` argument, HETERO_ADAM_ISA, or best)."""
    if _ext is None:
        raise RuntimeError(_unavailable("Adam kernel"))
    return _ext.adam_isa(isa or "")


def adam_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float, decoupled: bool) -> None:
    """One Adam(W) update of flat tensors in place, exactly as torch's ``_single_tensor_adam``.

    The torch-ops reference and fallback of :func:`adam_step_`; ``grad`` has ``param``'s dtype and
    is not modified.
    """
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _kernel_applies(tensors: list[torch.Tensor], grad: torch.Tensor,
                    param_out: torch.Tensor | None) -> bool:
    return (_ext is not None
            and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
            and all(t.dtype == torch.float32 for t in tensors[:1] + tensors[2:4])
            and grad.dtype in _GRAD_DTYPES
            and (param_out is None or (param_out.dtype in _OUT_DTYPES and param_out.device.type == "cpu"
                                       and param_out.is_contiguous())))


def adam_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float, decoupled: bool, grad_scale: Scale = None,
               param_out: torch.Tensor | None = None, isa: str | None = None,
               threads: int | None = None, sqrt: str = "torch") -> None:
    """One Adam (``decoupled=False``, L2 weight decay) or AdamW update of flat tensors in place.

    ``param`` (fp32 master or plain param), ``exp_avg`` and ``exp_avg_sq`` are updated; ``grad``
    (param's dtype, or bf16/fp16 under mixed precision) is read only, after multiplying by
    ``grad_scale`` (a float or a one-element tensor, e.g. a clipping coefficient) when given;
    ``param_out`` (bf16/fp16, same numel), when given, receives the updated param rounded to
    nearest even. ``step`` is the step count after this update (torch's ``state["step"]``).
    The result equals torch's own sequence: ``g = grad.to(param.dtype) * grad_scale``, a
    ``torch.optim.Adam/AdamW`` step, ``param_out.copy_(param)``.

    Uses the C++ kernel for contiguous CPU tensors when it is built; ``isa`` / ``threads`` pick its
    code path and thread count, ``sqrt`` its square root (``"torch"``: bit-identical to torch's
    default Adam; ``"ieee"``: faster, as torch's fused CPU AdamW). Asking for an ``isa`` when the
    kernel cannot run raises.
    """
    if sqrt not in ("torch", "ieee"):
        raise ValueError(f"sqrt={sqrt!r} is not accepted; expected 'torch' or 'ieee'")
    if step < 1:
        raise ValueError(f"step={step} is not accepted; expected the step count after this update (>= 1)")
    tensors = [param, grad, exp_avg, exp_avg_sq]
    if _kernel_applies(tensors, grad, param_out):
        _ext.adam_step(*native_args(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1,
                                    beta2=beta2, eps=eps, weight_decay=weight_decay,
                                    decoupled=decoupled, grad_scale=grad_scale, param_out=param_out,
                                    isa=isa, threads=threads, sqrt=sqrt))
        return
    if isa is not None:
        why = (_unavailable("kernel") if _ext is None
               else "the tensors are not contiguous CPU tensors of supported dtypes")
        raise RuntimeError(f"isa={isa!r} asks for the C++ Adam kernel but {why}")
    g = grad.to(param.dtype)
    if grad_scale is not None:
        g = g * (grad_scale.to(g.device) if isinstance(grad_scale, torch.Tensor) else grad_scale)
    adam_update_(param, g, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
                 eps=eps, weight_decay=weight_decay, decoupled=decoupled)
    if param_out is not None:
        param_out.copy_(param)


def native_args(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, decoupled: bool, grad_scale: Scale = None,
                param_out: torch.Tensor | None = None, isa: str | None = None,
                threads: int | None = None, sqrt: str = "torch") -> tuple:
    """:func:`adam_step_`'s arguments as the C++ kernel takes them, in order: ``_C.adam_step``,
    and each call of a job ``_C.AdamQueue.submit`` queues (:mod:`hetero.optim.queue`). Defaults
    resolved here: no ``grad_scale`` is 1 (a tensor is read with ``.item()``, exact in fp32), no
    ``isa`` the best path, no ``threads`` this thread's torch thread count."""
    return (param, grad, exp_avg, exp_avg_sq, param_out, int(step), float(lr), float(beta1),
            float(beta2), float(eps), float(weight_decay), bool(decoupled),
            1.0 if grad_scale is None else float(grad_scale), isa or "",
            torch.get_num_threads() if threads is None else int(threads), sqrt)


def stream_update_(read: list[torch.Tensor], update: list[torch.Tensor], *, scale: float = 1.0,
                   isa: str | None = None, threads: int | None = None) -> int:
    """Memory-bandwidth probe of the C++ extension: ``u += scale * sum(read)`` for each ``u`` in
    ``update`` (contiguous fp32 CPU tensors of one numel), on the same code paths and threads as
    the Adam kernel. With ``read=[g]``, ``update=[p, m, v]`` it moves the bytes of an fp32 Adam
    step and nothing else; ``scale=0`` leaves finite values as they are (but for the sign of a
    zero; every line is still written back), so it can run over live optimizer state. Returns the
    bytes moved (``numel * 4 * (len(read) + 2 * len(update))``)."""
    if _ext is None:
        raise RuntimeError(_unavailable("streaming kernel"))
    return int(_ext.stream_update(read, update, scale=float(scale), isa=isa or "",
                                  threads=torch.get_num_threads() if threads is None else int(threads)))
