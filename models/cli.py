"""`python -m models train|generate` (and the aliases `pallas-fa3 train`,
`pallas-fa3 generate`): the flags and handlers of the example's commands,
`train` (fit the byte-level GPT on the standard library's sources) and
`generate` (continue prompts with a trained run); `main`, `add_parsers`.
More: docs/training.md#running-it
"""

from __future__ import annotations

import argparse
import os
import sys

# XLA flag that makes GPU reductions and autotuning deterministic (a no-op on
# CPU, which is deterministic already): two `train` runs give bitwise-equal
# losses on a GPU too.
XLA_DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
# `train` defaults: the CPU default run (docs/training.md: its time). They equal the defaults of
# models.gpt.GPTConfig / models.step.TrainConfig (tests/test_train.py
# checks), written out here so that `--help` does not import Flax.
TRAIN_MODEL_DEFAULTS = dict(
  layers=4,
  d_model=128,
  heads=2,
  kv_heads=None,
  mlp_ratio=4,
  norm="rmsnorm",
  position="rope",
  dtype="bfloat16",
  softcap=None,
  sinks=False,
  varlen=False,
)
TRAIN_DEFAULTS = dict(
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
  packed=False,
)


def parse_window_pattern(text: str) -> tuple[int | None, ...]:
  """`--window-pattern`: "64,none" -> (64, None); "" -> () (all global).

  Raises:
    argparse.ArgumentTypeError: an entry is neither an int nor "none".
  """
  pattern: list[int | None] = []
  for entry in text.split(",") if text.strip() else ():
    entry = entry.strip()
    if entry.lower() == "none":
      pattern.append(None)
      continue
    try:
      pattern.append(int(entry))
    except ValueError:
      raise argparse.ArgumentTypeError(
        f"window pattern entries are ints (left windows) or 'none'"
        f" (global); got {entry!r} in {text!r}"
      ) from None
  return tuple(pattern)


def add_train_parser(sub, formatter_class) -> None:
  """Adds the `train` subcommand (flags and handler) to `sub`."""
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
      " compute) on 2.05M tokens to about 2 bits/byte: 3 minutes on an"
      " idle 2-core Intel Xeon with AMX, 7.5-8.5 on an idle 2-core AMD"
      " EPYC, longer under load (docs/training.md); the same command"
      " runs unchanged on a GPU."
    ),
    formatter_class=formatter_class,
  )
  m, d = TRAIN_MODEL_DEFAULTS, TRAIN_DEFAULTS
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
    "--window-pattern",
    type=parse_window_pattern,
    default=None,  # GPTConfig's (): every block global
    metavar="W,W,...",
    help=(
      "causal sliding windows by block, repeated over the blocks: block i"
      " sees the W[i %% len] previous tokens and itself; 'none' = global,"
      " e.g. 64,none alternates local and global blocks (unset: every"
      " block global)"
    ),
  )
  model.add_argument(
    "--softcap",
    type=float,
    default=m["softcap"],
    help="attention logit softcap c > 0: scores -> c*tanh(s/c) (unset: off)",
  )
  model.add_argument(
    "--sinks",
    action=argparse.BooleanOptionalAction,
    default=m["sinks"],
    help="a learnable attention sink logit per head",
  )
  model.add_argument(
    "--varlen",
    action=argparse.BooleanOptionalAction,
    default=m["varlen"],
    help=(
      "with --packed: attention as one flash_attention_varlen call over the"
      " batch's documents (cu_seqlens) instead of segment ids"
    ),
  )
  model.add_argument(
    "--implementation",
    default="auto",
    choices=("auto", "blockwise", "reference", "mosaic", "interpret"),
    help="flash_attention backend (auto: the automatic choice)",
  )
  opt = p.add_argument_group("training (models.step.TrainConfig)")
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
    "--packed",
    action=argparse.BooleanOptionalAction,
    default=d["packed"],
    help=(
      "packed batches: whole or cut stdlib files side by side in each"
      " sequence, attention (segment ids) and loss kept within each file"
    ),
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
    help=f"add {XLA_DETERMINISTIC} to XLA_FLAGS (GPU bitwise reproducibility)",
  )
  run.add_argument(
    "--objective",
    choices=("lm", "meanflow"),
    default="lm",
    help=(
      "lm: the byte-level language model; meanflow: the MeanFlow toy"
      " (models.meanflow: jvp through every attention layer, continuous"
      " sines; it reads --steps, --batch, --seed and --implementation, its"
      " sizes are MeanFlowConfig's; --steps 150 runs in about a minute on"
      " 2 CPU cores)"
    ),
  )
  p.set_defaults(func=run_train, parser=p)


