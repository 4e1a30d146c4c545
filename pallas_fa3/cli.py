"""`pallas-fa3`: the command line.

Subcommands:
  info   the machine, JAX, whether a Hopper GPU is present, which backend the
         automatic choice picks for a sample call and why, and (unless
         --no-run) that sample call checked against the float64 golden.

  train  train the byte-level GPT of `models/` on the Python standard
         library's sources (CPU default: a small model, about 3 minutes on
         2 idle cores); checkpoints, --resume, a summary JSON.

  bench  the performance harness (pallas_fa3/bench/): named benchmark shapes,
         our backends against the reference, jax.nn.dot_product_attention
         (XLA, cuDNN) and JAX's attention_mgpu; TFLOPs/s, memory, CSV/JSON/PNG.
         Without a GPU: a small CPU sweep (about a minute).

  numerics  the numerics studies (pallas_fa3/numerics/): forward deviation
         against a float64 golden, the FP8 error table, weight divergence of
         training runs, the repeated-max bias; report folders with JSON,
         markdown and PNG. CPU defaults finish in minutes.

  aot    the deviceless sm_90a compile of the kernels (Mosaic + ptxas on a
         CPU, needs the CUDA plugin packages): spills per config, and with
         --profile a static profile of each kernel's PTX.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from pallas_fa3 import example_models

_SAMPLE_HELP = "sample call used to show the automatic choice"
# XLA flag that makes GPU reductions and autotuning deterministic (a no-op on
# CPU, which is deterministic already): two `train` runs give bitwise-equal
# losses on a GPU too.
_XLA_DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
# `train` defaults: the CPU default run (about 3 minutes on 2 idle cores,
# benchmarks/RESULTS.md "CPU training (issue 5)"). They equal the defaults of
# models.gpt.GPTConfig / models.train.TrainConfig (tests/test_train.py
# checks), written out here so that `--help` does not import Flax.
_TRAIN_MODEL_DEFAULTS = dict(
  layers=4,
  d_model=128,
  heads=2,
  kv_heads=None,
  mlp_ratio=4,
  norm="rmsnorm",
  position="rope",
  dtype="bfloat16",
)
_TRAIN_DEFAULTS = dict(
  steps=1000,
  batch=16,
  seq_len=128,
  lr=3e-3,
  warmup_steps=50,
  min_lr_ratio=0.1,
  weight_decay=0.1,
  grad_clip=1.0,
  seed=0,
  data_seed=0,
  max_bytes=None,
  eval_interval=100,
  eval_batches=8,
  checkpoint_interval=200,
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Appends "(default: X)" to an option's help unless X is None.

  An option whose default is None says in its own help what leaving it unset
  means ("unset: ..."); "(default: None)" would only contradict that.
  """

  def _get_help_string(self, action: argparse.Action) -> str | None:
    if action.default is None:
      return action.help
    return super()._get_help_string(action)


def _require_positive(args, *flags: str) -> None:
  """Usage error (exit 2) naming the first of `flags` set to a value below 1."""
  for flag in flags:
    value = getattr(args, flag)
    if value is not None and value < 1:
      args.parser.error(f"--{flag.replace('_', '-')} must be >= 1; got {value}")


def _add_info_parser(sub) -> None:
  p = sub.add_parser(
    "info",
    help="environment, devices and the automatic backend choice",
    description=(
      "Print the JAX version, backend and devices, whether a Hopper (sm90)"
      " GPU is present, which implementation flash_attention(...,"
      " implementation=None) picks for a sample call and why, then run"
      " that call and compare it with a float64 golden."
    ),
    formatter_class=HelpFormatter,
  )
  p.add_argument("--batch", type=int, default=1, help=_SAMPLE_HELP)
  p.add_argument("--seq-q", type=int, default=256, help=_SAMPLE_HELP)
  p.add_argument("--seq-kv", type=int, default=256, help=_SAMPLE_HELP)
  p.add_argument("--heads-q", type=int, default=4, help=_SAMPLE_HELP)
  p.add_argument("--heads-kv", type=int, default=2, help=_SAMPLE_HELP)
  p.add_argument("--head-dim", type=int, default=64, help=_SAMPLE_HELP)
  p.add_argument(
    "--dtype",
    default="bfloat16",
    choices=("bfloat16", "float16", "float32"),
    help=_SAMPLE_HELP,
  )
  p.add_argument(
    "--causal",
    action=argparse.BooleanOptionalAction,
    default=True,
    help=_SAMPLE_HELP,
  )
  p.add_argument(
    "--no-run",
    action="store_true",
    help="only report the choice; do not run the sample call",
  )
  p.set_defaults(func=_cmd_info, parser=p)


