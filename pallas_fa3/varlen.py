"""Variable-length batches on the packed `[total, heads, dim]` layout, FA3's
`flash_attn_varlen_func` (`flash_attention_varlen`): sequences given by
`cu_seqlens` run as one `flash_attention` call of batch 1 whose segment ids
come from `cu_seqlens` on the device (so the kernels visit only the tiles
each sequence touches), with FA3's per-sequence causal and window rule and
per-sequence indices for a score_mod or mask_mod; `explain` says how a call
runs and `shard` splits a packed batch by whole sequences over devices:
docs/varlen.md.

Example:
  >>> import jax, jax.numpy as jnp, pallas_fa3
  >>> q = jax.random.normal(jax.random.key(0), (10, 4, 64))
  >>> cu = jnp.array([0, 3, 10], jnp.int32)
  >>> pallas_fa3.flash_attention_varlen(q, q, q, cu, cu, causal=True).shape
  (10, 4, 64)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import modifiers
from pallas_fa3.cu_seqlens import (
  Packing,
  check_concrete,
  check_index_array,
  check_max_seqlen,
  is_traced,
  packing,
)
from pallas_fa3.spec import check_bool

# flash_attention_varlen's own keywords (`_check`'s), beside fp8.
_OWN = (
  "max_seqlen_q",
  "max_seqlen_k",
  "seqused_q",
  "seqused_k",
  "causal",
  "window_size",
)
# How the per-sequence causal / window rule runs (`explain` says which).
BUILT_IN = "built-in"  # the call's own diagonal: queries and keys aligned
PER_TOKEN = "per-token"  # a mask_mod over each token's tokens-after count


def _same(a: Any, b: Any) -> bool:
  """Whether two index arrays are known to be equal before the call: the
  same object, or equal concrete values (None twice counts)."""
  if a is b:
    return True
  if a is None or b is None or is_traced(a) or is_traced(b):
    return False
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and bool(np.array_equal(a, b))


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["cu_q", "cu_k", "used_q", "used_k"],
  meta_fields=["max_q", "max_k", "causal", "window", "aligned"],
)
@dataclasses.dataclass(frozen=True)
class _Checked:
  """A varlen call's checked index arrays (int32; `used_*` None when
  absent: a pytree's leaves) and canonical static options (its static
  data)."""

  cu_q: jax.Array
  cu_k: jax.Array
  used_q: jax.Array | None
  used_k: jax.Array | None
  max_q: int | None
  max_k: int | None
  causal: bool
  window: tuple | None
  aligned: bool


class _Call(NamedTuple):
  """A varlen call as one packed `flash_attention` call: its operands and
  keywords, the packing, how the per-sequence rule runs (None, BUILT_IN,
  PER_TOKEN)."""

  q: Any
  k: Any
  v: Any
  options: dict
  packing: Packing
  rule: str | None


def _per_sequence_rule(p: Packing, causal: bool, window: tuple | None) -> Any:
  """FA3's bottom-right causal/window rule inside each sequence as a
  mask_mod: with `d = after_k[j] - after_q[i]` (key j sits `-d` past query
  i's diagonal), `causal` is `d >= 0`, a window `(left, right)` is
  `-right <= d <= left`."""
  left, right = (None, None) if window is None else window
  if causal:
    right = 0 if right is None else min(right, 0)
  after_q, after_k = p.after_q[None], p.after_k[None]

  def rule(b, h, i, j):
    del h
    d = after_k[b, j] - after_q[b, i]
    ok = jnp.bool_(True)
    if right is not None:
      ok = ok & (d >= -right)
    if left is not None:
      ok = ok & (d <= left)
    return ok

  return rule


def _in_sequence(p: Packing, score_mod: Any, mask_mod: Any) -> tuple:
  """The user's functions called with the sequence index as `batch` and
  positions inside the sequence as `q_idx` / `kv_idx`."""
  seq, pos_q, pos_k = p.seq_q[None], p.pos_q[None], p.pos_k[None]
  new_score = new_mask = None
  if score_mod is not None:

    def new_score(s, b, h, i, j):
      return score_mod(s, seq[b, i], h, pos_q[b, i], pos_k[b, j])

  if mask_mod is not None:

    def new_mask(b, h, i, j):
      return mask_mod(seq[b, i], h, pos_q[b, i], pos_k[b, j])

  return new_score, new_mask


def _and(first: Any, second: Any) -> Any:
  if first is None or second is None:
    return first or second
  return lambda b, h, i, j: first(b, h, i, j) & second(b, h, i, j)


def _check(
  q: Any,
  k: Any,
  v: Any,
  cu_seqlens_q: Any,
  cu_seqlens_k: Any,
  *,
  max_seqlen_q: Any,
  max_seqlen_k: Any,
  seqused_q: Any,
  seqused_k: Any,
  causal: Any,
  window_size: Any,
  fp8: Any,
) -> _Checked:
  """Every check of a varlen call's own arguments (concrete index arrays
  against their values too). Raises naming the argument and its value or
  shape."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
      raise TypeError(f"{name} must be an array; got {type(x).__name__}")
    if len(x.shape) != 3:
      raise ValueError(
        f"{name} must be [total_{'q' if name == 'q' else 'k'}, heads,"
        f" head_dim]; got shape {tuple(x.shape)}"
      )
  total_q, total_k = int(q.shape[0]), int(k.shape[0])
  if int(v.shape[0]) != total_k:
    raise ValueError(
      f"k and v must have the same total_k; got k.shape={tuple(k.shape)},"
      f" v.shape={tuple(v.shape)}"
    )
  cu_q = check_index_array("cu_seqlens_q", cu_seqlens_q, None)
  n = cu_q.shape[0] - 1
  if n < 1:
    raise ValueError(
      "cu_seqlens_q must have shape [n + 1] with n >= 1 sequences (0, then"
      f" the cumulative lengths); got shape {tuple(cu_q.shape)}"
    )
  cu_k = check_index_array("cu_seqlens_k", cu_seqlens_k, n + 1)
  used_q = used_k = None
  if seqused_q is not None:
    used_q = check_index_array("seqused_q", seqused_q, n)
  if seqused_k is not None:
    used_k = check_index_array("seqused_k", seqused_k, n)
  max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
  max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
  causal = check_bool("causal", causal)
  window = modifiers.check_window_size(
    window_size, seq_q=total_q + 1, seq_kv=total_k + 1, causal=causal
  )
  for side, cu, used, used_raw, total, bound in (
    ("q", cu_seqlens_q, used_q, seqused_q, total_q, max_q),
    ("k", cu_seqlens_k, used_k, seqused_k, total_k, max_k),
  ):
    if not is_traced(cu) and not is_traced(used_raw):
      check_concrete(side, cu, used, total, bound)
  # Queries and keys of every sequence at the same places (self-attention
  # packing): the call's own diagonal (offset 0) is each sequence's.
  aligned = (
    total_q == total_k
    and _same(cu_seqlens_q, cu_seqlens_k)
    and _same(seqused_q, seqused_k)
  )
  masked = causal or window is not None
  if masked and not aligned and fp8 not in (False, None):
    raise NotImplementedError(
      "flash_attention_varlen(fp8=...) with causal or window_size needs"
      " each sequence's queries and keys at the same places (pass the same"
      " cu_seqlens array as cu_seqlens_q and cu_seqlens_k, equal seqused"
      " and total_q == total_k): otherwise the per-sequence rule is a"
      " mask_mod, which no FP8 backend takes"
    )
  return _Checked(
    cu_q, cu_k, used_q, used_k, max_q, max_k, causal, window, aligned
  )


