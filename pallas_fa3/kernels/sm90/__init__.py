"""The Hopper (sm90) kernels in Pallas Mosaic GPU, their tilings and the
helpers they share; importing this package (or `config`) does not load
Mosaic GPU, the kernel modules do.
More: docs/kernels.md.
"""