def _cmd_info(args) -> int:
  import jax
  import jaxlib
  import numpy as np

  import pallas_fa3
  from pallas_fa3 import backends, flash_attention
  from pallas_fa3.reference import golden_attention
  from pallas_fa3.spec import make_spec

  devices = jax.devices()
  print(
    f"pallas-fa3 {pallas_fa3.__version__}  (Python {platform.python_version()},"
    f" {platform.machine()})"
  )
  print(
    f"JAX {jax.__version__}, jaxlib {jaxlib.__version__};"
    f" default backend: {jax.default_backend()}"
  )
  for d in devices:
    cc = getattr(d, "compute_capability", None)
    extra = f", compute capability {cc}" if cc else ""
    print(f"  device {d.id}: {d.platform} {d.device_kind}{extra}")
  hopper = backends.hopper_reason()
  print("Hopper (sm90) GPU: " + ("yes" if hopper is None else f"no ({hopper})"))

  _require_positive(
    args, "batch", "seq_q", "seq_kv", "heads_q", "heads_kv", "head_dim"
  )
  if args.heads_q % args.heads_kv:
    args.parser.error(
      f"--heads-q ({args.heads_q}) must be a multiple of"
      f" --heads-kv ({args.heads_kv})"
    )
  shape_q = (args.batch, args.seq_q, args.heads_q, args.head_dim)
  shape_kv = (args.batch, args.seq_kv, args.heads_kv, args.head_dim)
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], shape_q, args.dtype)
  k = jax.random.normal(keys[1], shape_kv, args.dtype)
  v = jax.random.normal(keys[2], shape_kv, args.dtype)
  try:
    spec = make_spec(q, k, v, causal=args.causal)
  except (TypeError, ValueError) as e:
    args.parser.error(f"the sample call is invalid: {e}")
  print(
    f"\nSample call: q {shape_q}, k/v {shape_kv}, {args.dtype},"
    f" causal={args.causal} (bottom-right aligned)"
  )
  print("Automatic choice (fastest first):")
  chosen = None
  for name, reason in backends.explain_choice(spec):
    if reason is None and chosen is None:
      chosen = name
      print(f"  -> {name}: supported; picked ({backends.get(name).summary})")
    else:
      print(
        f"     {name}: "
        + ("supported" if reason is None else f"skipped: {reason}")
      )
  if args.no_run:
    return 0

  start = time.perf_counter()
  out = jax.block_until_ready(flash_attention(q, k, v, causal=args.causal))
  first = time.perf_counter() - start
  start = time.perf_counter()
  out = jax.block_until_ready(flash_attention(q, k, v, causal=args.causal))
  again = time.perf_counter() - start
  gold, _ = golden_attention(q, k, v, causal=args.causal)
  err = float(np.max(np.abs(np.asarray(out, np.float64) - gold)))
  eps = float(jax.numpy.finfo(args.dtype).eps)
  print(
    f"\nRan it with {chosen}: output {tuple(out.shape)} {out.dtype};"
    f" first call {first:.2f} s (includes compilation), second {again * 1e3:.1f} ms"
  )
  print(
    f"max |out - float64 golden| = {err:.3g}  ({err / eps:.1f} x {args.dtype} eps;"
    " a few eps is rounding, not error)"
  )
  return 0


