"""Benchmark cases as data, every mode's: `BenchSpec` (fwd, bwd, fwd+bwd;
the GPU grid is the FA3 paper's, Shah et al. 2024 section 4.1, the CPU grid
a small copy of it that finishes in about a minute on two cores) and
`DecodeBenchSpec` (`--mode decode`: one generation step, one new query per
sequence over a contiguous or paged KV cache), their axes (`GridAxes`,
`DecodeAxes`; a grid is a union of groups, each a product of axes), the
default grids and `make_grid`: docs/benchmarks.md#the-code.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence

import jax.numpy as jnp

from pallas_fa3.spec import cdiv
from pallas_fa3.tools.bench import flops
from pallas_fa3.tools.bench.options import (
  Window,
  check_modifiers,
  format_window,
  modifier_names,
)

# The attention modes; decode is a grid of its own (`DecodeBenchSpec`).
MODES: tuple[str, ...] = ("fwd", "bwd", "fwd+bwd")
DECODE = "decode"
# Short names used on the command line -> the inputs' JAX dtype. fp8 cases
# take bf16 inputs and quantize them to e4m3 (bench/fp8_case.py); decode's
# are bf16 queries over an e4m3 cache with FA3's per-(sequence, KV head)
# descales (`pallas_fa3.quantize_kv_cache`). fp32 is accepted for CPU runs.
DTYPES: dict[str, str] = {
  "bf16": "bfloat16",
  "fp16": "float16",
  "fp32": "float32",
  "fp8": "bfloat16",
}

# Head dims are at most 256: the library's limit, on every backend.
MAX_HEAD_DIM = 256
# DeepSeek MLA's latent cache (`--mla`): 512 value columns + 64 RoPE ones.
MLA_HEAD_DIM, MLA_HEAD_DIM_V = 576, 512

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

# Flex decode cases (`DecodeBenchSpec.flex`, `options.decode_flex`): ALiBi
# as a score_mod with a document mask_mod (perfcmp's "alibi_doc").
DECODE_FLEX = ("alibi_doc",)
# Documents of the alibi_doc case: this many tokens each.
DECODE_DOC_TOKENS = 512

# The decode points the issue sets targets for (issue 29); `--tags headline`
# selects them (benchmarks/device_check.sh does).
HEADLINE_TAG = "headline"


@dataclasses.dataclass(frozen=True)
class BenchSpec:
  """One benchmark shape of the attention modes.

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

  Example:
    >>> s = BenchSpec("x", 1, 4, 4, 1, 1, 8, True, "bf16", "fwd")
    >>> s.flops  # 10 unmasked pairs * 4 * d
    320
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

  @property
  def flops(self) -> int:
    return flops.attention_flops(self, self.head_dim_v)


