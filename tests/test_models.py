"""The GPT model (models/gpt.py) and its data (models/data.py)."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import data
from models.gpt import GPT, GPTConfig, count_params
from models.step import TrainConfig, build_program

TINY = GPTConfig(
  num_layers=2,
  d_model=32,
  num_heads=4,
  num_kv_heads=2,
  max_seq_len=32,
  dtype="float32",
)
SMALL_CORPUS = 1 << 18  # bytes: enough windows, read in milliseconds


@pytest.fixture(scope="module")
def corpus():
  return data.load_stdlib_corpus(max_bytes=SMALL_CORPUS)


# --- configuration ---------------------------------------------------------


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("num_layers", 0, "num_layers"),
    ("d_model", 30, "d_model"),
    ("num_kv_heads", 3, "num_kv_heads"),
    ("norm", "batchnorm", "norm"),
    ("position", "alibi", "position"),
    ("dtype", "float16", "dtype"),
    ("attention_implementation", "flash", "attention_implementation"),
  ],
)
def test_config_rejects_bad_values_naming_the_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(TINY, **{field: value})


def test_config_rejects_non_int_layers_naming_the_field():
  with pytest.raises(TypeError, match="num_layers"):
    dataclasses.replace(TINY, num_layers=2.0)


def test_config_is_hashable_and_round_trips_through_dict():
  assert hash(TINY) == hash(GPTConfig(**TINY.to_dict()))
  assert GPTConfig(**TINY.to_dict()) == TINY


# --- the model -------------------------------------------------------------


@pytest.mark.parametrize(
  "cfg",
  [
    TINY,
    dataclasses.replace(
      TINY,
      position="learned",
      norm="layernorm",
      tie_embeddings=False,
      use_bias=True,
      num_kv_heads=1,
    ),
    dataclasses.replace(TINY, dtype="bfloat16"),
  ],
  ids=["rope-rms-tied-gqa", "learned-ln-untied-mqa", "bf16-compute"],
)
def test_forward_shapes_dtypes_and_causality(cfg):
  model = GPT(cfg, rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  forward = nnx.jit(lambda m, t: m(t))
  tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)
  logits = forward(model, tokens)
  assert logits.shape == (2, 32, 256) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))
  # Changing the last 8 tokens must not change the logits before them.
  changed = tokens.at[:, 24:].set((tokens[:, 24:] + 1) % 256)
  np.testing.assert_array_equal(forward(model, changed)[:, :24], logits[:, :24])
  # Near-uniform predictions at initialization: loss ~ 8 bits per byte.
  nats = -jax.nn.log_softmax(logits).mean()
  assert abs(float(nats) / np.log(2) - 8) < 0.5


def test_tied_model_has_no_unembedding_matrix():
  tied = count_params(GPT(TINY, rngs=nnx.Rngs(0)))
  untied = count_params(
    GPT(dataclasses.replace(TINY, tie_embeddings=False), rngs=nnx.Rngs(0))
  )
  assert untied - tied == TINY.vocab_size * TINY.d_model


def test_too_long_sequence_is_rejected():
  model = GPT(TINY, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="max_seq_len"):
    model(jnp.zeros((1, 33), jnp.int32))


def _one_step(implementation, tokens):
  """Loss and gradients of the first train step of a float32 TINY model."""
  cfg = dataclasses.replace(TINY, attention_implementation=implementation)
  program = build_program(cfg, TrainConfig(steps=10, batch_size=4, seq_len=32))
  state = program.init_state()
  loss_fn = lambda p: program.eval_loss(p, tokens)
  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(state["params"])
  return float(loss), grads


def test_reference_and_blockwise_train_step_agree(corpus):
  """One step's loss and gradients with implementation="reference" vs "blockwise".

  Tolerance: both compute attention in float32 (blockwise keeps P in the
  input dtype, float32 here) and differ only in rounding: the online
  softmax's order of summation, exp2 with a prescaled log2(e) vs exp, and the
  FA2 recomputation backward vs autodiff. Each is a few float32 ulps
  (2^-24 ~ 6e-8) per reduction, growing with the reduction length (32) and
  depth (2 blocks, forward and backward). Measured on CPU (JAX 0.10.2): the
  losses are equal, the gradients agree to <= 4.4e-7 of each gradient's
  largest entry (~7 ulps). The bounds, 1e-5 relative for the loss and 1e-5
  of the largest entry for each gradient, leave ~20x margin for other
  devices' summation orders, yet are far below any real bug (a wrong mask,
  scale or head grouping moves the loss by > 1e-2 and the gradients by O(1)
  of their size).
  """
  tokens = jnp.asarray(
    data.train_batch(corpus, step=0, data_seed=0, batch_size=4, seq_len=32)
  )
  # Full float32 matmuls in the dense layers: GPUs default to TF32 there,
  # whose rounding would turn the attention's ulp-level differences into
  # 1e-3-level ones and hide what this test compares.
  with jax.default_matmul_precision("highest"):
    loss_ref, grads_ref = _one_step("reference", tokens)
    loss_blk, grads_blk = _one_step("blockwise", tokens)
  assert loss_blk == pytest.approx(loss_ref, rel=1e-5)
  flat_ref = jax.tree_util.tree_leaves_with_path(grads_ref)
  flat_blk = jax.tree.leaves(grads_blk)
  assert len(flat_ref) == len(flat_blk)
  for (path, g_ref), g_blk in zip(flat_ref, flat_blk):
    scale = float(jnp.max(jnp.abs(g_ref)))
    err = float(jnp.max(jnp.abs(g_ref - g_blk)))
    assert scale > 0, jax.tree_util.keystr(path)
    assert err <= 1e-5 * scale, (jax.tree_util.keystr(path), err, scale)


# --- the data ----------------------------------------------------------------


def test_reads_real_stdlib_files_sorted_without_tests():
  files = data.stdlib_files()
  names = {f.as_posix() for f in files}
  assert {"os.py", "json/__init__.py", "collections/__init__.py"} <= names
  assert files == sorted(files, key=lambda f: f.as_posix())
  assert not any(
    part in ("test", "tests", "site-packages")
    for f in files
    for part in f.parts[:-1]
  )
  with_tests = data.stdlib_files(include_tests=True)
  assert len(with_tests) > len(files)


def test_corpus_is_the_files_bytes(corpus):
  root = data.stdlib_root()
  files = data.stdlib_files()
  train = [f for f in files if not data.is_validation_file(f, 0.05)]
  val = [f for f in files if data.is_validation_file(f, 0.05)]
  assert train and val
  # The first file of each split starts its split, byte for byte.
  first_train = (root / train[0]).read_bytes()
  first_val = (root / val[0]).read_bytes()
  n = min(len(first_train), corpus.train.size)
  assert corpus.train[:n].tobytes() == first_train[:n]
  m = min(len(first_val), corpus.val.size)
  assert corpus.val[:m].tobytes() == first_val[:m]
  assert corpus.train.size + corpus.val.size == SMALL_CORPUS


def test_split_is_fixed_by_path_and_independent_of_the_cap():
  files = data.stdlib_files()
  split = [data.is_validation_file(f, 0.05) for f in files]
  assert 0 < sum(split) < len(files)
  assert split == [
    data.is_validation_file(pathlib.PurePosixPath(f.as_posix()), 0.05)
    for f in files
  ]
  small = data.load_stdlib_corpus(max_bytes=1 << 16)
  big = data.load_stdlib_corpus(max_bytes=1 << 18)
  # A larger cap only appends: the small corpus is a prefix of the big one.
  assert big.train[: small.train.size].tobytes() == small.train.tobytes()
  assert big.val[: small.val.size].tobytes() == small.val.tobytes()


def test_batches_are_deterministic_per_seed_and_step(corpus):
  kw = dict(batch_size=8, seq_len=32)
  a = data.train_batch(corpus, step=5, data_seed=1, **kw)
  assert a.shape == (8, 33) and a.dtype == np.int32
  assert a.min() >= 0 and a.max() <= 255
  np.testing.assert_array_equal(
    a, data.train_batch(corpus, step=5, data_seed=1, **kw)
  )
  assert not np.array_equal(
    a, data.train_batch(corpus, step=6, data_seed=1, **kw)
  )
  assert not np.array_equal(
    a, data.train_batch(corpus, step=5, data_seed=2, **kw)
  )
  # Each row is a contiguous window of the training bytes.
  text = corpus.train.tobytes()
  assert all(bytes(row.astype(np.uint8)) in text for row in a)


def test_validation_batches_are_fixed_and_cover_the_split(corpus):
  v = data.val_batches(corpus, num_batches=3, batch_size=4, seq_len=32)
  assert v.shape == (3, 4, 33)
  np.testing.assert_array_equal(
    v, data.val_batches(corpus, num_batches=3, batch_size=4, seq_len=32)
  )
  val = corpus.val
  np.testing.assert_array_equal(v[0, 0], val[:33])
  np.testing.assert_array_equal(v[-1, -1], val[val.size - 33 :])


def test_corpus_arguments_are_validated():
  with pytest.raises(ValueError, match="val_fraction"):
    data.load_stdlib_corpus(val_fraction=1.0)
  with pytest.raises(ValueError, match="max_bytes"):
    data.load_stdlib_corpus(max_bytes=0)