def _add_train_parser(sub) -> None:
  p = sub.add_parser(
    "train",
    help="train the byte-level GPT on the Python standard library",
    description=(
      "Train a GPT-style byte-level language model (models/, attention by"
      " pallas_fa3.flax.FlashMultiHeadAttention) on the .py sources of"
      " this Python's standard library, read from disk (no download)."
      " AdamW with warmup + cosine decay and gradient clipping; losses in"
      " bits per byte (8 = uniform). Writes checkpoints/, metrics.jsonl"
      " and summary.json to --out; --resume continues bitwise-exactly."
      " The defaults train a small model (0.8M parameters, bfloat16"
      " compute) to about 2 bits/byte in about 3 minutes on an idle"
      " 2-core CPU; the same command runs unchanged on a GPU."
    ),
    formatter_class=HelpFormatter,
  )
  m, d = _TRAIN_MODEL_DEFAULTS, _TRAIN_DEFAULTS
  model = p.add_argument_group("model (models.gpt.GPTConfig)")
  model.add_argument(
    "--layers", type=int, default=m["layers"], help="transformer blocks"
  )
  model.add_argument(
    "--d-model", type=int, default=m["d_model"], help="residual width"
  )
  model.add_argument(
    "--heads", type=int, default=m["heads"], help="query heads"
  )
  model.add_argument(
    "--kv-heads",
    type=int,
    default=m["kv_heads"],
    help="key/value heads, for GQA/MQA (None: as --heads)",
  )
  model.add_argument(
    "--mlp-ratio", type=int, default=m["mlp_ratio"], help="MLP width / d_model"
  )
  model.add_argument(
    "--norm",
    default=m["norm"],
    choices=("rmsnorm", "layernorm"),
    help="pre-norm type",
  )
  model.add_argument(
    "--position",
    default=m["position"],
    choices=("rope", "learned"),
    help="position encoding",
  )
  model.add_argument(
    "--tie-embeddings",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="logits use the token embedding",
  )
  model.add_argument(
    "--dtype",
    default=m["dtype"],
    choices=("bfloat16", "float32"),
    help="compute dtype (parameters stay float32)",
  )
  model.add_argument(
    "--implementation",
    default="auto",
    choices=("auto", "blockwise", "reference", "mosaic", "interpret"),
    help="flash_attention backend (auto: the automatic choice)",
  )
  opt = p.add_argument_group("training (models.train.TrainConfig)")
  opt.add_argument(
    "--steps",
    type=int,
    default=d["steps"],
    help="optimizer steps (the schedule's length)",
  )
  opt.add_argument(
    "--batch", type=int, default=d["batch"], help="sequences per step"
  )
  opt.add_argument(
    "--seq-len", type=int, default=d["seq_len"], help="bytes per sequence"
  )
  opt.add_argument(
    "--lr", type=float, default=d["lr"], help="peak learning rate"
  )
  opt.add_argument(
    "--warmup-steps",
    type=int,
    default=d["warmup_steps"],
    help="linear warmup steps",
  )
  opt.add_argument(
    "--min-lr-ratio",
    type=float,
    default=d["min_lr_ratio"],
    help="final lr / peak lr (cosine decay)",
  )
  opt.add_argument(
    "--weight-decay",
    type=float,
    default=d["weight_decay"],
    help="AdamW decay of the weight matrices",
  )
  opt.add_argument(
    "--grad-clip",
    type=float,
    default=d["grad_clip"],
    help="global gradient norm clip",
  )
  opt.add_argument(
    "--seed", type=int, default=d["seed"], help="model initialization seed"
  )
  opt.add_argument(
    "--data-seed",
    type=int,
    default=d["data_seed"],
    help="seed of the batch order",
  )
  opt.add_argument(
    "--max-bytes",
    type=int,
    default=d["max_bytes"],
    help="cap on the corpus bytes read (None: all)",
  )
  run = p.add_argument_group("run")
  run.add_argument(
    "--out",
    default="runs/train",
    help="output folder (checkpoints, metrics, summary)",
  )
  run.add_argument(
    "--eval-interval",
    type=int,
    default=d["eval_interval"],
    help="evaluate every N steps",
  )
  run.add_argument(
    "--eval-batches",
    type=int,
    default=d["eval_batches"],
    help="validation batches per evaluation",
  )
  run.add_argument(
    "--checkpoint-interval",
    type=int,
    default=d["checkpoint_interval"],
    help="checkpoint every N steps (0: only at the end)",
  )
  run.add_argument(
    "--resume",
    action="store_true",
    help="continue from the newest checkpoint in --out",
  )
  run.add_argument(
    "--progress",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="progress bar (on a terminal)",
  )
  run.add_argument(
    "--deterministic",
    action=argparse.BooleanOptionalAction,
    default=True,
    help=f"add {_XLA_DETERMINISTIC} to XLA_FLAGS (GPU bitwise reproducibility)",
  )
  p.set_defaults(func=_cmd_train, parser=p)


