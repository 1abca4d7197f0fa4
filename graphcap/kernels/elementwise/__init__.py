"""The layers' per-row ops - norms, residual adds, gated activations, rotary: one kernel per op as sglang launches
them from sgl_kernel's `elementwise` (`fused_ops`), and the draft layer's chains of them one kernel each
(`layer_fusions`)."""
