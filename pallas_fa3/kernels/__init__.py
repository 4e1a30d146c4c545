"""Hopper kernels (`sm90/`) and the deviceless compile tooling (`aot`, `ptx_profile`)."""
