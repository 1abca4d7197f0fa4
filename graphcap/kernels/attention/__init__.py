"""Attention over K/V read in place from the target's pools, split-KV: the draft's decode (`decode`, its kernels in
`decode_kernels`), the target verify's (`verify`), the host-side plan both launch from (`plan`)."""
