"""`pallas-fa3 bench`: the performance harness (issue 3).

Roles, one file each:
  specs.py     named, tagged benchmark shapes and the default grids (data).
  options.py   window, softcap and sinks of a case: checks, labels, sinks.
  flops.py     the one FLOPs model (causal, windows: exact visible pairs).
  impls.py     what is benchmarked: our backends and the JAX baselines, each
               turning a spec into a function or saying why it cannot.
  fp8_case.py  fp8 cases: the quantization pass, the FP8 attention and both
               together, timed apart (forward only).
  timing.py    compile-excluded timing, compiled/peak memory, matmul peak.
  runner.py    the sweep: cases, progress bar, records, environment header.
  report.py    ratios, CSV, JSON, markdown summary (wide tables).
  terminal.py  the terminal summary: tables that fit 80 columns.
  plots.py     TFLOPs/s vs sequence length PNGs, made from the records.
  command.py   `pallas-fa3 bench`: parsed flags -> grid -> sweep -> files.

Example:
  >>> from pallas_fa3.bench import flops, specs
  >>> s = specs.BenchSpec("x", 1, 4, 4, 1, 1, 8, True, "bf16", "fwd")
  >>> flops.attention_flops(s)  # 10 unmasked pairs * 4 * d
  320
"""
