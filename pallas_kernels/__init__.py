"""Raw Pallas kernels: no autodiff, no policy, no model code."""
