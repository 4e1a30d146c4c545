"""The Hopper (sm90) kernels: `sm90/`."""
