"""One planted out-of-bounds read from a Triton kernel in a torch process: run under compute-sanitizer's memcheck it
must be reported ("Invalid __global__ read"), which shows the tool attaches to torch and Triton here before a long
engine run depends on it. The read is 16 MiB past the end of a 20 MiB tensor (a caching-allocator segment of its
own: memcheck sees cudaMalloc's blocks, not torch's sub-allocations). Not meant to run without the tool."""
from __future__ import annotations

import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP planted_oob: needs CUDA")
        return 0
    import triton
    import triton.language as tl

    @triton.jit
    def _read(x, out, off):
        tl.store(out, tl.load(x + off))

    x = torch.zeros(5 * 2 ** 20, device="cuda")
    out = torch.empty(1, device="cuda")
    _read[(1,)](x, out, x.numel() + 2 ** 22)
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        print(f"planted read faulted: {e}")
        return 0
    print("planted read returned without a fault (expected under memcheck, which reports it instead)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
