"""`pallas-fa3 bench`, the performance harness (issue 3), one concept per
file and every mode (fwd, bwd, fwd+bwd and `--mode decode`) through the
same files: `specs.py` the named, tagged cases (`BenchSpec`,
`DecodeBenchSpec`) and the default grids; `options.py` a case's window,
softcap, sinks and docs; `flops.py` the one FLOPs model and the K/V bytes
of a decode step; `impls.py` one registry of our backends and the
baselines, each saying which modes it serves and why it cannot serve a
case; `fp8_case.py` the fp8 cases' quantization and attention, timed apart;
`timing.py` the inputs, compile-excluded timing, memory and the device's
peaks; `runner.py` the sweep (cases, records, progress bar, environment
header); `report.py` ratios, CSV, JSON and summary.md; `terminal.py` the
80-column tables; `plots.py` the PNGs; `command.py` the flags, their checks
and the run; `flags.py` the flags' argparse types: docs/benchmarks.md.
"""
