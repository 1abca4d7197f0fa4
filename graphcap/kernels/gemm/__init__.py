"""Matrix products at the draft's few rows: the skinny GEMM (`skinny`, its kernels in `skinny_kernels`)."""
