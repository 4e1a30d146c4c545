"""The training loop (models/train.py), checkpoints, and `pallas-fa3 train`."""

from __future__ import annotations

import dataclasses
import json

import pytest

from models import cli as cli_train, data
from models.checkpoint import Checkpointer
from models.gpt import GPTConfig
from models.step import TrainConfig, build_program
from models.train import CHECKPOINT_DIR, METRICS_FILE, SUMMARY_FILE, train
from pallas_fa3.tools import cli

TINY_MODEL = GPTConfig(num_layers=1, d_model=32, num_heads=2, max_seq_len=32)
# One tiny setting for every test, so they share one compilation
# (models.step caches programs); steps are milliseconds each.
TINY_TRAIN = TrainConfig(
  steps=40,
  batch_size=8,
  seq_len=32,
  lr=1e-2,
  warmup_steps=4,
  eval_interval=20,
  eval_batches=2,
  checkpoint_interval=0,
  max_bytes=1 << 18,
)
# The same settings as TINY_MODEL / TINY_TRAIN (one compilation for both).
TINY_FLAGS = [
  "--layers",
  "1",
  "--d-model",
  "32",
  "--heads",
  "2",
  "--seq-len",
  "32",
  "--batch",
  "8",
  "--steps",
  "40",
  "--lr",
  "1e-2",
  "--warmup-steps",
  "4",
  "--eval-interval",
  "20",
  "--eval-batches",
  "2",
  "--max-bytes",
  str(1 << 18),
  "--no-progress",
]
_quiet = lambda line: None


def _train(out, model=TINY_MODEL, cfg=TINY_TRAIN, **kw):
  return train(model, cfg, out, progress=False, log=_quiet, **kw)


def test_loss_decreases_over_a_few_dozen_steps(tmp_path):
  summary = _train(tmp_path)
  losses = summary["losses"]
  assert sorted(losses) == list(range(1, 41))
  first, last = losses[1], sum(losses[i] for i in range(36, 41)) / 5
  assert 7 < first < 9  # ~ log2(256) = 8 bits per byte at initialization
  assert last < first - 2, (first, last)
  assert summary["final_val_bpb"] < summary["init_val_bpb"] - 2, summary
  assert summary["completed"] and summary["final_step"] == 40


def test_resume_is_exact_and_runs_are_deterministic(tmp_path):
  """N steps straight == N/2 steps, restore in a fresh program, N/2 steps."""
  straight = _train(tmp_path / "straight")
  half = 13  # not a multiple of the eval interval: resume mid-interval
  first = _train(tmp_path / "resumed", stop_at_step=half)
  assert sorted(first["losses"]) == list(range(1, half + 1))
  assert not first["completed"]
  second = _train(tmp_path / "resumed", resume=True)
  assert sorted(second["losses"]) == list(range(half + 1, TINY_TRAIN.steps + 1))
  # Bitwise: the same floats, not merely close.
  assert {**first["losses"], **second["losses"]} == straight["losses"]
  assert second["final_val_bpb"] == straight["final_val_bpb"]
  assert second["init_val_bpb"] == straight["init_val_bpb"]
  records = [
    json.loads(l)
    for l in (tmp_path / "resumed" / METRICS_FILE).read_text().splitlines()
  ]
  steps = [r["step"] for r in records if "train_bpb" in r]
  assert steps == list(range(1, TINY_TRAIN.steps + 1))


def test_checkpoints_are_saved_on_schedule(tmp_path):
  cfg = dataclasses.replace(TINY_TRAIN, checkpoint_interval=15)
  _train(tmp_path, cfg=cfg)
  saved = sorted(
    int(p.name)
    for p in (tmp_path / CHECKPOINT_DIR).iterdir()
    if p.name.isdigit()
  )
  assert saved == [30, 40]  # every 15 steps and at the end; newest two kept


def test_resume_refuses_a_different_config(tmp_path):
  _train(tmp_path, stop_at_step=2)
  other = dataclasses.replace(TINY_TRAIN, lr=2e-2)
  with pytest.raises(ValueError, match="TrainConfig.lr"):
    _train(tmp_path, cfg=other, resume=True)
  with pytest.raises(ValueError, match="GPTConfig.norm"):
    _train(
      tmp_path,
      model=dataclasses.replace(TINY_MODEL, norm="layernorm"),
      resume=True,
    )


