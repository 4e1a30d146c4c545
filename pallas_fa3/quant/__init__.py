"""FP8 math without a kernel: the randomized Hadamard rotation (`hadamard`)
and e4m3 block quantization with the softmax steps the FP8 kernel and its
twin share (`e4m3`). The API is `pallas_fa3.fp8`: docs/fp8.md.
"""
