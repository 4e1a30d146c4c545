"""`pallas-fa3 generate`: the flags and the handler of the generation command.

Continues text prompts with a model trained by `pallas-fa3 train` (the
byte-level GPT of `models/`, from a source checkout): the prompts' bytes
are the tokens, each continuation is printed on stdout, the prefill and
decode rates on stderr. `models` (Flax, orbax) is imported only when the
command runs.
"""

from __future__ import annotations

import sys

from pallas_fa3 import example_models

GENERATE_DEFAULTS = dict(
  max_new_tokens=200,
  temperature=0.0,
  seed=0,
  dtype="float32",
)


def add_parser(sub, formatter_class) -> None:
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


def _error(message: str) -> int:
  print(f"pallas-fa3 generate: error: {message}", file=sys.stderr)
  return 1


def run_generate(args) -> int:
  """Runs `pallas-fa3 generate`; returns the exit status."""
  try:
    example_models.require_models("pallas-fa3 generate")
  except ImportError as e:
    return _error(str(e))
  from models.generate import generate  # pylint: disable=g-import-not-at-top
  from models.restore import load_model  # pylint: disable=g-import-not-at-top
  from models.sampling import Sampling  # pylint: disable=g-import-not-at-top

  if args.max_new_tokens < 1:
    args.parser.error(
      f"--max-new-tokens must be >= 1; got {args.max_new_tokens}"
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
    )
  except (FileNotFoundError, NotImplementedError, ValueError) as e:
    return _error(str(e))
  for i, (text, tokens) in enumerate(zip(args.prompt, out.tokens)):
    if len(prompts) > 1:
      print(f"=== prompt {i}: {text!r} ===")
    print(bytes(tokens).decode("utf-8", errors="replace"))
  mode = "recomputed (--no-cache)" if args.no_cache else "KV cache"
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