@dataclasses.dataclass(frozen=True)
class DecodeBenchSpec:
  """One decode case (`--mode decode`).

  Attributes:
    name: unique, human-readable identifier.
    batch, cache_len, heads_q, heads_kv, head_dim: q `[batch, seq_q,
      heads_q, head_dim]`; each sequence's cache holds `cache_len` tokens
      of `heads_kv` heads (head_dim for K and V).
    dtype: a key of `DTYPES`; "fp8" is bf16 queries over an e4m3 cache.
    page_size: tokens per page of a paged cache; None: contiguous.
    num_splits: split-KV ranges per sequence; None: each backend's choice.
    ragged: sequence b holds `cache_len - (cache_len // 2) * b // batch`
      tokens (cache_len down to about half of it); else all `cache_len`.
    tags: free labels for selection (`--tags`) and reports.
    mla: DeepSeek MLA's one latent cache (`v_cache=None`): head_dim 576,
      V its first `MLA_HEAD_DIM_V` columns, read in place.
    seq_q: new query tokens per sequence (1: a plain step; 2-16:
      speculative / multi-token decoding), the last `seq_q` of its cache,
      causal among themselves.
    batch_invariant: `flash_attention_with_kvcache(batch_invariant=True)`
      (ours only): split-KV ranges fixed in keys.
    flex: a flex decode case of `DECODE_FLEX` (ours only): "alibi_doc",
      ALiBi as a score_mod and 512-token documents as a mask_mod.
  """

  name: str
  batch: int
  cache_len: int
  heads_q: int
  heads_kv: int
  head_dim: int
  dtype: str
  page_size: int | None = None
  num_splits: int | None = None
  ragged: bool = False
  tags: tuple[str, ...] = ()
  mla: bool = False
  seq_q: int = 1
  batch_invariant: bool = False
  flex: str | None = None
  # The new tokens sit at the end of their cache, causal among themselves.
  causal: bool = dataclasses.field(default=True, init=False)
  mode: str = dataclasses.field(default=DECODE, init=False)

  def __post_init__(self):
    where = f"DecodeBenchSpec {self.name!r}: "
    fields = ("batch", "cache_len", "heads_q", "heads_kv", "head_dim", "seq_q")
    optional = ("page_size", "num_splits")
    for field in fields + optional:
      value = getattr(self, field)
      if value is None and field in optional:
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
          f"{where}{field} must be a positive int; got {value!r}"
        )
    if self.heads_q % self.heads_kv:
      raise ValueError(
        f"{where}heads_q ({self.heads_q}) must be a multiple of heads_kv"
        f" ({self.heads_kv})"
      )
    if self.seq_q > self.cache_len:
      raise ValueError(
        f"{where}seq_q ({self.seq_q}) must be at most cache_len"
        f" ({self.cache_len}): the new tokens are the cache's last ones"
      )
    if self.flex not in (None,) + DECODE_FLEX:
      raise ValueError(
        f"{where}flex {self.flex!r} is not one of {DECODE_FLEX} (or None)"
      )
    if self.mla and self.head_dim != MLA_HEAD_DIM:
      raise ValueError(
        f"{where}an MLA case has head_dim {MLA_HEAD_DIM}; got {self.head_dim}"
      )
    if self.head_dim > MAX_HEAD_DIM and not self.mla:
      raise ValueError(
        f"{where}head_dim {self.head_dim} is over {MAX_HEAD_DIM}"
      )
    if self.dtype not in DTYPES:
      raise ValueError(f"{where}dtype {self.dtype!r} not in {tuple(DTYPES)}")

  @property
  def gqa(self) -> int:
    """Query heads per key/value head."""
    return self.heads_q // self.heads_kv

  @property
  def head_dim_v(self) -> int:
    return MLA_HEAD_DIM_V if self.mla else self.head_dim

  @property
  def jax_dtype(self) -> str:
    """The JAX dtype name of q (and of the cache but for fp8's e4m3)."""
    return DTYPES[self.dtype]

  @property
  def correctness_only(self) -> bool:
    return TINY_TAG in self.tags

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.jax_dtype).itemsize

  @property
  def fp8_cache(self) -> bool:
    return self.dtype == "fp8"

  @property
  def cache_itemsize(self) -> int:
    """Bytes per cached value (1 for the e4m3 cache)."""
    return 1 if self.fp8_cache else self.itemsize

  @property
  def paged(self) -> bool:
    return self.page_size is not None

  @property
  def pages_per_seq(self) -> int:
    """Pages of each sequence's table (0: contiguous)."""
    return cdiv(self.cache_len, self.page_size) if self.paged else 0

  @property
  def lengths(self) -> tuple[int, ...]:
    """Tokens in each sequence's cache."""
    if not self.ragged:
      return (self.cache_len,) * self.batch
    half = self.cache_len // 2
    return tuple(
      self.cache_len - half * b // self.batch for b in range(self.batch)
    )

  @property
  def kv_bytes(self) -> int:
    return flops.decode_kv_bytes(self)

  @property
  def flops(self) -> int:
    return flops.decode_flops(self)

  @property
  def shape_key(self) -> tuple:
    """Everything but the split count: cases an implementation that does
    not split computes alike."""
    return (
      self.dtype,
      self.batch,
      self.cache_len,
      self.seq_q,
      self.batch_invariant,
      self.flex,
      self.heads_q,
      self.heads_kv,
      self.head_dim,
      self.page_size,
      self.ragged,
    )

  @property
  def splits_label(self) -> str:
    """ "auto" or the requested count."""
    return "auto" if self.num_splits is None else str(self.num_splits)


