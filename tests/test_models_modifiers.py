"""The GPT's attention variants: per-layer windows, softcap and sinks.

GPTConfig validates and round-trips them, the blocks get them, a tiny model
with all three trains, and `pallas-fa3 train` takes them as flags.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import cli as cli_train
from models.gpt import GPT, GPTConfig
from models.step import build_program
from models.train import SUMMARY_FILE, train
from pallas_fa3.tools import cli

TINY = GPTConfig(
  num_layers=2, d_model=32, num_heads=4, max_seq_len=32, dtype="float32"
)
VARIANTS = dataclasses.replace(
  TINY, window_pattern=(4, None), softcap=30.0, sinks=True
)
VARIANTS_FIELDS = ("window_pattern", "softcap", "sinks")
_quiet = lambda line: None
# The CLI tests' model: VARIANTS with max_seq_len = seq_len = 32.
_FLAGS = [
  "--layers",
  "2",
  "--d-model",
  "32",
  "--heads",
  "4",
  "--dtype",
  "float32",
  "--seq-len",
  "32",
  "--batch",
  "2",
  "--steps",
  "3",
  "--eval-interval",
  "3",
  "--eval-batches",
  "1",
  "--max-bytes",
  str(1 << 16),
  "--no-progress",
]
_VARIANT_FLAGS = ["--window-pattern", "4,none", "--softcap", "30", "--sinks"]


def _cli_configs(*argv):
  """(GPTConfig, TrainConfig) of `pallas-fa3 train *argv`."""
  args = cli.build_parser().parse_args(["train", *argv])
  return cli_train.train_configs(args)


# --- configuration ---------------------------------------------------------


@pytest.mark.parametrize(
  "field, value, error",
  [
    ("window_pattern", "64,none", TypeError),
    ("window_pattern", 64, TypeError),
    ("window_pattern", (4, -1), ValueError),
    ("window_pattern", (4.0,), ValueError),
    ("window_pattern", (True,), ValueError),
    ("softcap", 0.0, ValueError),
    ("softcap", -5.0, ValueError),
    ("softcap", float("inf"), ValueError),
    ("softcap", "30", ValueError),
    ("softcap", True, ValueError),
    ("sinks", "yes", ValueError),
  ],
)
def test_config_rejects_bad_variants_naming_the_field(field, value, error):
  with pytest.raises(error, match=f"GPTConfig.{field}"):
    dataclasses.replace(TINY, **{field: value})


def test_config_variants_round_trip_through_json():
  d = json.loads(json.dumps(VARIANTS.to_dict()))
  assert d["window_pattern"] == [4, None]
  assert d == VARIANTS.to_dict()  # what a resumed run compares
  rebuilt = GPTConfig(**d)
  assert rebuilt == VARIANTS and hash(rebuilt) == hash(VARIANTS)
  assert rebuilt.window_pattern == (4, None)
  # Made canonical: a list and an int softcap are the same config.
  same = dataclasses.replace(VARIANTS, window_pattern=[4, None], softcap=30)
  assert same == VARIANTS and isinstance(same.softcap, float)
  # A dict without the new fields (an older run) means the defaults.
  old = {k: v for k, v in TINY.to_dict().items() if k not in VARIANTS_FIELDS}
  assert GPTConfig(**old) == TINY


def test_layer_window_repeats_the_pattern():
  cfg = dataclasses.replace(TINY, num_layers=5, window_pattern=(8, 8, None))
  assert [cfg.layer_window(i) for i in range(5)] == [8, 8, None, 8, 8]
  assert TINY.layer_window(3) is None


# --- the model -------------------------------------------------------------


def test_blocks_get_their_window_softcap_and_sinks():
  model = GPT(VARIANTS, rngs=nnx.Rngs(0))
  attns = [block.attn for block in model.blocks]
  assert [a.window_size for a in attns] == [(4, None), None]
  assert all(a.causal and a.softcap == 30.0 for a in attns)
  for a in attns:
    assert a.sinks[...].shape == (4,) and a.sinks[...].dtype == jnp.float32
  assert all(
    block.attn.sinks is None for block in GPT(TINY, rngs=nnx.Rngs(0)).blocks
  )


def test_window_limits_what_a_position_sees():
  """Two blocks of window 4: position p sees tokens p - 8 .. p only."""
  cfg = dataclasses.replace(TINY, window_pattern=(4,))
  model = GPT(cfg, rngs=nnx.Rngs(0))
  forward = nnx.jit(lambda m, t: m(t))
  tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)
  logits = forward(model, tokens)
  changed = forward(model, tokens.at[:, 0].set((tokens[:, 0] + 1) % 256))
  np.testing.assert_array_equal(changed[:, 9:], logits[:, 9:])
  assert float(jnp.max(jnp.abs(changed[:, 8] - logits[:, 8]))) > 0
  # A window that covers every position is global attention, bit for bit.
  wide = GPT(dataclasses.replace(TINY, window_pattern=(31,)), rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(
    forward(wide, tokens), forward(GPT(TINY, rngs=nnx.Rngs(0)), tokens)
  )


def test_variants_train_step_has_finite_loss_and_moves_the_sinks():
  # The configs of the CLI test below: one compilation (models.step caches).
  program = build_program(*_cli_configs(*_FLAGS, *_VARIANT_FLAGS))
  state = program.init_state()
  tokens = jax.random.randint(jax.random.key(2), (2, 33), 0, 256)
  for _ in range(2):  # the first step's learning rate is 0 (warmup)
    state, metrics = program.train_step(state, tokens)
    assert np.isfinite(float(metrics["loss"]))
  sinks = [
    np.asarray(leaf)
    for path, leaf in jax.tree_util.tree_leaves_with_path(state["params"])
    if "sinks" in jax.tree_util.keystr(path)
  ]
  assert len(sinks) == VARIANTS.num_layers
  assert all(np.any(s != 0) for s in sinks), sinks


# --- the training loop and `pallas-fa3 train` --------------------------------


def test_cli_flags_build_the_config():
  parse = lambda *argv: _cli_configs(*argv)[0]
  assert parse(*_FLAGS, *_VARIANT_FLAGS) == dataclasses.replace(
    VARIANTS, max_seq_len=32
  )
  pattern = parse("--window-pattern", "None, 16 ,8").window_pattern
  assert pattern == (None, 16, 8)
  default = parse()
  assert default.window_pattern == () and default.softcap is None
  assert not default.sinks


@pytest.mark.parametrize(
  "argv, match",
  [
    (["--window-pattern", "4,global"], "'global'"),
    (["--window-pattern=-4"], "GPTConfig.window_pattern"),
    (["--softcap", "0"], "GPTConfig.softcap"),
    (["--softcap", "big"], "--softcap"),
  ],
)
def test_cli_bad_variant_flags_are_usage_errors(argv, match, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["train", *argv])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "usage: pallas-fa3 train" in err and match in err, err


def test_cli_trains_the_variants_and_resume_checks_them(tmp_path, capsys):
  out = tmp_path / "run"
  argv = ["train", *_FLAGS, *_VARIANT_FLAGS, "--out", str(out)]
  assert cli.main(argv) == 0, capsys.readouterr().err
  summary = json.loads((out / SUMMARY_FILE).read_text())
  assert summary["completed"] and np.isfinite(summary["final_val_bpb"])
  model = summary["model_config"]
  assert model["window_pattern"] == [4, None]
  assert model["softcap"] == 30.0 and model["sinks"] is True
  # Resuming with the same flags is accepted; another softcap is not.
  assert cli.main([*argv, "--resume"]) == 0
  capsys.readouterr()
  model_cfg, train_cfg = _cli_configs(*_FLAGS, *_VARIANT_FLAGS)
  with pytest.raises(ValueError, match="GPTConfig.softcap"):
    train(
      dataclasses.replace(model_cfg, softcap=20.0),
      train_cfg,
      out,
      resume=True,
      progress=False,
      log=_quiet,
    )


def test_help_lists_the_variant_flags(capsys):
  with pytest.raises(SystemExit):
    cli.main(["train", "--help"])
  out = capsys.readouterr().out
  for flag in ("--window-pattern", "--softcap", "--sinks"):
    assert flag in out, flag