def _train_configs(args):
  """`(GPTConfig, TrainConfig)` from the parsed flags."""
  example_models.require_models("pallas-fa3 train")
  from models.gpt import GPTConfig  # pylint: disable=g-import-not-at-top
  from models.train import TrainConfig  # pylint: disable=g-import-not-at-top

  model_cfg = GPTConfig(
    num_layers=args.layers,
    d_model=args.d_model,
    num_heads=args.heads,
    num_kv_heads=args.kv_heads,
    mlp_ratio=args.mlp_ratio,
    max_seq_len=args.seq_len,
    position=args.position,
    norm=args.norm,
    tie_embeddings=args.tie_embeddings,
    dtype=args.dtype,
    attention_implementation=(
      None if args.implementation == "auto" else args.implementation
    ),
  )
  train_cfg = TrainConfig(
    steps=args.steps,
    batch_size=args.batch,
    seq_len=args.seq_len,
    lr=args.lr,
    warmup_steps=args.warmup_steps,
    min_lr_ratio=args.min_lr_ratio,
    weight_decay=args.weight_decay,
    grad_clip=args.grad_clip,
    seed=args.seed,
    data_seed=args.data_seed,
    max_bytes=args.max_bytes,
    eval_interval=args.eval_interval,
    eval_batches=args.eval_batches,
    checkpoint_interval=args.checkpoint_interval,
  )
  return model_cfg, train_cfg


def _cmd_train(args) -> int:
  if args.deterministic and _XLA_DETERMINISTIC not in os.environ.get(
    "XLA_FLAGS", ""
  ):
    # Read when the JAX backend starts, which has not happened yet here.
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " " + _XLA_DETERMINISTIC
    ).strip()
  try:
    example_models.require_models("pallas-fa3 train")
  except ImportError as e:
    print(f"pallas-fa3 train: error: {e}", file=sys.stderr)
    return 1
  try:
    model_cfg, train_cfg = _train_configs(args)
  except (TypeError, ValueError) as e:
    args.parser.error(str(e))
  from models.train import SUMMARY_FILE, train  # pylint: disable=g-import-not-at-top

  try:
    summary = train(
      model_cfg, train_cfg, args.out, resume=args.resume, progress=args.progress
    )
  except (
    FileExistsError,
    FileNotFoundError,
    NotImplementedError,
    ValueError,
  ) as e:
    print(f"pallas-fa3 train: error: {e}", file=sys.stderr)
    return 1
  speed = summary["tokens_per_s"]
  print(
    f"step {summary['final_step']}/{train_cfg.steps}: val"
    f" {summary['init_val_bpb']:.3f} -> {summary['final_val_bpb']:.3f}"
    f" bits/byte; {summary['num_params']:,} params;"
    f" {summary['wall_time_s']:.1f} s wall"
    + (f"; {speed:,.0f} tokens/s" if speed else "")
  )
  print(f"summary: {os.path.join(args.out, SUMMARY_FILE)}")
  return 0


def _add_bench_parser(sub) -> None:
  from pallas_fa3.bench import command  # pylint: disable=g-import-not-at-top

  p = command.add_parser(sub, HelpFormatter)  # flags live with the harness
  p.set_defaults(func=_cmd_bench, parser=p)


def _cmd_bench(args) -> int:
  from pallas_fa3.bench import command  # pylint: disable=g-import-not-at-top

  return command.run(args)


def _add_numerics_parser(sub) -> None:
  from pallas_fa3.numerics import cli_args  # pylint: disable=g-import-not-at-top

  cli_args.add_parser(sub)  # flags and the run live with the studies


def _add_aot_parser(sub) -> None:
  from pallas_fa3.kernels import aot  # pylint: disable=g-import-not-at-top

  p = sub.add_parser(
    "aot",
    help="compile the sm90 kernels for sm_90a on a CPU: spills and"
    " a static profile of the PTX",
    description=aot.__doc__.split("\n\n")[0],
  )
  aot.add_arguments(p)
  p.set_defaults(func=_cmd_aot, parser=p)


def _cmd_aot(args) -> int:
  # A deviceless compile: no GPU is used even where one is present (the CUDA
  # plugin would otherwise claim it at start-up).
  import jax  # pylint: disable=g-import-not-at-top

  from pallas_fa3.kernels import aot  # pylint: disable=g-import-not-at-top

  if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")
  return aot.run(args)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="pallas-fa3",
    description=(
      "FlashAttention-3 for Hopper GPUs in JAX Pallas Mosaic GPU, with a"
      " portable blockwise twin and numerics tooling."
    ),
    epilog="Run 'pallas-fa3 <command> --help' for a command's options.",
  )
  sub = parser.add_subparsers(dest="command", metavar="<command>")
  sub.required = True
  _add_info_parser(sub)
  _add_train_parser(sub)
  _add_bench_parser(sub)
  _add_numerics_parser(sub)
  _add_aot_parser(sub)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