def spec_name(
  mode,
  dtype,
  batch,
  heads_q,
  heads_kv,
  head_dim,
  *,
  seq_q=None,
  seq_kv=None,
  causal=False,
  window=None,
  softcap=None,
  sinks=False,
  docs=None,
  head_dim_v=None,
  cache_len=None,
  page_size=None,
  num_splits=None,
  ragged=False,
  batch_invariant=False,
  flex=None,
) -> str:
  """A case's name, "<mode>-<dtype>-b<batch>-<length>-h<hq>x<hk>-<dims>-
  <the rest>": e.g. "fwd-bf16-b4-s512-h2x2-d64-causal-win256_0-softcap30-
  sinks-docs4" ("-d192-dv128-" where head_dim_v differs from head_dim) and
  "decode-bf16-b64-L8192-h32x8-d128-page64-splits_auto-ragged" ("-L8192-
  q4-" with 4 new query tokens)."""
  dims = f"d{head_dim}" + (
    "" if head_dim_v in (None, head_dim) else f"-dv{head_dim_v}"
  )
  if mode == DECODE:
    length = f"L{cache_len}" + (f"-q{seq_q}" if (seq_q or 1) > 1 else "")
    rest = (
      ("contiguous" if page_size is None else f"page{page_size}")
      + f"-splits_{'auto' if num_splits is None else num_splits}"
      + ("-ragged" if ragged else "")
      + ("-invariant" if batch_invariant else "")
      + (f"-{flex}" if flex else "")
    )
  else:
    length = f"s{seq_q}" if seq_q == seq_kv else f"s{seq_q}x{seq_kv}"
    win = format_window(window)
    rest = (
      ("causal" if causal else "full")
      + ("" if win is None else f"-win{win.replace(',', '_')}")
      + ("" if softcap is None else f"-softcap{softcap:g}")
      + ("-sinks" if sinks else "")
      + ("" if docs is None else f"-docs{docs}")
    )
  return f"{mode}-{dtype}-b{batch}-{length}-h{heads_q}x{heads_kv}-{dims}-{rest}"


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


def _query_heads(hidden: int, head_dim: int, gqa: int) -> int:
  """hidden // head_dim, as in the FA3 paper; ValueError naming --gqa
  unless the GQA ratio divides it."""
  heads_q = hidden // head_dim
  if heads_q % gqa:
    raise ValueError(
      f"--gqa {gqa} does not divide {heads_q} query heads (head dim"
      f" {head_dim}, --hidden {hidden})"
    )
  return heads_q


