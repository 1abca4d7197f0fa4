"""tests/support/sgl_kernel, graphcap's stand-in for the sglang-kernel package. Each check runs in a fresh interpreter
with tests/support on PYTHONPATH - how sglang's engine and its subprocesses see it - so this process never imports
the stand-in (or sglang)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

from standin_ops import run_with_standin

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
HAS_SGLANG = importlib.util.find_spec("sglang") is not None
MESSAGE = ("is not provided (graphcap's engine harness covers only the Gemma 4 frozen-KV MTP path)")




@pytest.mark.subprocess
def test_standin_provides_the_ops_and_raises_for_the_rest():
    out = run_with_standin(f"""
        import importlib.metadata, math
        import pytest, torch
        import sgl_kernel
        from graphcap.kernels.elementwise import fused_ops

        assert sgl_kernel.__file__.startswith({str(SUPPORT)!r}), sgl_kernel.__file__
        assert importlib.metadata.version("sglang-kernel") == "0.4.9"
        for name in ("rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm", "gelu_tanh_and_mul",
                     "gelu_and_mul", "silu_and_mul", "apply_rope_with_cos_sin_cache_inplace"):
            assert getattr(sgl_kernel, name) is getattr(fused_ops, name), name

        # the ops compute sgl_kernel's results (float64 math here; test_fused_ops.py has the property tests)
        g = torch.Generator().manual_seed(1)
        x = torch.rand(3, 40, generator=g, dtype=torch.float64) + 0.5
        r = torch.rand(3, 40, generator=g, dtype=torch.float64) - 2.0
        w = torch.rand(40, generator=g, dtype=torch.float64) + 0.5
        def norm(v, off):
            return v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-6) * (w + off)
        f = lambda t: t.float()
        close = lambda a, b: torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=1e-6)
        close(sgl_kernel.rmsnorm(f(x), f(w), 1e-6), norm(x, 0.0))
        out = torch.empty(3, 40)
        assert sgl_kernel.gemma_rmsnorm(f(x), f(w), 1e-6, out=out, enable_pdl=False) is out
        close(out, norm(x, 1.0))
        xi, ri = f(x), f(r)
        assert sgl_kernel.fused_add_rmsnorm(xi, ri, f(w), 1e-6, enable_pdl=None) is None
        close(ri, x + r)
        close(xi, norm(x + r, 0.0))
        a, b = x[:, :20], x[:, 20:]
        close(sgl_kernel.gelu_tanh_and_mul(f(x)),
              0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3))) * b)
        q, k = f(x[:, :16]), f(x[:, 16:24])  # 2 query heads and 1 key head of 8; rotary dim 4
        pos = torch.tensor([0, 5, 9])
        inv = 1.0 / 10000.0 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4)
        ang = torch.arange(16, dtype=torch.float64)[:, None] * inv
        cache = torch.cat([ang.cos(), ang.sin()], -1).float()
        assert sgl_kernel.apply_rope_with_cos_sin_cache_inplace(pos, q, k, 8, cache, is_neox=True) is None
        kk = x[:, 16:24].clone()
        c, s = ang[pos].cos(), ang[pos].sin()
        kk[:, 0:2], kk[:, 2:4] = x[:, 16:18] * c - x[:, 18:20] * s, x[:, 18:20] * c + x[:, 16:18] * s
        close(k, kk)
        with pytest.raises(ValueError, match="^rmsnorm: weight has 7 entries"):
            sgl_kernel.rmsnorm(f(x), torch.ones(7))

        # utilities
        from sgl_kernel.utils import is_arch_support_pdl
        hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9  # the real one's answer
        assert is_arch_support_pdl() is hopper and sgl_kernel.utils.is_arch_support_pdl() is hopper
        t = torch.arange(12.0).view(3, 4)[1:]
        uses = torch._C._storage_Use_Count(t.untyped_storage()._cdata)
        wr = sgl_kernel.weak_ref_tensor(t)
        assert torch._C._storage_Use_Count(t.untyped_storage()._cdata) == uses, "must not own the memory"
        assert (wr.data_ptr(), wr.shape, wr.stride(), wr.dtype) == (t.data_ptr(), t.shape, t.stride(), t.dtype)
        t.add_(1)
        assert torch.equal(wr, t)
        assert sgl_kernel.weak_ref_tensor(3) == 3
        assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed"), "no torch.ops.sgl_kernel ops"

        # every other name: resolves at import time, raises (naming itself) when called
        from sgl_kernel.scalar_type import ScalarType, scalar_types
        from sgl_kernel.flash_attn import flash_attn_varlen_func
        import sgl_kernel.kvcacheio as kvio
        chain = sgl_kernel.scalar_types.uint4b8
        for fn, name in ((sgl_kernel.flash_mla_decode, "sgl_kernel.flash_mla_decode"),
                         (flash_attn_varlen_func, "sgl_kernel.flash_attn.flash_attn_varlen_func"),
                         (kvio.transfer_kv_per_layer, "sgl_kernel.kvcacheio.transfer_kv_per_layer"),
                         (scalar_types.uint4b8.size_bits, "sgl_kernel.scalar_type.scalar_types.uint4b8.size_bits"),
                         (chain, "sgl_kernel.scalar_types.uint4b8"),
                         (sgl_kernel.utils.get_cuda_stream, "sgl_kernel.utils.get_cuda_stream")):
            with pytest.raises(NotImplementedError) as e:
                fn(1, x=2)
            assert str(e.value) == "sgl_kernel stand-in: " + name + " " + {MESSAGE!r}, str(e.value)
        assert not hasattr(sgl_kernel, "__wrapped__") and not hasattr(chain, "__len__")
        print("standin ok")
    """)
    assert "standin ok" in out


@pytest.mark.subprocess
@pytest.mark.sglang
@pytest.mark.skipif(not HAS_SGLANG, reason="the real sglang package is not installed (make test installs it)")
def test_sglang_imports_and_passes_its_version_check_with_the_standin():
    """On this CPU machine sglang takes its CPU branches; the imports must still succeed with the stand-in present,
    and sglang's own start-up check (srt/entrypoints/engine.py) must accept the stand-in's dist-info."""
    out = run_with_standin(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "tests" / "sglang_isolated")!r})
        from _sglang_env import install_torchvision_stub
        install_torchvision_stub()
        import sglang.srt.layers.layernorm, sglang.srt.layers.activation, sglang.srt.layers.rotary_embedding
        import sglang.srt.layers.attention.triton_backend
        from sglang.srt.utils.common import assert_pkg_version
        assert_pkg_version("sglang-kernel", "0.4.9", "stand-in dist-info not found")
        import sgl_kernel
        assert sgl_kernel.__file__.startswith({str(SUPPORT)!r})
        print("imports ok")
    """)
    assert "imports ok" in out


