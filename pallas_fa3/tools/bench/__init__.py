"""`pallas-fa3 bench`: the performance harness (issue 3).

Roles, one file each:
  specs.py     named, tagged benchmark shapes and the default grids (data),
               decode's too.
  options.py   window, softcap and sinks of a case: checks, labels, sinks.
  flops.py     the one FLOPs model (causal, windows: exact visible pairs)
               and the K/V bytes of a decode step.
  impls.py     what is benchmarked, in one registry: our backends and the
               JAX baselines (decode's Triton ops too), each saying which
               modes it serves, turning a spec into a function or saying
               why it cannot.
  fp8_case.py  fp8 cases: the quantization pass, the FP8 attention and both
               together, timed apart (forward only).
  timing.py    the inputs, compile-excluded timing, compiled/peak memory,
               matmul peak, HBM peaks by device kind.
  runner.py    the sweep, every mode's: cases, progress bar, records,
               environment header (decode: GB/s, % of the HBM peak).
  report.py    ratios, CSV, JSON, markdown summary (wide tables), every
               mode's.
  terminal.py  the terminal summary: tables that fit 80 columns, every
               mode's.
  plots.py     TFLOPs/s vs sequence length PNGs (decode: GB/s vs cache
               length), made from the records.
  command.py   `pallas-fa3 bench`: parsed flags -> grid -> sweep -> files.
  flags.py     the flags' argparse types (usage errors naming the flag).
Decoding (`--mode decode`, one generation step over a KV cache):
  decode_command.py  its flags, their checks, the run.

Example:
  >>> from pallas_fa3.tools.bench import flops, specs
  >>> s = specs.BenchSpec("x", 1, 4, 4, 1, 1, 8, True, "bf16", "fwd")
  >>> flops.attention_flops(s)  # 10 unmasked pairs * 4 * d
  320
"""