@dataclasses.dataclass(frozen=True)
class GridAxes:
  """The axes of a grid of the attention modes; every combination becomes
  one `BenchSpec`.

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

  def expand(self) -> list[BenchSpec]:
    """Every combination, in a stable order (mode, dtype, d, dv, causal,
    gqa, seq)."""
    check_head_dims(self.head_dims, self.hidden, self.head_dims_v or ())
    check_modifiers(self.window, self.softcap, self.sinks, docs=self.docs)
    if self.docs is not None and self.docs > min(self.seqs):
      raise ValueError(
        f"--docs {self.docs} is over --seq {min(self.seqs)}: every sequence"
        " needs at least one position per document"
      )
    mods = dict(
      window=self.window, softcap=self.softcap, sinks=self.sinks, docs=self.docs
    )
    specs = []
    for mode, dtype, d, dv, causal, gqa, seq in itertools.product(
      self.modes,
      self.dtypes,
      self.head_dims,
      self.head_dims_v or (None,),  # None: dv = d
      self.causals,
      self.gqa,
      self.seqs,
    ):
      heads_q = _query_heads(self.hidden, d, gqa)
      dv = d if dv is None else dv
      tags = (
        self.tags
        + (f"d{d}",)
        + (() if dv == d else (f"dv{dv}",))
        + ("causal" if causal else "full", mode, dtype)
        + (("gqa",) if gqa > 1 else ())
        + modifier_names(**mods)
      )
      fields = dict(
        mode=mode,
        dtype=dtype,
        batch=max(1, self.tokens // seq),
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


@dataclasses.dataclass(frozen=True)
class DecodeAxes:
  """One group of a decode grid: every combination is a `DecodeBenchSpec`.

  `hidden // head_dim` gives the query heads (as `--hidden` does for the
  other modes), `gqa` ratios divide them; None in `page_sizes` is a
  contiguous cache, in `num_splits` the backend's own choice; `q_lens`:
  new query tokens per sequence (more than 1: speculative decoding, tagged
  "speculative" and "q<n>").
  """

  batches: tuple[int, ...]
  cache_lens: tuple[int, ...]
  hidden: int
  head_dims: tuple[int, ...]
  gqa: tuple[int, ...] = (4,)
  page_sizes: tuple[int | None, ...] = (None,)
  num_splits: tuple[int | None, ...] = (None,)
  dtypes: tuple[str, ...] = ("bf16",)
  ragged: bool = False
  tags: tuple[str, ...] = ()
  mla: bool = False  # MLA cases: one KV head, `gqa` query heads, d 576
  q_lens: tuple[int, ...] = (1,)
  batch_invariant: bool = False
  flex: str | None = None

  def _q_tags(self, q: int) -> tuple[str, ...]:
    """The q_len's, batch_invariant's and flex's tags not in `tags`."""
    extra = (
      (() if q == 1 else ("speculative", f"q{q}"))
      + (("batch-invariant",) if self.batch_invariant else ())
      + (("flex", self.flex) if self.flex else ())
    )
    return tuple(t for t in extra if t not in self.tags)

  def expand(self) -> list[DecodeBenchSpec]:
    """Every combination, in a stable order (dtype, d, gqa, batch, cache
    length, page size, split count). MLA: head_dims and hidden unused;
    `gqa` is the query heads of the one KV head."""
    if self.mla:
      return self._expand_mla()
    check_head_dims(self.head_dims, self.hidden)
    specs = []
    for dtype, d, gqa, b, n, q, ps, splits in itertools.product(
      self.dtypes,
      self.head_dims,
      self.gqa,
      self.batches,
      self.cache_lens,
      self.q_lens,
      self.page_sizes,
      self.num_splits,
    ):
      heads_q = _query_heads(self.hidden, d, gqa)
      tags = (
        self.tags
        + (
          DECODE,
          dtype,
          f"d{d}",
          f"gqa{gqa}",
          "contiguous" if ps is None else "paged",
          "split-auto" if splits is None else "split-fixed",
        )
        + self._q_tags(q)
      )
      fields = dict(
        dtype=dtype,
        batch=b,
        cache_len=n,
        seq_q=q,
        heads_q=heads_q,
        heads_kv=heads_q // gqa,
        head_dim=d,
        page_size=ps,
        num_splits=splits,
        ragged=self.ragged,
        batch_invariant=self.batch_invariant,
        flex=self.flex,
      )
      specs.append(
        DecodeBenchSpec(
          spec_name(DECODE, **fields),
          tags=tags + (("ragged",) if self.ragged else ()),
          **fields,
        )
      )
    return specs

  def _expand_mla(self) -> list[DecodeBenchSpec]:
    specs = []
    for dtype, hq, b, n, q, ps, splits in itertools.product(
      self.dtypes,
      self.gqa,
      self.batches,
      self.cache_lens,
      self.q_lens,
      self.page_sizes,
      self.num_splits,
    ):
      fields = dict(
        dtype=dtype, batch=b, cache_len=n, seq_q=q, heads_q=hq, heads_kv=1,
        head_dim=MLA_HEAD_DIM, page_size=ps, num_splits=splits,
        ragged=self.ragged, batch_invariant=self.batch_invariant,
        flex=self.flex,
      )  # fmt: skip
      tags = self.tags + (
        DECODE, "mla", dtype, f"h{hq}",
        "contiguous" if ps is None else "paged",
        "split-auto" if splits is None else "split-fixed",
      ) + (("ragged",) if self.ragged else ()) + self._q_tags(q)  # fmt: skip
      name = spec_name(DECODE, head_dim_v=MLA_HEAD_DIM_V, **fields)
      name = name.replace(f"{DECODE}-", f"{DECODE}-mla-", 1)
      specs.append(DecodeBenchSpec(name, tags=tags, mla=True, **fields))
    return specs


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
# The decode GPU grid (issue 29): 32 query / 8 KV heads at d128 (hidden
# 4096, GQA group 4): the targets' points (batch 64 x 8k, contiguous and
# page 64; batch 1 x 128k, split-KV by each backend's choice), page 256,
# fixed split counts at 128k, batch 8 x 32k with GQA groups 1/4/8 and paged.
_GPU = dict(hidden=4096, head_dims=(128,))
SPECULATIVE_Q_LENS = (1, 4, 8, 16)
# The issue-67 rows `benchmarks/device_check.sh`'s decode_modes step runs:
# q_len 1, 4, 8, 16, batch-invariant and flex decode.
DECODE_MODES_TAG = "decode-modes"
_MODES = (DECODE_MODES_TAG,)
DECODE_GPU_GRID: tuple[DecodeAxes, ...] = (
  DecodeAxes(
    (64,), (8192,), page_sizes=(None, 64), tags=(HEADLINE_TAG,), **_GPU
  ),
  DecodeAxes((64,), (8192,), page_sizes=(256,), **_GPU),
  DecodeAxes((1,), (131072,), tags=(HEADLINE_TAG,), **_GPU),
  DecodeAxes((1,), (131072,), num_splits=(1, 8, 32, 128), **_GPU),
  DecodeAxes((8,), (32768,), gqa=(1, 4, 8), **_GPU),
  DecodeAxes((8,), (32768,), page_sizes=(256,), **_GPU),
  # Speculative decoding (issue 67): 1, 4, 8, 16 new tokens per sequence
  # at the targets' two points (the same K/V bytes per step).
  DecodeAxes(
    (64,),
    (8192,),
    q_lens=SPECULATIVE_Q_LENS,
    tags=("speculative",) + _MODES,
    **_GPU,
  ),
  DecodeAxes(
    (1,),
    (131072,),
    q_lens=SPECULATIVE_Q_LENS,
    tags=("speculative",) + _MODES,
    **_GPU,
  ),
  # batch_invariant=True at the headline points (its cost: fixed split
  # ranges), and a flex decode (ALiBi + documents, page 64) beside them.
  DecodeAxes((64,), (8192,), batch_invariant=True, tags=_MODES, **_GPU),
  DecodeAxes((1,), (131072,), batch_invariant=True, tags=_MODES, **_GPU),
  DecodeAxes(
    (64,), (8192,), page_sizes=(64,), flex="alibi_doc", tags=_MODES, **_GPU
  ),
)
# The decode CPU grid: about a minute on two cores for blockwise, reference
# and XLA: 8 query / 2 KV heads at d64, batch 4 at 1k/4k/16k contiguous and
# page 64, and batch 1 x 16k by the backend's choice and in 4 splits.
_CPU = dict(hidden=512, head_dims=(64,))
DECODE_CPU_GRID: tuple[DecodeAxes, ...] = (
  DecodeAxes((4,), (1024, 4096, 16384), page_sizes=(None, 64), **_CPU),
  DecodeAxes((1,), (16384,), num_splits=(None, 4), **_CPU),
)


