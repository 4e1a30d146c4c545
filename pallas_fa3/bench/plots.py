"""PNG plots made from the records: TFLOPs/s vs sequence length.

One figure per (mode, dtype); one panel per head dim x causal; one line per
implementation. matplotlib with the Agg backend (no display needed).
"""

from __future__ import annotations

import collections
import os


def plot(records: list[dict], out_dir: str) -> list[str]:
  """Writes `tflops_<mode>_<dtype>.png` files; returns their paths."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  ok = [r for r in records if r["status"] == "ok" and not r["note"]]
  groups = collections.defaultdict(list)
  for r in ok:
    groups[(r["mode"], r["dtype"])].append(r)
  paths = []
  os.makedirs(out_dir, exist_ok=True)
  for (mode, dtype), rows in sorted(groups.items()):
    dims = sorted({r["head_dim"] for r in rows})
    causals = sorted({r["causal"] for r in rows})
    fig, axes = plt.subplots(len(causals), len(dims), squeeze=False,
                             figsize=(4.5 * len(dims), 3.5 * len(causals)))
    for i, causal in enumerate(causals):
      for j, d in enumerate(dims):
        ax = axes[i][j]
        lines = collections.defaultdict(list)
        for r in rows:
          if r["head_dim"] == d and r["causal"] == causal:
            lines[r["impl"]].append((r["seq_q"], r["tflops"]))
        for impl, pts in sorted(lines.items()):
          pts.sort()
          ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=impl)
        ax.set_xscale("log", base=2)
        seqs = sorted({p[0] for pts in lines.values() for p in pts})
        ax.set_xticks(seqs, [str(n) for n in seqs])
        ax.minorticks_off()
        ax.set_title(f"d={d}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOPs/s")
        ax.grid(True, alpha=0.3)
        if lines:
          ax.legend(fontsize="small")
    fig.suptitle(f"{mode} {dtype}")
    fig.tight_layout()
    path = os.path.join(out_dir, f"tflops_{mode.replace('+', '_')}_{dtype}.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
  return paths
