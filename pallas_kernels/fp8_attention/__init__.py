"""FP8 (and bf16) flash attention kernels for Hopper, Triton lowering."""
