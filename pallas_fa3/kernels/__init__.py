"""The Hopper (sm90) kernels: `sm90/` (docs/kernels.md)."""