def train_configs(args):
  """`(GPTConfig, TrainConfig)` from the parsed flags."""
  from models.gpt import GPTConfig  # pylint: disable=g-import-not-at-top
  from models.step import TrainConfig  # pylint: disable=g-import-not-at-top

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
    window_pattern=args.window_pattern or (),
    softcap=args.softcap,
    sinks=args.sinks,
    varlen=args.varlen,
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
    packed=args.packed,
  )
  return model_cfg, train_cfg


def run_meanflow(args) -> int:
  """Runs `train --objective meanflow`; returns the exit status."""
  import time  # pylint: disable=g-import-not-at-top

  from models import meanflow  # pylint: disable=g-import-not-at-top

  cfg = meanflow.MeanFlowConfig(
    steps=args.steps,
    batch_size=args.batch,
    seed=args.seed,
    implementation=None
    if args.implementation == "auto"
    else args.implementation,
  )
  start = time.perf_counter()
  model, losses = meanflow.train_meanflow(cfg)
  print(
    f"meanflow: {cfg.steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f};"
    f" one-step sample error {meanflow.sample_error(model, cfg):.3f};"
    f" {time.perf_counter() - start:.1f} s wall"
  )
  return 0


def run_train(args) -> int:
  """Runs `train`; returns the exit status."""
  if args.objective == "meanflow":
    return run_meanflow(args)
  if args.deterministic and XLA_DETERMINISTIC not in os.environ.get(
    "XLA_FLAGS", ""
  ):
    # Read when the JAX backend starts, which has not happened yet here.
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " " + XLA_DETERMINISTIC
    ).strip()
  # First: `train_configs` imports models.step, which imports optax too.
  try:
    from models.train import SUMMARY_FILE, train  # pylint: disable=g-import-not-at-top
  except ModuleNotFoundError as e:
    top = (e.name or "").partition(".")[0]
    if top not in ("optax", "orbax"):
      raise
    print(
      f"{args.parser.prog}: error: it needs {top} (the train extra): pip"
      " install 'pallas-fa3[train]' (in a checkout: pip install -e"
      " '.[train]')",
      file=sys.stderr,
    )
    return 1

  try:
    model_cfg, train_cfg = train_configs(args)
  except (TypeError, ValueError) as e:
    args.parser.error(str(e))

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
    print(f"{args.parser.prog}: error: {e}", file=sys.stderr)
    return 1
  speed = summary["tokens_per_s"]
  print(
    f"step {summary['final_step']}/{train_cfg.steps}: val"
    f" {summary['init_val_bpb']:.3f} -> {summary['final_val_bpb']:.3f}"
    f" bits/byte; {summary['num_params']:,} params;"
    f" {summary['wall_time_s']:.1f} s wall"
    + (f"; {speed:,.0f} tokens/s" if speed else "")
    + ("; packed" if summary["packed"] else "")
  )
  print(f"summary: {os.path.join(args.out, SUMMARY_FILE)}")
  return 0


GENERATE_DEFAULTS = dict(
  max_new_tokens=200,
  temperature=0.0,
  seed=0,
  dtype="float32",
)