def _packed(
  q: Any,
  k: Any,
  v: Any,
  c: _Checked,
  *,
  score_mod: Any,
  mask_mod: Any,
  **options: Any,
) -> _Call:
  """The checked call written as one packed call of batch 1 (traceable:
  the packing is derived on the device)."""
  p = packing(
    c.cu_q,
    c.cu_k,
    int(q.shape[0]),
    int(k.shape[0]),
    seqused_q=c.used_q,
    seqused_k=c.used_k,
    max_seqlen_q=c.max_q,
    max_seqlen_k=c.max_k,
  )
  rule = None
  if c.causal or c.window is not None:
    rule = BUILT_IN if c.aligned else PER_TOKEN
  new_score, new_mask = _in_sequence(p, score_mod, mask_mod)
  if rule == PER_TOKEN:
    new_mask = _and(_per_sequence_rule(p, c.causal, c.window), new_mask)
  # Unused tokens are zeroed (times 1, or NaN where the traced packing is
  # invalid): NaN/Inf there never meets a zero probability (0 * NaN).
  poison = jnp.where(p.bad, jnp.nan, 1.0)
  clean = lambda x, valid: (
    jnp.where((valid | p.bad)[:, None, None], x, 0) * poison.astype(x.dtype)
  )
  options.update(
    causal=c.causal and rule == BUILT_IN,
    window_size=c.window if rule == BUILT_IN else None,
    segment_ids=p.segment_ids(),
    score_mod=new_score,
    mask_mod=new_mask,
  )
  return _Call(
    clean(jnp.asarray(q), p.valid_q)[None],
    clean(jnp.asarray(k), p.valid_k)[None],
    clean(jnp.asarray(v), p.valid_k)[None],
    options,
    p,
    rule,
  )