def test_resume_of_a_checkpoint_older_than_the_attention_variants(tmp_path):
  """A checkpoint whose GPTConfig lacks window_pattern/softcap/sinks means
  their defaults: resuming it with the default model works."""
  _train(tmp_path / "new", stop_at_step=2)
  target = build_program(TINY_MODEL, TINY_TRAIN).init_state()
  ckpt = Checkpointer(tmp_path / "new" / CHECKPOINT_DIR)
  state, meta = ckpt.restore(2, target)
  ckpt.close()
  for name in ("window_pattern", "softcap", "sinks"):
    del meta["model_config"][name]
  old = Checkpointer(tmp_path / "old" / CHECKPOINT_DIR)
  old.save(2, state, meta)
  old.close()
  resumed = _train(tmp_path / "old", resume=True, stop_at_step=3)
  assert sorted(resumed["losses"]) == [3]
  with pytest.raises(ValueError, match="GPTConfig.sinks"):
    _train(
      tmp_path / "old",
      model=dataclasses.replace(TINY_MODEL, sinks=True),
      resume=True,
    )


def test_existing_run_is_not_overwritten_and_missing_one_not_resumed(tmp_path):
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    _train(tmp_path / "empty", resume=True)
  _train(tmp_path / "run", stop_at_step=1)
  with pytest.raises(FileExistsError, match="resume"):
    _train(tmp_path / "run")


def test_config_validation_names_the_field():
  with pytest.raises(ValueError, match="TrainConfig.steps"):
    TrainConfig(steps=0)
  with pytest.raises(ValueError, match="TrainConfig.lr"):
    TrainConfig(lr=-1.0)
  with pytest.raises(ValueError, match="max_seq_len"):
    _train("unused", cfg=dataclasses.replace(TINY_TRAIN, seq_len=64))


# --- the command line --------------------------------------------------------


def test_cli_train_end_to_end(tmp_path, capsys):
  out = tmp_path / "run"
  assert cli.main(["train", *TINY_FLAGS, "--out", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "step 40/40: val " in printed and "summary: " in printed, printed
  summary = json.loads((out / SUMMARY_FILE).read_text())
  assert summary["final_step"] == 40 and summary["completed"]
  assert summary["model_config"]["num_layers"] == 1
  assert summary["train_config"]["steps"] == 40
  assert summary["packed"] is False and "packing" not in summary
  for key in (
    "init_val_bpb",
    "final_val_bpb",
    "tokens_per_s",
    "wall_time_s",
    "num_params",
    "jax_version",
    "attention_backend",
  ):
    assert summary[key] is not None, key
  assert (out / METRICS_FILE).exists() and (
    out / CHECKPOINT_DIR / "40"
  ).exists()
  # Running it again needs --resume; with it, a finished run just reports.
  assert cli.main(["train", *TINY_FLAGS, "--out", str(out)]) == 1
  assert "already holds checkpoints" in capsys.readouterr().err
  assert cli.main(["train", *TINY_FLAGS, "--out", str(out), "--resume"]) == 0
  again = json.loads((out / SUMMARY_FILE).read_text())
  assert again["final_val_bpb"] == summary["final_val_bpb"]


def test_cli_train_defaults_are_the_config_defaults():
  args = cli.build_parser().parse_args(["train"])
  model_cfg, train_cfg = cli_train.train_configs(args)
  assert train_cfg == TrainConfig()
  assert model_cfg == dataclasses.replace(
    GPTConfig(), max_seq_len=TrainConfig().seq_len
  )


def test_cli_train_help(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["train", "--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: pallas-fa3 train "), out
  for flag in (
    "--layers",
    "--d-model",
    "--heads",
    "--kv-heads",
    "--steps",
    "--batch",
    "--seq-len",
    "--dtype",
    "--implementation",
    "--lr",
    "--seed",
    "--out",
    "--eval-interval",
    "--checkpoint-interval",
    "--resume",
    "--packed",
  ):
    assert flag in out, flag


@pytest.mark.parametrize(
  "argv, match",
  [
    (["--heads", "3"], "d_model"),
    (["--steps", "0"], "steps"),
    (["--dtype", "float16"], "invalid choice"),
  ],
)
def test_cli_train_bad_flags_are_usage_errors(argv, match, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["train", *argv])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "usage: pallas-fa3 train" in err and match in err, err


def test_cli_train_unavailable_backend_fails_loudly(tmp_path, capsys):
  assert (
    cli.main(
      [
        "train",
        *TINY_FLAGS,
        "--implementation",
        "mosaic",
        "--out",
        str(tmp_path),
      ]
    )
    == 1
  )
  err = capsys.readouterr().err
  # The tiny model's head_dim 16 is not a kernel head dim; on a CPU with a
  # served shape the message is "cannot run here: no GPU ...".
  assert "implementation='mosaic' cannot run" in err, err


def test_data_used_by_training_is_the_stdlib():
  corpus = data.load_stdlib_corpus(max_bytes=TINY_TRAIN.max_bytes)
  assert corpus.root == str(data.stdlib_root())
  assert corpus.train.size + corpus.val.size == TINY_TRAIN.max_bytes