# `--mla` (issue 45): DeepSeek's latent cache, 576 / 512, one KV head. GPU:
# the target's point, batch 64 x 8k, 128 query heads, page 64 (and 16
# heads, batch 32 x 4k); CPU: a few seconds of blockwise and reference.
MLA_GPU_GRID: tuple[DecodeAxes, ...] = (
  DecodeAxes(
    (64,), (8192,), hidden=0, head_dims=(), gqa=(128,), page_sizes=(64,),
    mla=True, tags=(HEADLINE_TAG,),
  ),
  DecodeAxes(
    (32,), (4096,), hidden=0, head_dims=(), gqa=(16,), page_sizes=(64, None),
    mla=True,
  ),
)  # fmt: skip
MLA_CPU_GRID: tuple[DecodeAxes, ...] = (
  DecodeAxes(
    (2,), (1024,), hidden=0, head_dims=(), gqa=(16,), page_sizes=(64, None),
    mla=True,
  ),
)  # fmt: skip


def make_grid(
  groups: GridAxes | DecodeAxes | Sequence[GridAxes | DecodeAxes],
  tags: Iterable[str] = (),
) -> list:
  """The specs of one group of axes or of a union of them: each group
  expanded in turn (`expand`), duplicates merged (the first one kept with
  every group's tags), only the specs carrying every one of `tags`.

  Raises:
    ValueError: naming the flag: a head dim over MAX_HEAD_DIM or not
      dividing the hidden size, a value head dim outside 1..MAX_HEAD_DIM, a
      GQA ratio not dividing the number of query heads, a bad window,
      softcap or sinks, or more --docs than a sequence has positions.
  """
  if isinstance(groups, (GridAxes, DecodeAxes)):
    groups = (groups,)
  by_name = {}
  for axes in groups:
    for s in axes.expand():
      first = by_name.setdefault(s.name, s)
      extra = tuple(t for t in s.tags if t not in first.tags)
      if extra:
        by_name[s.name] = dataclasses.replace(first, tags=first.tags + extra)
  return select(by_name.values(), tags)


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


def select(specs: Iterable, tags: Iterable[str] = ()) -> list:
  """The specs carrying every one of `tags`."""
  wanted = set(tags)
  return [s for s in specs if wanted <= set(s.tags)]
