"""Packed training: file boundaries, packed batches, the model's segment ids,
the packed loss, `pallas-fa3 train --packed`."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pallas_fa3
from models import cli as cli_train, data, packing
from models.checkpoint import Checkpointer
from models.gpt import GPT, GPTConfig
from models.step import TrainConfig, build_program, packed_next_byte_loss
from models.train import CHECKPOINT_DIR, METRICS_FILE, SUMMARY_FILE, train
from pallas_fa3.tools import cli

TINY = GPTConfig(
  num_layers=1, d_model=32, num_heads=2, max_seq_len=32, dtype="float32"
)
PACKED = TrainConfig(
  steps=6,
  batch_size=4,
  seq_len=32,
  lr=1e-2,
  warmup_steps=2,
  eval_interval=3,
  eval_batches=2,
  checkpoint_interval=0,
  max_bytes=1 << 16,
  packed=True,
)
_quiet = lambda line: None


def _corpus(train_sizes, val_sizes, seed=0) -> data.ByteCorpus:
  """A corpus of short random files (so that rows hold several)."""
  rng = np.random.default_rng(seed)

  def split(sizes):
    files = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return np.concatenate(files), bounds

  train_bytes, train_bounds = split(train_sizes)
  val_bytes, val_bounds = split(val_sizes)
  return data.ByteCorpus(
    train=train_bytes,
    val=val_bytes,
    train_files=len(train_sizes),
    val_files=len(val_sizes),
    root="synthetic",
    fingerprint="synthetic",
    train_bounds=train_bounds,
    val_bounds=val_bounds,
  )


SYNTHETIC = _corpus([5, 0, 40, 3, 17, 1, 90, 12, 8, 33], [20, 7, 0, 30, 11])


# --- the corpus' file boundaries --------------------------------------------


def test_bounds_are_the_files():
  corpus = data.load_stdlib_corpus(max_bytes=1 << 18)
  root = data.stdlib_root()
  train = [
    f for f in data.stdlib_files() if not data.is_validation_file(f, 0.05)
  ]
  b = corpus.train_bounds
  assert b.dtype == np.int64 and b.shape == (corpus.train_files + 1,)
  assert b[0] == 0 and b[-1] == corpus.train.size and np.all(np.diff(b) >= 0)
  for i in range(3):  # whole files (the cap cuts only the last one)
    text = (root / train[i]).read_bytes()
    assert corpus.train[b[i] : b[i + 1]].tobytes() == text
  assert corpus.val_bounds[-1] == corpus.val.size
  assert "train_bounds" not in corpus.describe()  # summaries unchanged


def test_document_pieces():
  starts, ends = packing.document_pieces(np.array([0, 3, 3, 10]), 4)
  assert starts.tolist() == [0, 3, 7] and ends.tolist() == [3, 7, 10]


def test_loss_mask_counts_targets_within_a_segment():
  ids = np.array([[0, 0, 1, 1, 1, -1, -1]])
  np.testing.assert_array_equal(
    packing.loss_mask(ids), [[True, False, True, True, False, False]]
  )


# --- packed batches -----------------------------------------------------------


def _segments(row_ids):
  """[(start, end)] of the segments of one row."""
  cut = np.flatnonzero(np.diff(row_ids)) + 1
  edges = [0, *cut.tolist(), row_ids.size]
  return list(zip(edges[:-1], edges[1:]))


def test_packed_train_batch_keeps_whole_or_cut_pieces():
  seq_len = 24
  kw = dict(data_seed=3, batch_size=8, seq_len=seq_len)
  batch = packing.packed_train_batch(SYNTHETIC, step=7, **kw)
  for x in batch:
    assert x.shape == (8, seq_len + 1) and x.dtype == np.int32
  starts, ends = packing.document_pieces(SYNTHETIC.train_bounds, seq_len + 1)
  pieces = {SYNTHETIC.train[s:e].tobytes() for s, e in zip(starts, ends)}
  several = 0
  for tokens, ids, positions in zip(*batch):
    segments = _segments(ids)
    several += len(segments) > 1
    assert ids[0] == 0 and np.all(np.diff(ids) >= 0)
    assert np.array_equal(np.unique(ids), np.arange(len(segments)))
    for n, (a, b) in enumerate(segments):
      np.testing.assert_array_equal(positions[a:b], np.arange(b - a))
      got = bytes(tokens[a:b].astype(np.uint8))
      if n + 1 < len(segments):  # whole pieces, then one maybe cut
        assert got in pieces, (n, got)
      else:
        assert any(p.startswith(got) for p in pieces), got
    np.testing.assert_array_equal(
      positions, pallas_fa3.segment_positions(ids[None])[0]
    )
  assert several > 0  # short files share rows
  mask = packing.loss_mask(batch.segment_ids)
  assert mask.shape == (8, seq_len)
  np.testing.assert_array_equal(
    ~mask, batch.segment_ids[:, 1:] != batch.segment_ids[:, :-1]
  )


def test_packed_train_batch_depends_only_on_seed_and_step():
  kw = dict(batch_size=4, seq_len=16)
  a = packing.packed_train_batch(SYNTHETIC, step=5, data_seed=1, **kw)
  same = packing.packed_train_batch(SYNTHETIC, step=5, data_seed=1, **kw)
  for x, y in zip(a, same):
    np.testing.assert_array_equal(x, y)
  for other in (
    packing.packed_train_batch(SYNTHETIC, step=6, data_seed=1, **kw),
    packing.packed_train_batch(SYNTHETIC, step=5, data_seed=2, **kw),
  ):
    assert not np.array_equal(a.tokens, other.tokens)


def test_packed_val_batches_are_the_val_windows_split_at_files():
  kw = dict(num_batches=2, batch_size=3, seq_len=15)
  v = packing.packed_val_batches(SYNTHETIC, **kw)
  np.testing.assert_array_equal(v.tokens, data.val_batches(SYNTHETIC, **kw))
  starts = data.val_window_starts(SYNTHETIC, 6, 15)
  bounds = SYNTHETIC.val_bounds
  for n, (ids, positions) in enumerate(
    zip(v.segment_ids.reshape(6, 16), v.positions.reshape(6, 16))
  ):
    index = starts[n] + np.arange(16)
    doc = np.searchsorted(bounds, index, side="right") - 1
    # A new segment exactly where a new file starts.
    np.testing.assert_array_equal(np.diff(ids) != 0, np.diff(doc) != 0)
    assert ids[0] == 0
    np.testing.assert_array_equal(
      positions, pallas_fa3.segment_positions(ids[None])[0]
    )


def test_packed_batches_refuse_bad_sizes():
  with pytest.raises(ValueError, match="seq_len"):
    packing.packed_train_batch(
      SYNTHETIC, step=0, data_seed=0, batch_size=2, seq_len=0
    )
  empty = dataclasses.replace(SYNTHETIC, train_bounds=np.array([0, 0]))
  with pytest.raises(ValueError, match="no non-empty file"):
    packing.packed_train_batch(
      empty, step=0, data_seed=0, batch_size=2, seq_len=8
    )


# --- the model and the loss ---------------------------------------------------


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_segments_attend_only_within_themselves(rng, position):
  cfg = dataclasses.replace(TINY, position=position)
  model = GPT(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(rng.integers(0, 256, (2, 16)), jnp.int32)
  ids = jnp.asarray([[0] * 6 + [1] * 10, [0] * 16])
  packed = model(tokens, segment_ids=ids)
  np.testing.assert_allclose(
    packed[0, 6:], model(tokens[:1, 6:])[0], rtol=1e-5, atol=1e-5
  )
  np.testing.assert_allclose(
    packed[0, :6], model(tokens[:1, :6])[0], rtol=1e-5, atol=1e-5
  )
  np.testing.assert_allclose(packed[1], model(tokens)[1], rtol=1e-5, atol=1e-5)


def test_model_checks_packing_inputs():
  model = GPT(dataclasses.replace(TINY, position="learned"), rngs=nnx.Rngs(0))
  tokens = jnp.zeros((2, 8), jnp.int32)
  ids = jnp.zeros((2, 8), jnp.int32)
  with pytest.raises(ValueError, match="positions are only taken"):
    model(tokens, positions=ids)
  with pytest.raises(ValueError, match="segment_ids must have the shape"):
    model(tokens, segment_ids=ids[:, :4])
  with pytest.raises(TypeError, match="segment_ids must be integers"):
    model(tokens, segment_ids=ids.astype(jnp.float32))
  with pytest.raises(ValueError, match="max_seq_len"):
    model(tokens, segment_ids=ids, positions=ids + 32)


def test_packed_loss_averages_the_counted_targets(rng):
  model = GPT(TINY, rngs=nnx.Rngs(0))
  tokens = rng.integers(0, 256, (2, 17)).astype(np.int32)
  ids = np.array([[0] * 5 + [1] * 12, [0] * 10 + [-1] * 7], np.int32)
  positions = np.asarray(pallas_fa3.segment_positions(ids))
  batch = packing.PackedBatch(
    *(jnp.asarray(x) for x in (tokens, ids, positions))
  )
  got = packed_next_byte_loss(model, batch)
  logits = model(
    batch.tokens[:, :-1],
    segment_ids=batch.segment_ids[:, :-1],
    positions=batch.positions[:, :-1],
  )
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  mask = packing.loss_mask(ids)
  assert mask.sum() == 15 + 9
  np.testing.assert_allclose(got, ce[mask].mean(), rtol=1e-6)


# --- training -----------------------------------------------------------------


def test_packed_training_runs_and_records_it(tmp_path):
  summary = train(TINY, PACKED, tmp_path, progress=False, log=_quiet)
  losses = summary["losses"]
  assert sorted(losses) == list(range(1, 7))
  assert all(np.isfinite(list(losses.values())))
  assert np.isfinite(summary["final_val_bpb"])
  saved = json.loads((tmp_path / SUMMARY_FILE).read_text())
  assert saved["packed"] and saved["train_config"]["packed"]
  packing_stats = saved["packing"]
  assert packing_stats["train_segments_per_row"] >= 1
  assert 0 < packing_stats["train_target_fraction"] <= 1
  assert 0 < packing_stats["val_target_fraction"] <= 1
  records = [
    json.loads(line)
    for line in (tmp_path / METRICS_FILE).read_text().splitlines()
  ]
  assert records[0]["run"] == {"packed": True}


@pytest.mark.parametrize(
  "options",
  [
    {},
    pytest.param(
      dict(window_pattern=(5, None), sinks=True, softcap=20.0, num_kv_heads=1),
      marks=pytest.mark.slow,
    ),
  ],
  ids=["rope", "window-sinks-softcap-mqa"],
)
def test_varlen_attention_is_the_segment_ids_function(options):
  """GPTConfig(varlen=True): the batch's documents as one
  flash_attention_varlen call give the segment-ids model's loss and
  gradients (the same parameters)."""
  batch = packing.packed_train_batch(
    _corpus([5, 9, 30, 3, 17], [8]), step=0, data_seed=0, batch_size=3,
    seq_len=24,
  )  # fmt: skip
  batch = packing.PackedBatch(*(jnp.asarray(x) for x in batch))
  assert int(batch.segment_ids.max()) >= 1  # several documents per row
  results = []
  for varlen in (False, True):
    cfg = dataclasses.replace(TINY, varlen=varlen, num_layers=2, **options)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    loss, grads = jax.jit(nnx.value_and_grad(packed_next_byte_loss))(
      model, batch
    )
    results.append((loss, jax.tree.leaves(grads)))
  (loss, grads), (v_loss, v_grads) = results
  np.testing.assert_allclose(v_loss, loss, rtol=1e-6)
  for g, v in zip(grads, v_grads):
    np.testing.assert_allclose(v, g, rtol=1e-4, atol=1e-6)


def test_varlen_training_runs(tmp_path):
  cfg = dataclasses.replace(PACKED, steps=3, eval_interval=3)
  summary = train(
    dataclasses.replace(TINY, varlen=True), cfg, tmp_path, progress=False,
    log=_quiet,
  )  # fmt: skip
  assert sorted(summary["losses"]) == [1, 2, 3]
  assert all(np.isfinite(list(summary["losses"].values())))
  saved = json.loads((tmp_path / SUMMARY_FILE).read_text())
  assert saved["model_config"]["varlen"] is True


def test_packed_step_is_deterministic():
  program = build_program(TINY, PACKED)
  corpus = data.load_stdlib_corpus(max_bytes=PACKED.max_bytes)
  batch = packing.packed_train_batch(
    corpus, step=0, data_seed=0, batch_size=4, seq_len=32
  )
  runs = []
  for _ in range(2):
    state, metrics = program.train_step(
      program.init_state(), jax.tree.map(jnp.asarray, batch)
    )
    runs.append(float(metrics["loss"]))
  assert runs[0] == runs[1] and np.isfinite(runs[0])


def test_resume_of_a_checkpoint_older_than_packing(tmp_path):
  """A checkpoint whose TrainConfig lacks `packed` means unpacked."""
  cfg = dataclasses.replace(PACKED, packed=False)
  train(TINY, cfg, tmp_path / "new", stop_at_step=2, progress=False, log=_quiet)
  target = build_program(TINY, cfg).init_state()
  ckpt = Checkpointer(tmp_path / "new" / CHECKPOINT_DIR)
  state, meta = ckpt.restore(2, target)
  ckpt.close()
  del meta["train_config"]["packed"]
  old = Checkpointer(tmp_path / "old" / CHECKPOINT_DIR)
  old.save(2, state, meta)
  old.close()
  resumed = train(
    TINY,
    cfg,
    tmp_path / "old",
    resume=True,
    stop_at_step=3,
    progress=False,
    log=_quiet,
  )
  assert sorted(resumed["losses"]) == [3]
  with pytest.raises(ValueError, match="TrainConfig.packed"):
    train(TINY, PACKED, tmp_path / "old", resume=True, progress=False)


def test_cli_packed_flag():
  parse = lambda *argv: cli_train.train_configs(
    cli.build_parser().parse_args(["train", *argv])
  )
  assert parse()[1].packed is False
  assert parse("--packed")[1].packed is True
  assert parse("--packed", "--no-packed")[1].packed is False
  assert parse()[0].varlen is False
  assert parse("--packed", "--varlen")[0].varlen is True
  with pytest.raises(ValueError, match="GPTConfig.varlen"):
    GPTConfig(varlen="yes")


def test_config_packed_must_be_a_bool():
  with pytest.raises(ValueError, match="TrainConfig.packed"):
    TrainConfig(packed=1)