def add_generate_parser(sub, formatter_class) -> None:
  """Adds the `generate` subcommand (flags and handler) to `sub`."""
  d = GENERATE_DEFAULTS
  p = sub.add_parser(
    "generate",
    help="continue text prompts with a model trained by `pallas-fa3 train`",
    description=(
      "Continue each --prompt with the byte-level GPT of a `pallas-fa3"
      " train --out DIR` run: a prefill of the prompts with flash_attention,"
      " then one jitted decode step per token over the layers' KV caches"
      " (flash_attention_with_kvcache). Prints each continuation on stdout"
      " (with a header line per prompt when there are several) and the"
      " prefill and decode tokens/s on stderr (compilation timed apart)."
      " --no-cache recomputes the whole sequence for every token instead:"
      " with --temperature 0 it prints the same text."
    ),
    formatter_class=formatter_class,
  )
  p.add_argument(
    "--checkpoint",
    required=True,
    metavar="DIR",
    help="a `pallas-fa3 train --out` folder (its newest checkpoint), its"
    " checkpoints/ folder, or one checkpoint inside it",
  )
  p.add_argument(
    "--prompt",
    action="append",
    required=True,
    metavar="TEXT",
    help="a prompt (repeat for a batch of prompts of any lengths)",
  )
  p.add_argument(
    "--max-new-tokens",
    type=int,
    default=d["max_new_tokens"],
    metavar="N",
    help="bytes to generate per prompt",
  )
  p.add_argument(
    "--temperature",
    type=float,
    default=d["temperature"],
    metavar="T",
    help="0: greedy; > 0: sample from softmax(logits / T)",
  )
  p.add_argument(
    "--top-k",
    type=int,
    metavar="K",
    help="sample among the K most likely bytes (unset: all)",
  )
  p.add_argument(
    "--top-p",
    type=float,
    metavar="P",
    help="sample among the most likely bytes up to probability P (unset: all)",
  )
  p.add_argument(
    "--seed", type=int, default=d["seed"], metavar="S", help="sampling seed"
  )
  p.add_argument(
    "--no-cache",
    action="store_true",
    help="recompute the whole sequence for every token (the check)",
  )
  p.add_argument(
    "--slots",
    type=int,
    metavar="N",
    help="serve the prompts as a continuous batch of N cache rows: a freed"
    " row's next prompt is prefilled beside the others' decode steps, one"
    " ragged kvcache call per layer and step (unset: one batch)",
  )
  p.add_argument(
    "--dtype",
    default=d["dtype"],
    choices=("float32", "bfloat16"),
    help="compute dtype (the parameters are the checkpoint's; the Hopper"
    " kernels take bfloat16, float32 runs the blockwise twin)",
  )
  p.add_argument(
    "--implementation",
    default="auto",
    choices=("auto", "blockwise", "reference", "mosaic", "interpret"),
    help="attention backend (auto: the trained model's choice)",
  )
  p.set_defaults(func=run_generate, parser=p)


def _error(args, message: str) -> int:
  print(f"{args.parser.prog}: error: {message}", file=sys.stderr)
  return 1


def run_generate(args) -> int:
  """Runs `generate`; returns the exit status."""
  from models.generate import generate  # pylint: disable=g-import-not-at-top
  from models.restore import load_model  # pylint: disable=g-import-not-at-top
  from models.sampling import Sampling  # pylint: disable=g-import-not-at-top

  if args.max_new_tokens < 1:
    args.parser.error(
      f"--max-new-tokens must be >= 1; got {args.max_new_tokens}"
    )
  if args.slots is not None and (args.slots < 1 or args.no_cache):
    args.parser.error(
      f"--slots must be >= 1 and needs the KV cache; got {args.slots}"
      + (" with --no-cache" if args.no_cache else "")
    )
  try:
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
  except ValueError as e:
    args.parser.error(str(e).replace("Sampling.", "--").replace("_", "-"))
  prompts = [text.encode("utf-8") for text in args.prompt]
  try:
    model, info = load_model(
      args.checkpoint,
      dtype=args.dtype,
      max_seq_len=max(len(p) for p in prompts) + args.max_new_tokens,
      implementation=args.implementation,
    )
    out = generate(
      model,
      prompts,
      max_new_tokens=args.max_new_tokens,
      sampling=sampling,
      use_cache=not args.no_cache,
      slots=args.slots,
    )
  except (FileNotFoundError, NotImplementedError, ValueError) as e:
    return _error(args, str(e))
  for i, (text, tokens) in enumerate(zip(args.prompt, out.tokens)):
    if len(prompts) > 1:
      print(f"=== prompt {i}: {text!r} ===")
    print(bytes(tokens).decode("utf-8", errors="replace"))
  mode = "recomputed (--no-cache)" if args.no_cache else "KV cache"
  if args.slots is not None:
    mode += f", a continuous batch of {args.slots} rows"
  print(
    f"step {info['step']} of {info['checkpoint']}; {len(prompts)} prompt(s),"
    f" {args.dtype}, {mode}\n"
    f"prefill: {out.prompt_tokens} tokens in {out.prefill_s:.3f} s"
    f" ({out.prefill_tokens_per_s:,.0f} tokens/s)\n"
    f"decode: {sum(len(t) - 1 for t in out.tokens)} tokens in"
    f" {out.decode_s:.3f} s ({out.decode_tokens_per_s:,.0f} tokens/s);"
    f" compilation {out.compile_s:.1f} s",
    file=sys.stderr,
  )
  return 0


def add_parsers(sub, formatter_class=argparse.ArgumentDefaultsHelpFormatter):
  """Adds `train` and `generate` to the subparsers `sub`."""
  add_train_parser(sub, formatter_class)
  add_generate_parser(sub, formatter_class)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m models",
    description="Train the example GPT, or generate with a trained run.",
  )
  sub = parser.add_subparsers(dest="command", metavar="<command>")
  sub.required = True
  add_parsers(sub)
  args = parser.parse_args(argv)
  return args.func(args)
