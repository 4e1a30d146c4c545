"""`causal` beside segment ids whose documents have fewer queries than keys
(FA3's varlen call with cu_seqlens_q != cu_seqlens_k, written as ids): the
diagonal is the whole row's, not each document's, and the per-document
`mask_mod` docs/api.md#causal-across-packed-documents gives FA3's
per-sequence answer. Both claims of that section, checked against float64
attention with the rule written out as a dense mask."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3

# Per batch row, each document's (new queries, keys): a chunk of queries
# against its document's whole context, as a varlen prefill step packs them.
DOCS = (((3, 11), (7, 9), (2, 12)), ((6, 6), (5, 14)))
SEQ_Q, SEQ_KV = 20, 36  # the packs, padded
HEADS, DIM = 2, 16


def _ids(side: int, length: int, pad: int) -> np.ndarray:
  ids = np.full((len(DOCS), length), pad, np.int32)
  for b, docs in enumerate(DOCS):
    lengths = [doc[side] for doc in docs]
    ids[b, : sum(lengths)] = np.repeat(np.arange(len(docs)), lengths)
  return ids


Q_IDS, KV_IDS = _ids(0, SEQ_Q, -1), _ids(1, SEQ_KV, -2)


def _row_wide() -> np.ndarray:
  """What the docs say `causal=True` with ids computes: ids equal and
  `j <= i + seq_kv - seq_q` over the whole row."""
  i, j = np.arange(SEQ_Q)[:, None], np.arange(SEQ_KV)[None, :]
  same = Q_IDS[:, :, None] == KV_IDS[:, None, :]
  return same & (j <= i + SEQ_KV - SEQ_Q)[None]


def _per_document() -> np.ndarray:
  """FA3 varlen's causal: bottom-right within each document, query t of a
  document of (n_q, n_kv) sees its key s iff `s <= t + n_kv - n_q`."""
  mask = np.zeros((len(DOCS), SEQ_Q, SEQ_KV), bool)
  for b, docs in enumerate(DOCS):
    q0 = kv0 = 0
    for n_q, n_kv in docs:
      t, s = np.arange(n_q)[:, None], np.arange(n_kv)[None, :]
      mask[b, q0 : q0 + n_q, kv0 : kv0 + n_kv] = s <= t + n_kv - n_q
      q0, kv0 = q0 + n_q, kv0 + n_kv
  return mask


def _attention64(q, k, v, mask):
  """float64 attention over `mask [b, sq, skv]`; a row that sees no key
  gives 0."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(DIM)
  s = np.where(mask[:, None], s, -np.inf)
  top = np.max(s, axis=-1, keepdims=True)
  p = np.exp(s - np.where(np.isfinite(top), top, 0.0))
  total = p.sum(-1, keepdims=True)
  p = np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)
  return np.einsum("bhqk,bkhd->bqhd", p, v)


def _inputs():
  rng = np.random.default_rng(64)
  shapes = ((len(DOCS), SEQ_Q), (len(DOCS), SEQ_KV), (len(DOCS), SEQ_KV))
  return tuple(
    jnp.asarray(rng.standard_normal((*s, HEADS, DIM)), jnp.float32)
    for s in shapes
  )


def _per_document_mask_mod(q_ids, kv_ids):
  """The docs' alternative: each token's count of its document's tokens
  after it; a key is visible iff at least as many follow it as follow the
  query (bottom-right within the document)."""
  q_left = pallas_fa3.segment_positions(q_ids[:, ::-1])[:, ::-1]
  kv_left = pallas_fa3.segment_positions(kv_ids[:, ::-1])[:, ::-1]
  return lambda b, h, i, j: kv_left[b, j] >= q_left[b, i]


def test_the_rules_differ_on_this_pack():
  # Otherwise the two checks below could not tell the rules apart: in
  # every batch row some query sees other keys under the two rules.
  differ = (_row_wide() != _per_document()).any(axis=2)
  assert differ.any(axis=1).all(), differ


@pytest.mark.parametrize("implementation", ["blockwise", "reference"])
def test_causal_with_ids_is_bottom_right_over_the_whole_row(implementation):
  q, k, v = _inputs()
  out = pallas_fa3.flash_attention(
    q,
    k,
    v,
    causal=True,
    segment_ids=pallas_fa3.SegmentIds(Q_IDS, KV_IDS),
    implementation=implementation,
  )
  np.testing.assert_allclose(
    out, _attention64(q, k, v, _row_wide()), atol=2e-5, rtol=0
  )
  # ... and not FA3 varlen's answer (off by O(1), not by rounding).
  assert np.abs(out - _attention64(q, k, v, _per_document())).max() > 0.1


@pytest.mark.parametrize("implementation", ["blockwise", "reference"])
def test_the_per_document_mask_mod_gives_the_per_sequence_result(
  implementation,
):
  q, k, v = _inputs()
  q_ids, kv_ids = jnp.asarray(Q_IDS), jnp.asarray(KV_IDS)
  out = pallas_fa3.flash_attention(
    q,
    k,
    v,
    segment_ids=pallas_fa3.SegmentIds(q_ids, kv_ids),
    mask_mod=_per_document_mask_mod(q_ids, kv_ids),
    implementation=implementation,
  )
  expected = _attention64(q, k, v, _per_document())
  np.testing.assert_allclose(out, expected, atol=2e-5, rtol=0)
  # The other alternative: each document as its own causal call.
  q0 = kv0 = 0
  for n_q, n_kv in DOCS[0]:
    alone = pallas_fa3.flash_attention(
      q[:1, q0 : q0 + n_q],
      k[:1, kv0 : kv0 + n_kv],
      v[:1, kv0 : kv0 + n_kv],
      causal=True,
      implementation=implementation,
    )
    np.testing.assert_allclose(out[:1, q0 : q0 + n_q], alone, atol=2e-5, rtol=0)
    q0, kv0 = q0 + n_q, kv0 + n_kv
