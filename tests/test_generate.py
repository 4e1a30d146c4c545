"""Generation with the GPT (models.generate, models.sampling, models.restore)
and `pallas-fa3 generate`.

The check of the cached path is the uncached one: with greedy decoding both
give the same tokens, for a batch of prompts of different lengths, with
windows, softcap, sinks, GQA and learned positions. The model's decode calls
(prefill + steps) give the logits of its full forward pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.checkpoint import Checkpointer
from models.generate import check_prompts, generate
from models.gpt import GPT, GPTConfig
from models.restore import find_checkpoint, load_model
from models.sampling import Sampling, sample
from models.step import TrainConfig, build_program
from pallas_fa3.testing import assert_within_tolerance
from pallas_fa3.tools import cli

TINY = GPTConfig(
  num_layers=2, d_model=32, num_heads=4, max_seq_len=32, dtype="float32"
)
MODELS = {
  "rope-gqa": dataclasses.replace(TINY, num_kv_heads=2),
  "learned-variants": dataclasses.replace(
    TINY, position="learned", window_pattern=(3, None), softcap=20.0, sinks=True
  ),
}
PROMPTS = [b"def f(x):", b"import", b"a"]  # ragged: 9, 6 and 1 tokens


def _model(cfg: GPTConfig, seed: int = 0) -> GPT:
  model = GPT(cfg, rngs=nnx.Rngs(seed))
  for block in model.blocks:  # non-zero sinks, so that they count
    if block.attn.sinks is not None:
      block.attn.sinks[...] = jnp.linspace(-1.0, 1.0, cfg.num_heads)
  return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cached_and_uncached_greedy_tokens_agree(name):
  model = _model(MODELS[name])
  cached = generate(model, PROMPTS, max_new_tokens=7)
  uncached = generate(model, PROMPTS, max_new_tokens=7, use_cache=False)
  assert cached.tokens == uncached.tokens
  assert [len(t) for t in cached.tokens] == [7] * len(PROMPTS)
  assert cached.prompt_tokens == sum(map(len, PROMPTS))
  assert cached.decode_tokens_per_s > 0 and cached.prefill_tokens_per_s > 0
  # The caches live in a copy: the model is left as it was.
  assert model.blocks[0].attn.cached_key is None


@pytest.mark.parametrize("name", sorted(MODELS))
def test_decode_calls_give_the_full_forward_logits(name, rng):
  """Prefill (ragged) + one chunk + steps == the forward pass, per sequence."""
  model = _model(MODELS[name], seed=1)
  tokens = jnp.asarray(rng.integers(0, 256, (2, 12)), jnp.int32)
  want = nnx.jit(lambda m, t: m(t))(model, tokens)
  lengths = jnp.array([5, 3])
  model.init_cache(2, 16)
  prefill = nnx.jit(
    lambda m, t, n: m(t, decode=True, prefill=True, chunk_lengths=n)
  )
  first = prefill(model, tokens[:, :5], lengths)
  # Sequence 1 kept 3 tokens: feed it from token 3, sequence 0 from 5.
  rows = jnp.arange(2)[:, None]
  step = nnx.jit(lambda m, t: m(t, decode=True))
  second = step(model, tokens[rows, lengths[:, None] + jnp.arange(2)])
  third = step(model, tokens[rows, lengths[:, None] + 2])
  for b, n in enumerate([5, 3]):
    got = jnp.concatenate([first[b, :n], second[b], third[b]])
    assert_within_tolerance(
      f"logits {b}", got, want[b, : n + 3], want[b, : n + 3]
    )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_continuous_batch_gives_each_prompt_its_own_tokens(name):
  """`slots=2` serves 4 prompts of different lengths as a continuous batch
  (a freed row's prompt prefilled beside the other row's decoding): each
  sequence's tokens equal generating it alone, greedy and sampled."""
  model = _model(MODELS[name])
  prompts = PROMPTS + [b"class A:\n  pass"]
  for sampling in (Sampling(), Sampling(temperature=1.0, top_k=50, seed=3)):
    served = generate(
      model, prompts, max_new_tokens=5, sampling=sampling, slots=2
    )
    alone = [
      generate(model, [p], max_new_tokens=5, sampling=sampling).tokens[0]
      for p in prompts
    ]
    assert served.tokens == alone
  assert served.prompt_tokens == sum(map(len, prompts))
  assert served.prefill_s > 0 and served.decode_s > 0
  with pytest.raises(ValueError, match="slots"):
    generate(model, prompts, max_new_tokens=2, slots=0)


def test_packed_decode_calls_give_the_full_forward_logits(rng):
  """A continuous batch's packed calls (`cu_seqlens`, rows 0 and 1 of 3, the
  last empty): sequence 0 prefills 5 tokens beside sequence 1's 3, then 2
  and 1 more: the forward pass's logits per sequence."""
  model = _model(MODELS["learned-variants"], seed=1)
  tokens = jnp.asarray(rng.integers(0, 256, (2, 12)), jnp.int32)
  want = nnx.jit(lambda m, t: m(t))(model, tokens)
  model.init_cache(3, 16)
  step = nnx.jit(
    lambda m, t, cu: m(t, decode=True, cu_seqlens=cu, max_seqlen_q=8)
  )
  first = step(model, jnp.concatenate([tokens[0, :5], tokens[1, :3]])[None],
               jnp.array([0, 5, 8, 8]))  # fmt: skip
  second = step(model, jnp.concatenate([tokens[0, 5:7], tokens[1, 3:4]])[None],
                jnp.array([0, 2, 3, 3]))  # fmt: skip
  got0 = jnp.concatenate([first[0, :5], second[0, :2]])
  got1 = jnp.concatenate([first[0, 5:8], second[0, 2:3]])
  for b, got in enumerate((got0, got1)):
    n = got.shape[0]
    assert_within_tolerance(f"logits {b}", got, want[b, :n], want[b, :n])
  assert model.blocks[0].attn.cache_lengths[...].tolist() == [7, 4, 0]
  with pytest.raises(ValueError, match="cu_seqlens"):
    model(tokens, decode=True, cu_seqlens=jnp.array([0, 5, 8, 8]))


