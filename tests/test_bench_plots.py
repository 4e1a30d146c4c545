"""Tests of the benchmark plots' titles: wrapped to the figure's width.

The CPU default sweep makes one panel per figure (4.5 inches wide), and its
one-line title was clipped at both sides; with window, softcap, sinks and
docs in the title it was twice the figure's width.
"""

import pytest

from pallas_fa3.tools.bench import plots

_ENV = {"device": "cpu cpu", "jax": "0.11.2", "cpu_count": 2}


def _records(head_dims, **options):
  """Sweep records (the fields `plots.figures` reads) of two
  implementations at two sequence lengths."""
  return [
    dict(
      status="ok",
      note="",
      mode="fwd+bwd",
      dtype="fp8",
      head_dim=d,
      causal=True,
      seq_q=seq,
      impl=impl,
      flops=1e9,
      tflops=0.5,
      time_min_ms=1.0,
      time_median_ms=1.5,
      time_max_ms=2.0,
      **options,
    )
    for d in head_dims
    for seq in (64, 128)
    for impl in ("blockwise", "reference")
  ]


def _title_and_panels(fig):
  """The suptitle's and the panels' extents, in pixels, as drawn."""
  fig.canvas.draw()
  renderer = fig.canvas.get_renderer()
  title = fig._suptitle.get_window_extent(renderer)  # pylint: disable=protected-access
  return title, [ax.get_tightbbox(renderer) for ax in fig.axes]


@pytest.mark.parametrize(
  "options",
  [{}, dict(window="256,0", softcap=30.0, sinks=True, docs=4)],
  ids=["plain", "every-option"],
)
def test_long_title_fits_the_figure(options):
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  ((name, fig),) = plots.figures(_records([64], **options), _ENV)
  try:
    title, panels = _title_and_panels(fig)
    assert 0 <= title.x0 and title.x1 <= fig.bbox.width, (name, title)
    assert title.y1 <= fig.bbox.height, (name, title)
    # Above the panel, not over it.
    assert all(title.y0 >= p.y1 for p in panels), (name, title, panels)
    text = fig.get_suptitle()
    assert "cpu cpu (2 cores)" in text and "JAX 0.11.2" in text, text
    if options:  # rows break between phrases
      assert "window 256,0, softcap 30, sinks, docs 4:" in " ".join(
        text.split()
      ), text
  finally:
    plt.close(fig)


def test_wide_figure_keeps_two_rows():
  # Wrapped only where needed: three panels hold each line of the title.
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  ((_, fig),) = plots.figures(_records([64, 128, 256]), _ENV)
  try:
    title, _ = _title_and_panels(fig)
    assert title.x1 <= fig.bbox.width
    assert fig.get_suptitle().count("\n") == 1, fig.get_suptitle()
  finally:
    plt.close(fig)