def _attend(
  static: tuple, q, k, v, c: _Checked, sinks, block_mask
) -> tuple[jax.Array, jax.Array]:
  """(out, lse) of a checked call; `static`: `_packed`'s static keywords
  as sorted (name, value) pairs."""
  from pallas_fa3.attention import flash_attention  # pylint: disable=g-import-not-at-top

  call = _packed(q, k, v, c, sinks=sinks, block_mask=block_mask, **dict(static))
  valid = call.packing.valid_q
  if call.q.shape[1] and call.k.shape[1]:
    out, lse = flash_attention(
      call.q, call.k, call.v, return_lse=True, **call.options
    )
  else:  # no query or no key at all: every row sees nothing
    hq, dv = call.q.shape[2], call.v.shape[3]
    out = jnp.zeros((1, call.q.shape[1], hq, dv), call.q.dtype)
    lse = jnp.full((1, hq, call.q.shape[1]), -jnp.inf)
    if sinks is not None:
      lse = lse * 0 + jnp.asarray(sinks, jnp.float32)[None, :, None]
  # Unused rows: 0 (their cotangent is dropped here, so a NaN there never
  # reaches a gradient either); an invalid traced packing: NaN everywhere,
  # gradients too.
  poison = jnp.where(call.packing.bad, jnp.nan, 1.0)
  out = jnp.where(valid[:, None, None], out[0], 0) * poison.astype(out.dtype)
  return out, jnp.where(valid[None], lse[0], -jnp.inf) * poison


# Jitted per static options: an eager call compiles once per shapes and
# options (the per-token rule's mask_mod is a new closure every trace).
_attend_jit = jax.jit(_attend, static_argnums=0)