def test_sampling_is_seeded():
  model = _model(MODELS["rope-gqa"])
  run = lambda s: generate(model, PROMPTS[:2], max_new_tokens=5, sampling=s)
  hot = Sampling(temperature=1.5, seed=7)
  first, again = run(hot), run(hot)
  assert first.tokens == again.tokens
  assert again.compile_s == 0  # one model, one sampling: compiled once
  assert run(dataclasses.replace(hot, seed=8)).tokens != first.tokens


def test_top_k_and_top_p_keep_the_likeliest_tokens():
  logits = jnp.log(jnp.array([[0.05, 0.5, 0.3, 0.15]] * 512))
  keys = jax.random.split(jax.random.key(0), 3)
  drawn = lambda s, key: set(np.asarray(sample(logits, key, s)).tolist())
  assert drawn(Sampling(1.0), keys[0]) == {0, 1, 2, 3}
  assert drawn(Sampling(1.0, top_k=1), keys[0]) == {1}  # greedy
  assert drawn(Sampling(1.0, top_k=2), keys[1]) == {1, 2}
  # 0.5 < 0.7 <= 0.5 + 0.3: the nucleus is the two likeliest.
  assert drawn(Sampling(1.0, top_p=0.7), keys[2]) == {1, 2}


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1.0, top_k=0), "top_k"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(top_k=5), "temperature > 0"),
    (dict(seed=1.5), "seed"),
  ],
)
def test_bad_sampling_raises_naming_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Sampling(**kwargs)


@pytest.mark.parametrize(
  "prompts, new, error, match",
  [
    ([b"ab", b""], 3, ValueError, r"prompts\[1\] is empty"),
    ([[1, 256]], 3, ValueError, r"prompts\[0\] has a token outside"),
    ([b"a" * 30], 3, ValueError, "max_seq_len 32"),
    ([b"ab"], 0, ValueError, "max_new_tokens"),
    (b"ab", 3, TypeError, "prompts"),
    ([], 3, ValueError, "prompts is empty"),
  ],
)
def test_bad_prompts_raise_naming_them(prompts, new, error, match):
  with pytest.raises(error, match=match):
    check_prompts(prompts, 256, new, 32)


# --- checkpoints and `pallas-fa3 generate` -----------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A `pallas-fa3 train --out` folder with one checkpoint (step 3) of a
  model with windows, softcap, sinks and GQA (built, not trained)."""
  cfg = dataclasses.replace(
    TINY, num_kv_heads=2, window_pattern=(4, None), softcap=30.0, sinks=True
  )
  train_cfg = TrainConfig(steps=3, batch_size=2, seq_len=32)
  state = build_program(cfg, train_cfg).init_state()
  out = tmp_path_factory.mktemp("generate") / "run"
  ckpt = Checkpointer(out / "checkpoints")
  meta = {"model_config": cfg.to_dict(), "train_config": train_cfg.to_dict()}
  ckpt.save(3, state, meta)
  ckpt.close()
  return out


def test_load_model_finds_the_checkpoint(run_dir):
  for path in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "3"):
    model, info = load_model(path, max_seq_len=64)
    assert info["step"] == 3 and model.cfg.sinks
    assert model.cfg.max_seq_len == 64  # RoPE: longer generations allowed
  with pytest.raises(FileNotFoundError, match="no such folder"):
    find_checkpoint(run_dir / "missing")
  with pytest.raises(FileNotFoundError, match="neither a run folder"):
    find_checkpoint(run_dir.parent)


def test_cli_generate_cached_and_uncached_print_the_same_text(run_dir, capsys):
  argv = ["generate", "--checkpoint", str(run_dir), "--max-new-tokens", "6"]
  argv += ["--prompt", "def f(", "--prompt", "x = 1\n"]
  assert cli.main(argv) == 0
  cached = capsys.readouterr()
  assert cli.main([*argv, "--no-cache"]) == 0
  uncached = capsys.readouterr()
  assert cached.out == uncached.out
  assert cli.main([*argv, "--slots", "1"]) == 0  # one row: one at a time
  served = capsys.readouterr()
  assert served.out == cached.out and "continuous batch of 1" in served.err
  assert cached.out.startswith("=== prompt 0: 'def f(' ===\n")
  assert cached.out.count("=== prompt") == 2
  for err in (cached.err, uncached.err):
    assert "prefill: 12 tokens" in err and "decode: 10 tokens" in err, err
    assert "tokens/s" in err


@pytest.mark.parametrize(
  "extra, code, match",
  [
    (["--top-p", "2"], 2, "--top-p"),
    (["--max-new-tokens", "0"], 2, "--max-new-tokens"),
    (["--top-k", "3"], 2, "temperature > 0"),
    (["--slots", "2", "--no-cache"], 2, "--slots"),
  ],
)
def test_cli_generate_usage_errors(run_dir, extra, code, match, capsys):
  argv = ["generate", "--checkpoint", str(run_dir), "--prompt", "a", *extra]
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == code
  assert match in capsys.readouterr().err


def test_cli_generate_without_a_checkpoint_says_so(tmp_path, capsys):
  argv = ["generate", "--checkpoint", str(tmp_path), "--prompt", "a"]
  assert cli.main(argv) == 1
  assert "neither a run folder" in capsys.readouterr().err
