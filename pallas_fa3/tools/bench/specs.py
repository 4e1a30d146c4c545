"""Benchmark shapes as data: one frozen spec per case, and the default grids.

The GPU grid is the FlashAttention-3 paper's (Shah et al. 2024, section 4.1):
batch x seq = 16k tokens, hidden 2048, so 32/16/8 query heads for head dims
64/128/256, seq 512..16k, causal and not. The CPU grid is a small copy of it
that finishes in about a minute on two cores.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence

from pallas_fa3.spec import cdiv
from pallas_fa3.tools.bench.options import (
  Window,
  check_modifiers,
  format_window,
  modifier_names,
)

MODES: tuple[str, ...] = ("fwd", "bwd", "fwd+bwd")
# Short names used on the command line -> the inputs' JAX dtype. fp8 cases
# take bf16 inputs and quantize them to e4m3 (bench/fp8_case.py); fp32 is
# accepted for CPU runs.
DTYPES: dict[str, str] = {
  "bf16": "bfloat16",
  "fp16": "float16",
  "fp32": "float32",
  "fp8": "bfloat16",
}

# Head dims are at most 256: the library's limit, on every backend.
MAX_HEAD_DIM = 256

# FA3 paper benchmark grid (section 4.1 / NUMERICS.md "Performance anchors").
PAPER_TOKENS = 16 * 1024
PAPER_HIDDEN = 2048
PAPER_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
PAPER_SEQS: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)

# CPU default: about half a minute on 2 idle cores, so that it stays near
# the promised minute on a busy machine: one head dim, a short and a long
# sequence (XLA ahead at 512, blockwise at 2048), causal and not, forward
# and forward+backward; 8 shapes x (blockwise, reference, xla) + interpret.
CPU_TOKENS = 2048
CPU_HIDDEN = 128
CPU_HEAD_DIMS: tuple[int, ...] = (64,)
CPU_SEQS: tuple[int, ...] = (512, 2048)
CPU_MODES: tuple[str, ...] = ("fwd", "fwd+bwd")

# The one tiny case run by the interpret backend: correctness only, batch 1
# and two key/value heads, at a grid point's sequence length and head dim if
# that sequence is at most TINY_MAX_SEQ (interpret mode emulates the kernel's
# every thread on the CPU: about 1 s a call at seq 512).
TINY_TAG = "correctness-only"
TINY_MAX_SEQ = 512


@dataclasses.dataclass(frozen=True)
class BenchSpec:
  """One benchmark shape.

  Attributes:
    name: unique, human-readable identifier (also used in files).
    batch, seq_q, seq_kv, heads_q, heads_kv, head_dim: q `[batch, seq_q,
      heads_q, head_dim]`, k `[batch, seq_kv, heads_kv, head_dim]`.
    causal: bottom-right aligned causal mask.
    dtype: a key of `DTYPES` ("bf16", "fp16", "fp32", "fp8").
    mode: "fwd", "bwd" (the backward pass alone) or "fwd+bwd".
    tags: free labels for selection and reports.
    window: `flash_attention`'s `window_size`, `(left, right)` with each
      side a non-negative int or None (unbounded); None: no window.
    softcap: `flash_attention`'s `softcap` (a positive float) or None.
    sinks: pass per-head sinks (`options.sinks_for`: random, fixed seed).
    docs: pack every sequence with this many documents (`segment_ids=`,
      `options.segment_ids_for`), at most min(seq_q, seq_kv); None: one.
    head_dim_v: v `[batch, seq_kv, heads_kv, head_dim_v]` (and the output);
      None (the default) becomes head_dim.
  """

  name: str
  batch: int
  seq_q: int
  seq_kv: int
  heads_q: int
  heads_kv: int
  head_dim: int
  causal: bool
  dtype: str
  mode: str
  tags: tuple[str, ...] = ()
  window: Window | None = None
  softcap: float | None = None
  sinks: bool = False
  docs: int | None = None
  head_dim_v: int | None = None

  def __post_init__(self):
    if self.head_dim_v is None:
      object.__setattr__(self, "head_dim_v", self.head_dim)
    for field in (
      "batch",
      "seq_q",
      "seq_kv",
      "heads_q",
      "heads_kv",
      "head_dim",
      "head_dim_v",
    ):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 1:
        raise ValueError(
          f"BenchSpec {self.name!r}: {field} must be a positive"
          f" int; got {value!r}"
        )
    if self.heads_q % self.heads_kv:
      raise ValueError(
        f"BenchSpec {self.name!r}: heads_q ({self.heads_q})"
        f" must be a multiple of heads_kv ({self.heads_kv})"
      )
    if self.dtype not in DTYPES:
      raise ValueError(
        f"BenchSpec {self.name!r}: dtype {self.dtype!r} not in {tuple(DTYPES)}"
      )
    if self.mode not in MODES:
      raise ValueError(
        f"BenchSpec {self.name!r}: mode {self.mode!r} not in {MODES}"
      )
    where = f"BenchSpec {self.name!r}: "
    check_modifiers(self.window, self.softcap, self.sinks, where, self.docs)
    if self.docs is not None and self.docs > min(self.seq_q, self.seq_kv):
      raise ValueError(
        f"{where}docs must be at most min(seq_q, seq_kv) ="
        f" {min(self.seq_q, self.seq_kv)}; got {self.docs}"
      )

  @property
  def gqa(self) -> int:
    """Query heads per key/value head."""
    return self.heads_q // self.heads_kv

  @property
  def jax_dtype(self) -> str:
    """The JAX dtype name of the inputs (fp8: bf16, quantized when timed)."""
    return DTYPES[self.dtype]

  @property
  def correctness_only(self) -> bool:
    return TINY_TAG in self.tags

  @property
  def modifiers(self) -> tuple[str, ...]:
    """The `flash_attention` options this case sets beyond causal."""
    return modifier_names(self.window, self.softcap, self.sinks, self.docs)


@dataclasses.dataclass(frozen=True)
class GridAxes:
  """The axes of a grid; every combination becomes one `BenchSpec`.

  `tokens // seq` gives the batch (at least 1) and `hidden // head_dim` the
  query heads, as in the FA3 paper; `gqa` ratios divide the query heads.
  `window`, `softcap`, `sinks` and `docs` are not axes: every spec gets
  them. `head_dims_v`: value head dims, each paired with every head dim;
  None: each spec's equals its head dim.
  """

  tokens: int
  hidden: int
  head_dims: tuple[int, ...]
  seqs: tuple[int, ...]
  causals: tuple[bool, ...] = (False, True)
  dtypes: tuple[str, ...] = ("bf16",)
  modes: tuple[str, ...] = ("fwd",)
  gqa: tuple[int, ...] = (1,)
  tags: tuple[str, ...] = ()
  window: Window | None = None
  softcap: float | None = None
  sinks: bool = False
  docs: int | None = None
  head_dims_v: tuple[int, ...] | None = None


PAPER_AXES = GridAxes(
  PAPER_TOKENS,
  PAPER_HIDDEN,
  PAPER_HEAD_DIMS,
  PAPER_SEQS,
  modes=MODES,
  tags=("paper",),
)
CPU_AXES = GridAxes(
  CPU_TOKENS,
  CPU_HIDDEN,
  CPU_HEAD_DIMS,
  CPU_SEQS,
  modes=CPU_MODES,
  tags=("cpu",),
)


def spec_name(
  mode,
  dtype,
  batch,
  seq_q,
  seq_kv,
  heads_q,
  heads_kv,
  head_dim,
  causal,
  *,
  window=None,
  softcap=None,
  sinks=False,
  docs=None,
  head_dim_v=None,
) -> str:
  """E.g. "fwd-bf16-b4-s512-h2x2-d64-causal-win256_0-softcap30-sinks-docs4";
  "-d192-dv128-" where head_dim_v differs from head_dim."""
  seq = f"s{seq_q}" if seq_q == seq_kv else f"s{seq_q}x{seq_kv}"
  dims = f"d{head_dim}" + (
    "" if head_dim_v in (None, head_dim) else f"-dv{head_dim_v}"
  )
  win = format_window(window)
  extra = (
    ("" if win is None else f"-win{win.replace(',', '_')}")
    + ("" if softcap is None else f"-softcap{softcap:g}")
    + ("-sinks" if sinks else "")
    + ("" if docs is None else f"-docs{docs}")
  )
  return (
    f"{mode}-{dtype}-b{batch}-{seq}-h{heads_q}x{heads_kv}-{dims}-"
    f"{'causal' if causal else 'full'}{extra}"
  )


def check_head_dims(
  head_dims: Iterable[int], hidden: int, head_dims_v: Iterable[int] = ()
) -> None:
  """Raises ValueError (naming the flags) unless every head dim and value
  head dim is in 1..MAX_HEAD_DIM and every head dim divides `hidden`
  (heads_q = hidden // head_dim)."""
  head_dims = tuple(head_dims)
  for flag, dims in (("--head-dim", head_dims), ("--head-dim-v", head_dims_v)):
    for d in dims:
      if d > MAX_HEAD_DIM:
        raise ValueError(
          f"{flag} {d} is over {MAX_HEAD_DIM}: head dims are"
          f" at most {MAX_HEAD_DIM}"
        )
      if d < 1:
        raise ValueError(f"{flag} {d} must be >= 1")
  for d in head_dims:
    if hidden % d:
      lcm = math.lcm(*head_dims)
      fit = cdiv(hidden, lcm) * lcm  # the smallest multiple >= hidden
      dims = " and ".join(map(str, sorted(set(head_dims))))
      raise ValueError(
        f"--head-dim {d} does not divide --hidden {hidden}: pick --hidden"
        f" {fit} (a multiple of {dims}) or head dims that divide {hidden}"
      )


def make_grid(axes: GridAxes) -> list[BenchSpec]:
  """Every combination of `axes`, in a stable order (mode, dtype, d, dv,
  causal, gqa, seq).

  Raises:
    ValueError: a head dim over MAX_HEAD_DIM or not dividing the hidden size,
      a value head dim outside 1..MAX_HEAD_DIM, a GQA ratio not dividing the
      number of query heads, a bad window, softcap or sinks, or more --docs
      than a sequence has positions.
  """
  check_head_dims(axes.head_dims, axes.hidden, axes.head_dims_v or ())
  check_modifiers(axes.window, axes.softcap, axes.sinks, docs=axes.docs)
  if axes.docs is not None and axes.docs > min(axes.seqs):
    raise ValueError(
      f"--docs {axes.docs} is over --seq {min(axes.seqs)}: every sequence"
      " needs at least one position per document"
    )
  mods = dict(
    window=axes.window, softcap=axes.softcap, sinks=axes.sinks, docs=axes.docs
  )
  specs = []
  for mode, dtype, d, dv, causal, gqa, seq in itertools.product(
    axes.modes,
    axes.dtypes,
    axes.head_dims,
    axes.head_dims_v or (None,),  # None: dv = d
    axes.causals,
    axes.gqa,
    axes.seqs,
  ):
    heads_q = axes.hidden // d
    if heads_q % gqa:
      raise ValueError(
        f"--gqa {gqa} does not divide {heads_q} query heads (head dim {d})"
      )
    dv = d if dv is None else dv
    tags = (
      axes.tags
      + (f"d{d}",)
      + (() if dv == d else (f"dv{dv}",))
      + ("causal" if causal else "full", mode, dtype)
      + (("gqa",) if gqa > 1 else ())
      + modifier_names(**mods)
    )
    fields = dict(
      mode=mode,
      dtype=dtype,
      batch=max(1, axes.tokens // seq),
      seq_q=seq,
      seq_kv=seq,
      heads_q=heads_q,
      heads_kv=heads_q // gqa,
      head_dim=d,
      head_dim_v=dv,
      causal=causal,
      **mods,
    )
    specs.append(BenchSpec(spec_name(**fields), tags=tags, **fields))
  return specs


def tiny_spec(
  dtype: str = "bf16",
  *,
  mode: str = "fwd",
  seq: int = 128,
  head_dim: int = 64,
  causal: bool = True,
  gqa: int = 1,
  window: Window | None = None,
  softcap: float | None = None,
  sinks: bool = False,
  docs: int | None = None,
  head_dim_v: int | None = None,
) -> BenchSpec:
  """A small case for the interpret backend (correctness, not speed)."""
  heads_kv = 1 if gqa > 1 else 2
  fields = dict(
    mode=mode,
    dtype=dtype,
    batch=1,
    seq_q=seq,
    seq_kv=seq,
    heads_q=heads_kv * gqa,
    heads_kv=heads_kv,
    head_dim=head_dim,
    head_dim_v=head_dim_v,
    causal=causal,
    window=window,
    softcap=softcap,
    sinks=sinks,
    docs=docs,
  )
  return BenchSpec(spec_name(**fields), tags=(TINY_TAG,), **fields)


def tiny_spec_for(grid: Sequence[BenchSpec]) -> BenchSpec:
  """The interpret backend's case within the grid's filters.

  The cheapest grid point (forward first, then the shortest sequence, the
  smallest head dims, causal before not) at batch 1 and two key/value heads:
  its dtype, mode, mask, sequence, head dims, GQA ratio, window, softcap,
  sinks and docs are the grid's.
  The runner skips it, saying why, when its sequence exceeds TINY_MAX_SEQ.
  """
  s = min(
    grid,
    key=lambda s: (
      MODES.index(s.mode),
      s.seq_q * s.seq_kv,
      s.head_dim,
      s.head_dim_v,
      not s.causal,
      s.gqa,
    ),
  )
  return tiny_spec(
    s.dtype,
    mode=s.mode,
    seq=s.seq_q,
    head_dim=s.head_dim,
    head_dim_v=s.head_dim_v,
    causal=s.causal,
    gqa=s.gqa,
    window=s.window,
    softcap=s.softcap,
    sinks=s.sinks,
    docs=s.docs,
  )


def select(
  specs: Iterable[BenchSpec], tags: Iterable[str] = ()
) -> list[BenchSpec]:
  """The specs carrying every one of `tags`."""
  wanted = set(tags)
  return [s for s in specs if wanted <= set(s.tags)]
