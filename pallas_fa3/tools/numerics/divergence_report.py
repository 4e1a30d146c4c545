"""The divergence study's report: markdown tables and plots, from the result
of `divergence.run` (samples, slopes, ratios, verdicts):
docs/numerics.md#divergence.
"""

from __future__ import annotations

import numpy as np

from pallas_fa3.tools.numerics import divergence, metrics, report


def markdown(result: dict) -> str:
  cfg = result["config"]
  last = result["samples"][-1]
  lines = report.header_lines(
    "pallas-fa3 numerics divergence",
    result["environment"],
    [
      f"- GPT: {cfg['layers']} layers, d_model {cfg['d_model']},"
      f" {cfg['heads']} heads, {result['num_params']:,} parameters; batch"
      f" {cfg['batch']} x seq {cfg['seq_len']} bytes, {cfg['steps']} steps,"
      f" lr {cfg['lr']}; compared every {cfg['interval']} steps",
      "- max |dW|: largest entry difference over all tensors; W1: 1-D"
      " Wasserstein-1 between each tensor's flattened values, averaged"
      " over tensors weighted by size",
      f"- wall time {result['wall_s']:.0f} s",
    ],
  )
  lines += ["## Runs", ""]
  lines += report.table(
    ["run", "what", "attention backend", "final train bits/byte"],
    [
      [
        r,
        what,
        result["backends"][r],
        float(np.mean(result["train_bpb"][r][-cfg["interval"] :])),
      ]
      for r, what in result["runs"].items()
    ],
  )
  lines += [
    "",
    "## Growth of the difference to R0 (least-squares slope per"
    " step) and its final value",
    "",
  ]
  sl = result["slopes"]
  lines += report.table(
    [
      "run",
      "slope max |dW|",
      "slope W1",
      f"max |dW| at {last['step']}",
      f"W1 at {last['step']}",
    ],
    [
      [r, sl[r]["max_abs"], sl[r]["w1"], last[r]["max_abs"], last[r]["w1"]]
      for r in divergence.COMPARED
    ],
  )
  lines += ["", "## Against the paper (Golden et al. 2024)", ""]
  lines += report.table(
    ["claim", "paper", "ours", "verdict"],
    [
      [v["claim"], v["paper"], v["ours"], v["verdict"]]
      for v in result["verdicts"]
    ],
  )
  lines += [
    "",
    "The same ratios measured other ways: per-tensor median of the"
    " slope ratios, ratio of the curves' means, ratio at the first"
    f" comparison (step {result['samples'][1]['step']}):",
    "",
  ]
  lines += report.table(
    [
      "ratio",
      "slopes (aggregate)",
      "slopes (tensor median)",
      "means",
      "first comparison",
    ],
    [
      [k, v["aggregate"], v["tensor_median"], v["mean"], v["first"]]
      for k, v in result["ratios"].items()
    ],
  )
  lines += [
    "",
    "Any perturbation of the training trajectory (a rounding"
    " difference as much as another seed) is amplified roughly"
    " exponentially at first and then saturates; the slopes fitted"
    " over a whole run weigh the saturated phase, the first"
    " comparison the early one.",
    "",
  ]
  lines += [f"## Per tensor at step {last['step']}", ""]
  names = list(last["R1"]["tensors"])
  lines += report.table(
    ["tensor", "size"]
    + [f"max |dW| {r}" for r in divergence.COMPARED]
    + [f"W1 {r}" for r in divergence.COMPARED],
    [
      [n, last["R1"]["tensors"][n]["size"]]
      + [last[r]["tensors"][n]["max_abs"] for r in divergence.COMPARED]
      + [last[r]["tensors"][n]["w1"] for r in divergence.COMPARED]
      for n in names
    ],
  )
  return "\n".join(lines) + "\n"


def plot(result: dict, out_dir: str) -> list[str]:
  """divergence.png (both metrics vs step, with fitted lines) and loss.png."""
  plt = report.pyplot()
  steps = np.array([s["step"] for s in result["samples"]])
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, m, label in zip(
    axes, divergence.METRICS, ("max |W - W_R0|", "Wasserstein-1 to R0")
  ):
    for i, r in enumerate(divergence.COMPARED):
      ys = [s[r][m] for s in result["samples"]]
      slope, icpt = metrics.fit_line(steps, ys)
      ax.plot(
        steps,
        ys,
        "o",
        ms=3,
        color=f"C{i}",
        label=f"{r}: {result['runs'][r][:38]}",
      )
      ax.plot(steps, icpt + slope * steps, "-", color=f"C{i}", alpha=0.5)
    ax.set(xlabel="step", ylabel=label, yscale="log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small")
  fig.suptitle("weight divergence from R0 (lines: least-squares fits)")
  paths = [report.save_figure(fig, out_dir, "divergence.png")]
  fig, ax = plt.subplots(figsize=(6, 4))
  for r, ys in result["train_bpb"].items():
    ax.plot(np.arange(1, len(ys) + 1), ys, lw=0.8, label=r)
  ax.set(xlabel="step", ylabel="train bits/byte", title="training loss")
  ax.grid(True, alpha=0.3)
  ax.legend()
  paths.append(report.save_figure(fig, out_dir, "loss.png"))
  return paths
