"""The Hopper (sm90) kernels in Pallas Mosaic GPU, their tilings and the helpers they share.

Importing this package (or `config`) does not load Mosaic GPU; the kernel
modules (`forward`, `forward_fp8`, `backward`) do.
"""