@pytest.mark.subprocess
@pytest.mark.sglang
@pytest.mark.skipif(not HAS_SGLANG, reason="the real sglang package is not installed (make test installs it)")
def test_sglang_cuda_norm_paths_call_the_standin():
    """sglang's CUDA branch of layernorm.py (is_cuda() forced true before import; the tensors stay on CPU, where the
    stand-in's kernels run interpreted) binds the stand-in's rmsnorm / fused_add_rmsnorm / gemma_rmsnorm /
    gemma_fused_add_rmsnorm, and its forward_cuda - exactly the calls a Gemma 4 run makes - agrees with sglang's own
    forward_native."""
    out = run_with_standin(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "tests" / "sglang_isolated")!r})
        from _sglang_env import install_torchvision_stub
        install_torchvision_stub()
        import torch
        import sgl_kernel
        import sglang.srt.utils as u, sglang.srt.utils.common as c
        u.is_cuda = c.is_cuda = lambda: True
        import sglang.srt.layers.layernorm as ln
        assert ln._is_cuda
        for name in ("rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm"):
            assert getattr(ln, name) is getattr(sgl_kernel, name), name
        calls = []
        for name in ("rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm"):
            def spy(*a, _f=getattr(ln, name), _n=name, **k):
                calls.append(_n)
                return _f(*a, **k)
            setattr(ln, name, spy)
        torch.manual_seed(0)
        def close(a, b):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
        x = torch.randn(3, 5, 48, dtype=torch.bfloat16)
        r = torch.randn(3, 5, 48, dtype=torch.bfloat16)
        n = ln.RMSNorm(48, eps=1e-6).to(torch.bfloat16)
        n.weight.data.normal_()
        with torch.no_grad():
            close(n.forward_cuda(x), n.forward_native(x))
            for a, b in zip(n.forward_cuda(x.clone(), r.clone()), n.forward_native(x.clone(), r.clone())):
                close(a, b)
            for shift in (0.0, 1.0):
                g = ln.Gemma4RMSNorm(16, eps=1e-6, scale_shift=shift).to(torch.bfloat16)
                g.weight.data.normal_()
                q = torch.randn(4, 2, 16, dtype=torch.bfloat16)
                close(g.forward_cuda(q), g.forward_native(q))
            gg = ln.GemmaRMSNorm(48, eps=1e-6).to(torch.bfloat16)
            gg.weight.data.normal_()
            gg.refresh_gemma_weight()
            close(gg.forward_cuda(x[0].clone()), gg.forward_native(x[0].clone()))
            for a, b in zip(gg.forward_cuda(x[0].clone(), r[0].clone()), gg.forward_native(x[0].clone(), r[0].clone())):
                close(a, b)
        print(calls)
    """)
    assert out.strip().splitlines()[-1] == str(["rmsnorm", "fused_add_rmsnorm", "rmsnorm", "gemma_rmsnorm",
                                                "gemma_rmsnorm", "gemma_fused_add_rmsnorm"])


def test_standin_is_not_packaged():
    """`pip install graphcap` installs graphcap* only: the stand-in lives outside the package."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert cfg["tool"]["setuptools"]["packages"]["find"]["include"] == ["graphcap*"]
    from setuptools import find_packages
    found = find_packages(str(ROOT), include=["graphcap*"])
    assert found and all(p.split(".")[0] == "graphcap" for p in found)
    assert (SUPPORT / "sglang_kernel-0.4.9.dist-info" / "METADATA").is_file()
