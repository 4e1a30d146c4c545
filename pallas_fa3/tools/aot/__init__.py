"""The deviceless sm_90a compile of the kernels (`pallas-fa3 aot`): what to
compile (`sweeps`, `decode`, `fp8`), how (`compiler`: Mosaic + ptxas on a
CPU, the ptxas report) and the static profile of each kernel's PTX
(`ptx_profile`); `command` is the command. docs/kernels.md#verification-without-a-gpu
"""
