"""The numerics study toolkit behind `pallas-fa3 numerics <study>`.

Studies (one module each; every one writes a report folder with a JSON of
every figure, a markdown summary with our numbers beside the published ones
of ../shared/NUMERICS.md, and PNG plots):

  deviation   forward deviation against a float64 golden, flash vs baseline,
              by format, sequence length, tile size, head dim and input
              distribution (after Golden et al. 2024, arXiv 2405.02803)
  fp8         the FA3 paper's Table 3 error test (RMSE vs float64)
  divergence  weight divergence of GPT training runs (max |dW| and the 1-D
              Wasserstein-1 distance) and the growth rates of the differences
  bias        the repeated-max rounding bias and the `stable_max` fix
              (Qiu and Yao 2025, arXiv 2510.04212)

Building blocks: `metrics` (deviation statistics, Wasserstein-1, slopes),
`inputs` (the input distributions), `lowprec` (a study-only attention whose
every intermediate is kept in a chosen format, and the float64 golden),
`fp8_methods` (the methods, inputs and tables of the FP8 error test).
"""
