"""The flags of `pallas-fa3 numerics <study>` and their mapping onto the
configs, kept free of JAX work so that `--help` is fast: every flag maps
onto one field of the study's frozen config, and a value the config
rejects is reported as a usage error naming the flag: docs/numerics.md.
"""

from __future__ import annotations

import argparse
import functools
import re
from typing import Any

_DTYPES = ("bfloat16", "float16", "float32")
_DISTS = ("normal", "outliers")


def _tile(text: str) -> tuple[int, int]:
  m = re.fullmatch(r"(\d+)[xX](\d+)", text)
  if not m:
    raise argparse.ArgumentTypeError(
      f"a tile is BRxBC, e.g. 64x128; got {text!r}"
    )
  return int(m.group(1)), int(m.group(2))


# study -> [(flag, config field, argparse kwargs)]; unset flags (None) keep
# the platform default (the config's), which the help shows
# (`_DefaultsFormatter`).
_FLAGS = {
  "deviation": [
    (
      "--seq",
      "seqs",
      dict(nargs="+", type=int, help="sequence lengths of the sequence sweep"),
    ),
    (
      "--head-dim",
      "head_dims",
      dict(nargs="+", type=int, help="head dims of the sequence sweep"),
    ),
    (
      "--dist",
      "distributions",
      dict(nargs="+", choices=_DISTS, help="input distributions"),
    ),
    ("--dtype", "dtypes", dict(nargs="+", choices=_DTYPES, help="formats F")),
    (
      "--mode",
      "modes",
      dict(
        nargs="+",
        choices=("all", "kernel"),
        help="all intermediates in F, kernel-like",
      ),
    ),
    (
      "--tile",
      "tile",
      dict(type=_tile, help="Br x Bc of the sequence sweep, e.g. 64x64"),
    ),
    (
      "--tiles",
      "tiles",
      dict(
        nargs="+",
        type=_tile,
        help="tiles of the tile sweep, e.g. 64x64 32x128 128x32",
      ),
    ),
    (
      "--tile-seq",
      "tile_seq",
      dict(type=int, help="sequence length of the tile sweep"),
    ),
    (
      "--tile-head-dim",
      "tile_head_dim",
      dict(type=int, help="head dim of the tile sweep"),
    ),
    (
      "--tile-dtype",
      "tile_dtypes",
      dict(nargs="+", choices=_DTYPES, help="formats of the tile sweep"),
    ),
    ("--batch", "batch", dict(type=int, help="batch of every case")),
    ("--heads", "heads", dict(type=int, help="heads of every case")),
    (
      "--kernels",
      "kernels",
      dict(
        nargs="*",
        choices=("interpret", "mosaic"),
        help="kernel backends to try (none: skip)",
      ),
    ),
    (
      "--interpret-max-seq",
      "interpret_max_seq",
      dict(type=int, help="longest sequence run through interpret"),
    ),
    ("--seed", "seed", dict(type=int, help="input seed")),
    (
      "--flash-algorithm",
      "flash_algorithm",
      dict(
        choices=("fa2", "fa1"),
        help="the all-in-F flash: fa2"
        " (normalize at the end) or fa1 (after every tile)",
      ),
    ),
  ],
  "fp8": [
    ("--batch", "batch", dict(type=int, help="batch")),
    ("--seq", "seq", dict(type=int, help="sequence length")),
    ("--heads", "heads", dict(type=int, help="heads")),
    (
      "--head-dim",
      "head_dim",
      dict(type=int, help="head dim (64, 128 or 256: the FP8 kernel's)"),
    ),
    (
      "--block-q",
      "block_q",
      dict(
        type=int,
        help="q tile of block"
        " quantization on the blockwise FP8"
        " rows (unset: the FP8 kernel's)",
      ),
    ),
    (
      "--block-kv",
      "block_kv",
      dict(
        type=int,
        help="k/v tile of block"
        " quantization on the blockwise FP8"
        " rows (unset: the FP8 kernel's)",
      ),
    ),
    (
      "--kernels",
      "kernels",
      dict(
        nargs="*",
        choices=("interpret", "mosaic"),
        help="kernel backends to try",
      ),
    ),
    (
      "--interpret-max-seq",
      "interpret_max_seq",
      dict(type=int, help="longest sequence run through interpret"),
    ),
    ("--seed", "seed", dict(type=int, help="input and rotation seed")),
  ],
  "divergence": [
    ("--steps", "steps", dict(type=int, help="training steps per run")),
    ("--interval", "interval", dict(type=int, help="compare every N steps")),
    ("--layers", "layers", dict(type=int, help="transformer blocks")),
    ("--d-model", "d_model", dict(type=int, help="residual width")),
    ("--heads", "heads", dict(type=int, help="attention heads")),
    ("--seq-len", "seq_len", dict(type=int, help="bytes per sequence")),
    ("--batch", "batch", dict(type=int, help="sequences per step")),
    ("--lr", "lr", dict(type=float, help="peak learning rate")),
    ("--warmup-steps", "warmup_steps", dict(type=int, help="warmup steps")),
    ("--seed", "seed", dict(type=int, help="init seed (R2: seed + 1)")),
    ("--data-seed", "data_seed", dict(type=int, help="batch order seed")),
    (
      "--max-bytes",
      "max_bytes",
      dict(type=int, help="corpus bytes read (a default of none: all)"),
    ),
    (
      "--flash-impl",
      "flash_implementation",
      dict(
        choices=("auto", "blockwise", "mosaic", "interpret"),
        help="R1's attention backend",
      ),
    ),
  ],
  "bias": [
    ("--rows", "rows", dict(type=int, help="independent score rows")),
    ("--keys", "keys", dict(type=int, help="entries per row")),
    ("--head-dim", "head_dim", dict(type=int, help="features of V")),
    (
      "--ties",
      "ties",
      dict(nargs="+", type=int, help="tied maxima per row (1: control)"),
    ),
    (
      "--max-range",
      "max_range",
      dict(
        nargs=2, type=float, metavar=("LO", "HI"), help="row max ~ U(LO, HI)"
      ),
    ),
    (
      "--gap",
      "gap",
      dict(
        nargs=2,
        type=float,
        metavar=("LO", "HI"),
        help="other scores = max - U(LO, HI)",
      ),
    ),
    ("--v-mean", "v_mean", dict(type=float, help="mean of V")),
    ("--v-std", "v_std", dict(type=float, help="std of V")),
    ("--beta", "beta", dict(type=float, help="stable_max beta")),
    (
      "--tie-tolerance",
      "tie_tolerance",
      dict(type=float, help="stable_max tie tolerance"),
    ),
    (
      "--dtype",
      "dtype",
      dict(choices=("bfloat16", "float16"), help="format of P and the output"),
    ),
    ("--seed", "seed", dict(type=int, help="input seed")),
  ],
}
_HELP = {
  "deviation": "forward deviation vs a float64 golden (Golden et al. 2024)",
  "fp8": "the FA3 paper's FP8 error table (RMSE vs float64)",
  "divergence": "weight divergence of GPT runs (max |dW|, Wasserstein-1)",
  "bias": "the repeated-max rounding bias and the stable_max fix",
  "all": "every study with its platform default",
}
_TUPLE_FIELDS = (
  "seqs",
  "head_dims",
  "distributions",
  "dtypes",
  "modes",
  "tiles",
  "tile_dtypes",
  "kernels",
  "ties",
  "max_range",
  "gap",
)


