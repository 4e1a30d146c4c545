"""The numerics study toolkit behind `pallas-fa3 numerics <study>`: one module
per study (`deviation`, forward deviation against a float64 golden after
Golden et al. 2024; `fp8`, the FA3 paper's Table 3 error test;
`divergence`, weight divergence of GPT training runs; `bias`, the
repeated-max rounding bias and the `stable_max` fix), each writing a report
folder with our numbers beside the published ones, and their building
blocks: `metrics`, `inputs`, `lowprec` (the study-only low-precision
attention and the float64 golden) and `fp8_methods`:
docs/numerics.md#the-studies.
"""