def flash_attention_varlen(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  cu_seqlens_q: jax.Array,
  cu_seqlens_k: jax.Array,
  *,
  max_seqlen_q: int | None = None,
  max_seqlen_k: int | None = None,
  seqused_q: jax.Array | None = None,
  seqused_k: jax.Array | None = None,
  causal: bool = False,
  softmax_scale: float | None = None,
  window_size: tuple[int | None, int | None] | None = None,
  softcap: float | None = None,
  sinks: jax.Array | None = None,
  score_mod: Any = None,
  mask_mod: Any = None,
  block_mask: Any = None,
  return_lse: bool = False,
  deterministic: bool = False,
  fp8: Any = False,
  implementation: Any = None,
  config: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Attention over a batch of variable-length sequences packed without
  padding, FA3's `flash_attn_varlen_func`.

  Sequence s holds the queries `cu_seqlens_q[s] <= t < cu_seqlens_q[s+1]`
  and the keys `cu_seqlens_k[s] <= t < cu_seqlens_k[s+1]` (of those, the
  first `seqused_*[s]` when given) and is its own attention problem: no
  token attends across sequences, `causal` is bottom-right within each
  sequence (query t of a sequence of `n_q` queries and `n_k` keys sees
  its key r iff `r <= t + n_k - n_q`; `n_q != n_k` allowed), and
  `window_size` is each sequence's around that diagonal. A query that
  sees no key gives 0 and lse -inf (the sink with sinks). Tokens past
  `cu_seqlens[-1]` (a padded buffer) or past a sequence's `seqused` get 0
  output and 0 gradient; their values (NaN, Inf) never reach an output
  or a gradient.

  How it runs (`pallas_fa3.varlen.explain` prints it): one
  `flash_attention` call of batch 1 on the packed layout, with the
  sequence index of each token as segment ids derived on the device (the
  kernels visit only the key tiles each query tile's sequences hold).
  The per-sequence causal/window rule is the call's own diagonal when
  queries and keys sit at the same places (the same `cu_seqlens` array,
  or equal concrete ones, as both, the same `seqused`, `total_q ==
  total_k`): no cost beyond segment ids. Otherwise it is a mask_mod over
  each token's count of its sequence's tokens after it, which the
  kernels compile into their tile loops (they then also visit the key
  tiles of a sequence past a query tile's diagonal).

  Args:
    q: `[total_q, heads_q, head_dim]`, float16, bfloat16 or float32.
    k: `[total_k, heads_kv, head_dim]`, `heads_q % heads_kv == 0`.
    v: `[total_k, heads_kv, head_dim_v]`.
    cu_seqlens_q, cu_seqlens_k: int32 `[n + 1]`: 0, then the cumulative
      lengths (device arrays; traced ones compile once for all packings).
    max_seqlen_q, max_seqlen_k: static upper bounds of the lengths, or
      None (FA3's; checked, not needed: the call runs by tiles).
    seqused_q, seqused_k: int32 `[n]`, or None: only the first
      `seqused[s]` tokens of sequence s take part (FA3's).
    causal, softmax_scale, window_size, softcap, sinks, deterministic,
      fp8, implementation, config: as in `pallas_fa3.flash_attention`,
      per sequence.
    score_mod, mask_mod: as in `flash_attention`, called with `batch` =
      the sequence index and `q_idx` / `kv_idx` = positions inside the
      sequence (docs/flex.md).
    block_mask: a `BlockMask` over the packed layout (`batch 1, seq_q =
      total_q, seq_kv = total_k`).
    return_lse: also return the float32 natural-log lse `[heads_q,
      total_q]` (FA3's layout).

  Returns:
    out `[total_q, heads_q, head_dim_v]` in q's dtype; `(out, lse)` with
    `return_lse`.

  Raises:
    TypeError / ValueError naming the argument and its value or shape:
      concrete `cu_seqlens` that do not start at 0, decrease, or end past
      their buffer, `seqused` outside `[0, length]`, a `max_seqlen`
      smaller than a length, `n` not the same across the arrays. Traced
      arrays cannot raise: an invalid traced packing gives NaN outputs
      and gradients, never a silently wrong result.
    NotImplementedError: as `flash_attention`; and `fp8` with causal or
      a window where queries and keys are not aligned (see above).
  """
  checked = _check(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=max_seqlen_q,
    max_seqlen_k=max_seqlen_k,
    seqused_q=seqused_q,
    seqused_k=seqused_k,
    causal=causal,
    window_size=window_size,
    fp8=fp8,
  )
  return_lse = check_bool("return_lse", return_lse)
  static = tuple(
    sorted(
      dict(
        score_mod=score_mod,
        mask_mod=mask_mod,
        softmax_scale=softmax_scale,
        softcap=softcap,
        deterministic=deterministic,
        fp8=fp8,
        implementation=implementation,
        config=config,
      ).items()
    )
  )
  try:
    hash(static)
    run = _attend_jit
  except TypeError:  # an unhashable option: flash_attention says what
    run = _attend
  out, lse = run(static, q, k, v, checked, sinks, block_mask)
  return (out, lse) if return_lse else out


def explain(
  q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, **kwargs: Any
) -> str:
  """What `flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
  **kwargs)` would run, without running it: how the sequences are packed
  and how their causal/window rule runs, then `pallas_fa3.explain` of the
  packed call (backend, kernels, backward form, flex functions). Arrays or
  `jax.ShapeDtypeStruct`s."""
  from pallas_fa3.attention import explain as explain_packed  # pylint: disable=g-import-not-at-top

  kwargs.pop("return_lse", None)
  defaults = dict.fromkeys(_OWN) | dict(
    causal=False, score_mod=None, mask_mod=None, fp8=False
  )
  held = {}

  options = {**defaults, **kwargs}
  own = {n: options.pop(n) for n in (*_OWN, "fp8")}
  fns = {n: options.pop(n) for n in ("score_mod", "mask_mod")}
  arrays = {n: options.pop(n) for n in ("sinks", "block_mask") if n in options}
  index = (cu_seqlens_q, cu_seqlens_k, own["seqused_q"], own["seqused_k"])
  if all(x is None or isinstance(x, jax.Array) for x in index):
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, **own)  # their values too
  same = (cu_seqlens_q is cu_seqlens_k, own["seqused_q"] is own["seqused_k"])

  def trace(q, k, v, index, arrays):
    cu_q, cu_k, used_q, used_k = index
    checked = _check(
      q, k, v, cu_q, cu_q if same[0] else cu_k,
      **own | dict(seqused_q=used_q, seqused_k=used_q if same[1] else used_k),
    )  # fmt: skip
    call = _packed(q, k, v, checked, fp8=own["fp8"], **fns, **options, **arrays)
    held["call"], held["n"] = call, checked.cu_q.shape[0] - 1
    held["plan"] = explain_packed(call.q, call.k, call.v, **call.options)
    return jnp.zeros(())

  abstract = lambda x: (
    jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) if hasattr(x, "dtype") else x
  )
  jax.eval_shape(
    trace,
    *(abstract(x) for x in (q, k, v)),
    jax.tree.map(abstract, index),
    jax.tree.map(abstract, arrays),
  )
  call = held["call"]
  how = {
    None: "none (no causal or window_size)",
    BUILT_IN: "the call's own diagonal (queries and keys aligned)",
    PER_TOKEN: (
      "a mask_mod over each token's count of its sequence's tokens after it"
    ),
  }[call.rule]
  lines = [
    f"varlen: {held['n']} sequences packed as batch 1, {q.shape[0]} query and"
    f" {k.shape[0]} key tokens; segment ids from cu_seqlens on the device"
    " (tiles skipped by sequence)",
    f"per-sequence causal/window: {how}",
  ]
  return "\n".join(lines + [held["plan"]])


def cu_seqlens_of_rows(segment_ids: Any) -> jax.Array:
  """int32 `[batch * seq + 1]`: the `cu_seqlens` of rows of packed
  documents, ids `[batch, seq]` (`pallas_fa3.segment_ids_from_lengths`'s),
  flattened to `[batch * seq]` tokens: a sequence starts where a row
  starts or the id changes. A fixed size (empty sequences at the end), so
  one compilation serves every packing; computed on the device."""
  ids = jnp.asarray(segment_ids)
  if ids.ndim != 2:
    raise ValueError(
      f"segment_ids must be [batch, seq]; got shape {tuple(ids.shape)}"
    )
  b, s = ids.shape
  starts = jnp.ones((b, s), bool).at[:, 1:].set(ids[:, 1:] != ids[:, :-1])
  t = jnp.arange(b * s, dtype=jnp.int32)
  first = jnp.sort(jnp.where(starts.reshape(-1), t, b * s))
  return jnp.append(first, b * s).astype(jnp.int32)


class Shards(NamedTuple):
  """A packed batch split by whole sequences into `shards` pieces of equal
  capacity (`shard`): q `[shards, capacity_q, heads_q, d]`, k and v
  `[shards, capacity_k, heads_kv, d(v)]` (each piece its sequences' tokens,
  then zeros), int32 `cu_seqlens_q` / `cu_seqlens_k` `[shards, m + 1]`
  (each piece's own; empty sequences pad them to m), and `index_q` int32
  `[total_q]`: each query token's row in the flattened pieces (`unshard`),
  `shards * capacity_q` (a zero row) for tokens of no sequence."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  cu_seqlens_q: jax.Array
  cu_seqlens_k: jax.Array
  index_q: jax.Array


def _assign(lq: np.ndarray, lk: np.ndarray, shards: int, caps: tuple) -> list:
  """Sequences per shard: longest-work first onto the least-loaded shard
  with room (work ~ lq * lk + lq + lk), each shard's in their order."""
  work = lq * lk + lq + lk
  load = np.zeros(shards)
  used = np.zeros((shards, 2), np.int64)
  groups = [[] for _ in range(shards)]
  for s in np.argsort(-work, kind="stable"):
    fits = [
      r
      for r in range(shards)
      if caps[0] is None or used[r, 0] + lq[s] <= caps[0]
      if caps[1] is None or used[r, 1] + lk[s] <= caps[1]
    ]
    if not fits:
      raise ValueError(
        f"sequence {s} ({lq[s]} queries, {lk[s]} keys) fits no shard within"
        f" capacity_q={caps[0]}, capacity_k={caps[1]} (shards hold"
        f" {used.tolist()} tokens)"
      )
    r = min(fits, key=lambda r: (load[r], r))
    groups[r].append(int(s))
    load[r] += work[s]
    used[r] += (lq[s], lk[s])
  return [sorted(g) for g in groups]


def shard(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  cu_seqlens_q: Any,
  cu_seqlens_k: Any,
  shards: int,
  *,
  capacity_q: int | None = None,
  capacity_k: int | None = None,
) -> Shards:
  """A packed varlen batch split by whole sequences into `shards` pieces
  for data parallelism: place `Shards.q/k/v/cu_seqlens_*` with their
  leading axis over the data axis, run `flash_attention_varlen` on each
  piece (`jax.shard_map`; docs/varlen.md#sharding), and `unshard` the
  outputs. The split is balanced by work and planned on the host, so
  `cu_seqlens` must be concrete (a data loader's step); pass fixed
  capacities to keep the pieces' shapes (and the compilation) fixed.

  Args:
    q, k, v: the packed layout of `flash_attention_varlen`.
    cu_seqlens_q, cu_seqlens_k: concrete int32 `[n + 1]`.
    shards: the number of pieces (the data axis' size).
    capacity_q, capacity_k: tokens per piece (None: the fullest piece's).

  Returns:
    `Shards` (gathered on the device: differentiable in q, k, v).

  Raises:
    TypeError / ValueError naming the argument: traced or invalid
      `cu_seqlens`, `shards` < 1, a sequence that fits no piece.
  """
  if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
    raise ValueError(f"shards must be an int >= 1; got {shards!r}")
  cus = []
  for name, cu, x in (("cu_seqlens_q", cu_seqlens_q, q), ("cu_seqlens_k", cu_seqlens_k, k)):  # fmt: skip
    if is_traced(cu):
      raise TypeError(
        f"shard plans on the host: {name} must be concrete, not traced"
      )
    check_index_array(name, cu, None if not cus else len(cus[0]))
    cu = np.asarray(cu)
    check_concrete(name[-1], cu, None, int(x.shape[0]), None)
    cus.append(cu.astype(np.int64))
  cu_q, cu_k = cus
  for name, cap in (("capacity_q", capacity_q), ("capacity_k", capacity_k)):
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):  # fmt: skip
      raise ValueError(f"{name} must be an int >= 1 or None; got {cap!r}")
  lq, lk = np.diff(cu_q), np.diff(cu_k)
  groups = _assign(lq, lk, shards, (capacity_q, capacity_k))
  cap_q = capacity_q or max(1, max(int(lq[g].sum()) for g in groups))
  cap_k = capacity_k or max(1, max(int(lk[g].sum()) for g in groups))
  m = max(1, max(len(g) for g in groups))
  total_q, total_k = int(q.shape[0]), int(k.shape[0])
  src_q = np.full((shards, cap_q), total_q, np.int32)  # the zero row
  src_k = np.full((shards, cap_k), total_k, np.int32)
  pieces_cu = np.zeros((2, shards, m + 1), np.int32)
  index_q = np.full(total_q, shards * cap_q, np.int32)
  for r, group in enumerate(groups):
    at = [0, 0]
    for i, s in enumerate(group):
      for side, (cu, src) in enumerate(((cu_q, src_q), (cu_k, src_k))):
        n = int(cu[s + 1] - cu[s])
        src[r, at[side] : at[side] + n] = np.arange(cu[s], cu[s + 1])
        if side == 0:
          index_q[cu[s] : cu[s + 1]] = r * cap_q + at[0] + np.arange(n)
        at[side] += n
        pieces_cu[side, r, i + 1 :] = at[side]
  gather = lambda x, src: jnp.concatenate(
    [jnp.asarray(x), jnp.zeros((1,) + x.shape[1:], x.dtype)]
  )[src]
  return Shards(
    gather(q, src_q),
    gather(k, src_k),
    gather(v, src_k),
    jnp.asarray(pieces_cu[0]),
    jnp.asarray(pieces_cu[1]),
    jnp.asarray(index_q),
  )


def unshard(x: jax.Array, shards: Shards) -> jax.Array:
  """Per-piece outputs `[shards, capacity_q, ...]` back in the packed
  order, `[total_q, ...]` (0 for tokens of no sequence); lse-shaped
  `[shards, heads, capacity_q]` outputs: `unshard(lse.swapaxes(1, 2), s).T`."""
  flat = x.reshape((-1,) + x.shape[2:])
  flat = jnp.concatenate([flat, jnp.zeros((1,) + flat.shape[1:], flat.dtype)])
  return flat[shards.index_q]
