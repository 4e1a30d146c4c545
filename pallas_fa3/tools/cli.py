"""`pallas-fa3`: the command line, one subcommand per tool: `info` (the
machine, JAX, whether a Hopper GPU is present, which backend the automatic
choice picks for a sample call and why, and unless `--no-run` that call
checked against the float64 golden), `train` and `generate` (`python -m
models train|generate` from a source checkout: docs/training.md,
docs/generation.md), `bench` (docs/benchmarks.md), `numerics`
(docs/numerics.md) and `aot`, the deviceless sm_90a compile:
docs/kernels.md#verification-without-a-gpu.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence

from pallas_fa3.tools import example_models

_SAMPLE_HELP = "sample call used to show the automatic choice"


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
  g = p.add_argument_group(
    "explain a call",
    "--explain prints pallas_fa3.explain for the described call (shapes"
    " above) with these options, without running anything",
  )
  g.add_argument("--explain", action="store_true", help="explain the call")
  g.add_argument(
    "--implementation",
    choices=("mosaic", "interpret", "blockwise", "reference"),
    help="as flash_attention's (default: the automatic choice)",
  )
  g.add_argument("--head-dim-v", type=int, help="v's head dim (default d)")
  g.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"))
  g.add_argument("--softcap", type=float)
  g.add_argument("--deterministic", action="store_true")
  g.add_argument(
    "--segment-ids",
    action="store_true",
    help="packed documents as segment ids (documents of seq/4 tokens)",
  )
  g.add_argument("--alibi", action="store_true", help="an ALiBi score_mod")
  g.add_argument(
    "--learnable",
    action="store_true",
    help="with --alibi: the slopes learnable (traced, with a gradient)",
  )
  g.add_argument(
    "--document-mask",
    type=int,
    metavar="TOKENS",
    help="a document mask_mod, documents of TOKENS tokens",
  )
  g.add_argument(
    "--bias",
    choices=("head", "batch-head"),
    help="a float32 bias [1|b, hq, sq, skv]",
  )
  g.add_argument(
    "--shard-batch", type=int, help="q, k, v batch split over N devices"
  )
  g.add_argument(
    "--shard-heads", type=int, help="q, k, v heads split over N devices"
  )
  p.set_defaults(func=_cmd_info, parser=p)


def _explain(args) -> str:
  """pallas_fa3.explain of the call `info --explain` describes."""
  import jax
  import numpy as np
  from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

  import pallas_fa3
  from pallas_fa3 import mods

  b, hq, hk, d = args.batch, args.heads_q, args.heads_kv, args.head_dim
  dv = args.head_dim_v or d
  mesh_axes, sizes = [], []
  for name, n in (("batch", args.shard_batch), ("heads", args.shard_heads)):
    if n:
      mesh_axes.append(name)
      sizes.append(n)
  sharding = None
  if mesh_axes:
    mesh = AbstractMesh(
      tuple(sizes), tuple(mesh_axes), axis_types=(AxisType.Auto,) * len(sizes)
    )
    entry = lambda a: a if a in mesh_axes else None
    sharding = NamedSharding(
      mesh, PartitionSpec(entry("batch"), None, entry("heads"))
    )
  sds = lambda shape, dtype=args.dtype: jax.ShapeDtypeStruct(
    shape, dtype, sharding=sharding
  )
  q = sds((b, args.seq_q, hq, d))
  k = sds((b, args.seq_kv, hk, d))
  v = sds((b, args.seq_kv, hk, dv))
  kw = dict(causal=args.causal, implementation=args.implementation)
  if args.window:
    kw["window_size"] = tuple(args.window)
  if args.softcap:
    kw["softcap"] = args.softcap
  if args.deterministic:
    kw["deterministic"] = True
  if args.segment_ids:
    ids = lambda n: jax.ShapeDtypeStruct((b, n), np.int32)
    kw["segment_ids"] = (ids(args.seq_q), ids(args.seq_kv))
  if args.bias:
    nb = b if args.bias == "batch-head" else 1
    kw["bias"] = jax.ShapeDtypeStruct(
      (nb, hq, args.seq_q, args.seq_kv), np.float32
    )

  if args.document_mask:
    n = max(args.seq_q, args.seq_kv)
    ids = np.arange(n, dtype=np.int32)[None].repeat(b, 0) // args.document_mask
    kw["mask_mod"] = mods.document_mask(
      ids[:, n - args.seq_q :], ids[:, n - args.seq_kv :]
    )

  def explain(slopes):
    if args.alibi:
      kw["score_mod"] = mods.alibi(slopes)
    return pallas_fa3.explain(q, k, v, **kw)

  slopes = np.asarray(mods.alibi_slopes(hq), np.float32)
  if args.learnable:  # traced: a gradient in the backward
    out = {}

    def traced(s):
      out["text"] = explain(s)
      return s

    jax.eval_shape(traced, slopes)
    return out["text"]
  return explain(slopes)


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
  if args.explain:
    try:
      text = _explain(args)
    except (TypeError, ValueError, NotImplementedError) as e:
      args.parser.error(f"the call cannot run: {e}")
    print("\n" + text)
    return 0
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


def _add_model_parsers(sub) -> None:
  """`train` and `generate`: aliases of `python -m models train|generate`,
  whose flags and handlers live with the example (`models/cli.py`); without
  a checkout, commands that say so."""
  try:
    models = example_models.load("pallas-fa3 train")
  except ImportError as e:
    missing = str(e)
    for name in ("train", "generate"):
      p = sub.add_parser(
        name, help=f"{name} with the example GPT (needs a source checkout)"
      )
      # Any flags at all: the command only says why it cannot run.
      p.set_defaults(
        func=lambda args, name=name: _no_models(name, missing), any_flags=True
      )
    return
  models.cli.add_parsers(sub, HelpFormatter)


def _no_models(name: str, reason: str) -> int:
  print(f"pallas-fa3 {name}: error: {reason}", file=sys.stderr)
  return 1


def _add_bench_parser(sub, summary: str) -> None:
  from pallas_fa3.tools.bench import command  # pylint: disable=g-import-not-at-top

  p = command.add_parser(sub, HelpFormatter, summary)  # flags: the harness's
  p.set_defaults(func=_cmd_bench, parser=p)


def _cmd_bench(args) -> int:
  from pallas_fa3.tools.bench import command  # pylint: disable=g-import-not-at-top

  return command.run(args)


def _add_numerics_parser(sub) -> None:
  from pallas_fa3.tools.numerics import cli_args  # pylint: disable=g-import-not-at-top

  cli_args.add_parser(sub)  # flags and the run live with the studies


def _add_aot_parser(sub, summary: str) -> None:
  from pallas_fa3.tools.aot import command as aot  # pylint: disable=g-import-not-at-top

  p = sub.add_parser(
    "aot", help=summary, description=aot.__doc__.split("\n\n")[0]
  )
  aot.add_arguments(p)
  p.set_defaults(func=_cmd_aot, parser=p)


def _cmd_aot(args) -> int:
  # A deviceless compile: no GPU is used even where one is present (the CUDA
  # plugin would otherwise claim it at start-up).
  import jax  # pylint: disable=g-import-not-at-top

  from pallas_fa3.tools.aot import command as aot  # pylint: disable=g-import-not-at-top

  if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")
  return aot.run(args)


# The subcommands whose flags import JAX to be built (bench's help reads its
# registries of implementations and grids; aot's, its sweeps), by name: their
# one-line help and what builds their flags. `main` builds only the one its
# argv runs, so `pallas-fa3 --help` and the others' help import no JAX.
_HEAVY = {
  "bench": (
    "performance harness: TFLOPs/s, memory, CSV/JSON/PNG",
    _add_bench_parser,
  ),
  "aot": (
    "compile the sm90 kernels for sm_90a on a CPU: spills and"
    " a static profile of the PTX",
    _add_aot_parser,
  ),
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
  """The `pallas-fa3` parser, every subcommand's flags included; with `argv`,
  of `bench` and `aot` only the one that `argv` runs gets its flags (the
  other is listed by its one-line help), as their flags import JAX."""
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
  _add_model_parsers(sub)
  _add_heavy_parser(sub, "bench", argv)
  _add_numerics_parser(sub)
  _add_heavy_parser(sub, "aot", argv)
  return parser


def _add_heavy_parser(sub, name: str, argv: Sequence[str] | None) -> None:
  """`name`'s parser with its flags where `argv` is None or runs `name`,
  else one without (listed by its one-line help)."""
  summary, add = _HEAVY[name]
  # The top-level parser has no option that takes a value: the first word
  # that is no option names the command.
  if argv is None or name == next((a for a in argv if a[:1] != "-"), None):
    add(sub, summary)
  else:
    sub.add_parser(name, help=summary)


def main(argv: Sequence[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = build_parser(argv)
  args, unknown = parser.parse_known_args(argv)
  if unknown and not getattr(args, "any_flags", False):
    parser.error(f"unrecognized arguments: {' '.join(unknown)}")
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