@functools.cache
def _platform_defaults(study: str) -> tuple[Any, Any]:
  """(CPU, GPU) default config of a study (imports its module, and JAX)."""
  from pallas_fa3.tools.numerics import command  # pylint: disable=g-import-not-at-top

  return (
    command.default_config(study, gpu=False),
    command.default_config(study, gpu=True),
  )


def _shown(value: Any, tiles: bool) -> str:
  """A config value as the flag takes it: `1 2 3`, `64x64 32x128`, `none`."""
  if value is None:
    return "none"
  if tiles:
    pairs = [value] if isinstance(value[0], int) else value
    return " ".join(f"{a}x{b}" for a, b in pairs)
  if isinstance(value, tuple):
    return " ".join(map(str, value))
  return str(value)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows a study setting's default from the study's config, the CPU one
  and the GPU one where it differs, where argparse would show the None that
  leaves the flag unset. Read when help is printed (the configs' modules
  import JAX); a setting whose config default is None on both platforms
  says in its help what unset means."""

  study = ""

  def _get_help_string(self, action):
    fields = {field for _, field, _ in _FLAGS.get(self.study, ())}
    if action.dest not in fields or action.default is not None:
      return super()._get_help_string(action)
    cpu, gpu = (
      _shown(getattr(cfg, action.dest), action.type is _tile)
      for cfg in _platform_defaults(self.study)
    )
    if cpu == gpu == "none":
      return action.help
    shown = cpu if cpu == gpu else f"{cpu} on a CPU, {gpu} on a GPU"
    return f"{action.help} (default: {shown.replace('%', '%%')})"


def _formatter(study: str) -> type[argparse.HelpFormatter]:
  return type(
    f"_{study}DefaultsFormatter", (_DefaultsFormatter,), {"study": study}
  )


def _add_common(p) -> None:
  p.add_argument(
    "--out",
    default="numerics_out",
    help="output root; each study writes <out>/<study>/",
  )
  p.add_argument(
    "--defaults",
    choices=("auto", "cpu", "gpu"),
    default="auto",
    help="which default settings unset flags take (auto: gpu"
    " on a GPU, else cpu)",
  )
  p.add_argument(
    "--progress",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="progress bar",
  )
  p.add_argument(
    "--plots",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="write PNG plots",
  )


def add_parser(sub) -> None:
  """Registers `numerics` and its studies on the top-level subparsers."""
  p = sub.add_parser(
    "numerics",
    help="numerics studies: deviation, fp8, divergence, bias",
    description=(
      "Numerics studies, each writing <out>/<study>/ with results.json"
      " (every figure, environment header), summary.md (our numbers next"
      " to the published ones) and plots/*.png. The CPU defaults finish"
      " in minutes; on a GPU the defaults are larger, and flags select"
      " bigger runs."
    ),
  )
  studies = p.add_subparsers(dest="study", metavar="<study>")
  studies.required = True
  for study, flags in list(_FLAGS.items()) + [("all", [])]:
    sp = studies.add_parser(
      study,
      help=_HELP[study],
      description=_HELP[study],
      formatter_class=_formatter(study),
    )
    group = sp.add_argument_group(f"{study} settings (unset: the default)")
    for flag, field, kwargs in flags:
      if "choices" not in kwargs and "metavar" not in kwargs:
        kwargs = dict(
          kwargs, metavar=flag.lstrip("-").upper().replace("-", "_")
        )
      group.add_argument(flag, dest=field, **kwargs)
    _add_common(sp)
    sp.set_defaults(func=run, parser=sp)


def _overrides(args, study: str) -> dict:
  out = {}
  for _, field, _ in _FLAGS[study]:
    value = getattr(args, field, None)
    if value is not None:
      out[field] = tuple(value) if field in _TUPLE_FIELDS else value
  return out


def _flag_message(study: str, message: str) -> str:
  """Names the flag behind a config field in a validation message."""
  for flag, field, _ in _FLAGS[study]:
    if re.search(rf"\.{field}\b", message):
      return f"argument {flag}: {message}"
  return message


def configs(args) -> dict:
  """{study: config} for the parsed flags; usage error (exit 2) if invalid."""
  from pallas_fa3.tools.numerics import command  # pylint: disable=g-import-not-at-top

  gpu = None if args.defaults == "auto" else args.defaults == "gpu"
  studies = list(_FLAGS) if args.study == "all" else [args.study]
  out = {}
  for study in studies:
    try:
      out[study] = command.default_config(
        study, _overrides(args, study) if args.study != "all" else {}, gpu
      )
    except (TypeError, ValueError) as e:
      args.parser.error(_flag_message(study, str(e)))
  return out


def _argv(args) -> list[str]:
  """The flags that were set, as a command line (for the report header)."""
  out = []
  for flag, field, _ in _FLAGS.get(args.study, []):
    value = getattr(args, field, None)
    if value is None:
      continue
    values = value if isinstance(value, list) else [value]
    out.append(flag)
    out += [
      f"{v[0]}x{v[1]}" if isinstance(v, tuple) else str(v) for v in values
    ]
  if args.out != "numerics_out":
    out += ["--out", args.out]
  if args.defaults != "auto":
    out += ["--defaults", args.defaults]
  return out


def run(args) -> int:
  from pallas_fa3.backends import interpret_pool  # pylint: disable=g-import-not-at-top
  from pallas_fa3.tools.numerics import command  # pylint: disable=g-import-not-at-top

  # The studies run `interpret` where it can: enough CPU threads for the
  # interpreter, asked for before JAX's first computation (configs() looks
  # for a GPU).
  interpret_pool.reserve()
  cfgs = configs(args)
  argv = _argv(args)
  for study, cfg in cfgs.items():
    command.run(
      study,
      cfg,
      args.out,
      progress=args.progress,
      plots=args.plots,
      argv=argv,
      invoked_as=args.study,
    )
  return 0
