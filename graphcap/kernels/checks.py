"""The argument checks the kernels' ops share: static ones only (type, dtype, rank, the last dimension's stride,
devices), never a GPU value, so a check costs no sync and an op checks inside a captured graph as outside it. Each
raises the op's own error class with a message that names the op and the argument."""
from __future__ import annotations

import torch


def dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    """"bfloat16/float16/float32": the dtypes a check names in its error."""
    return "/".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(error: type[Exception], op: str, name: str, x: object, dtypes: tuple[torch.dtype, ...],
                 ndim: int | None = None, *, contiguous_rows: bool = True) -> torch.Tensor:
    """`x` if it is a tensor of one of `dtypes`, with `ndim` dimensions where given and, unless `contiguous_rows` is
    False, a contiguous last dimension (the kernels address a row through one stride); else `error`."""
    if not isinstance(x, torch.Tensor):
        raise error(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes or (ndim is not None and x.ndim != ndim):
        raise error(f"{op}: {name} must be a {f'{ndim}-D ' if ndim else ''}{dtype_names(dtypes)} tensor, "
                    f"got {x.ndim}-D {x.dtype} {tuple(x.shape)}")
    if contiguous_rows and x.numel() and x.stride(-1) != 1:
        raise error(f"{op}: {name}'s last dimension must be contiguous (stride 1), got strides {x.stride()}")
    return x


def check_eps(error: type[Exception], op: str, eps: object) -> float:
    """A norm's epsilon as a float, if it is a number >= 0; else `error`."""
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise error(f"{op}: eps must be a float >= 0, got {eps!r}")
    return float(eps)


def check_same_device(error: type[Exception], op: str, **tensors: torch.Tensor) -> None:
    """`error` unless every one of `tensors` (named by their keywords) is on one device."""
    devices = {str(x.device) for x in tensors.values()}
    if len(devices) != 1:
        raise error(f"{op}: {', '.join(tensors)} must be on one device, got {sorted(devices)}")
