"""Cases the default run leaves to `-m slow` (issue 31: CI in 15 minutes on
2 cores), each beside the default-run case that runs the same code.
`tests/conftest.py` marks them; one that no longer names a collected case
is an error, so a renamed case cannot slip back in or vanish silently.

Most of the kernels' interpret cases cost seconds each in the interpreter's
callbacks; the ones here repeat a config feature (stages, consumers, head
splits, a dtype) another default case already runs. Every kernel path still
runs in interpret mode in the default run. The CUDA lowering cases here
lower kernels another default case lowers (or the aot tier compiles), and
the 8-device cases repeat a feature of another 8-device case.
"""

from __future__ import annotations

SLOW_CASES = {
  # -- kernels, interpret mode ---------------------------------------------
  "tests/test_sm90_bwd.py::test_interpret_gradients_match_golden"
  "[b1_q200_kv260_h1/1_d64-float16-causal-64x64x3-c1h1q2h1]":
  # one consumer: the d128 c1h1 case; 3 stages, float16: the d192 case
  "d128 c1h1q2h1, d192 float16 64x64x3",
  "tests/test_sm90_bwd.py::test_interpret_gradients_match_golden"
  "[b1_q200_kv260_h2/1_d128-float16-causal-64x64x3-c2h2q2h1]":
  # head splits: the d256 and d192 c2h2 cases
  "d256 c2h2q2h2, d192 c2h2q2h2",
  "tests/test_sm90_fwd.py::test_interpret_matches_golden"
  "[b1_q200_kv330_h2/1_d64-bfloat16-full-64x64x2]":
  # not causal: test_interpret_is_the_blockwise_function, interpret paths
  "test_interpret_is_the_blockwise_function",
  "tests/test_sm90_fwd.py::test_interpret_matches_golden"
  "[b1_q130_kv400_h2/1_d64-float16-causal-64x64x3]":
  # 3 stages: 64x128x3; float16: 128x64x4
  "64x128x3, float16 128x64x4",
  "tests/test_sm90_fused_bwd.py::test_fused_interpret_gradients_match_golden"
  "[b1_q100_kv260_h1/1_d96-bfloat16-causal-64x64x2-c2h1q2h1]":
  # d96 is the d64/d128 code at another width (lowered, and compiled by aot)
  "d64 and d128 c2h1q2h1",
  "tests/test_head_dim_v.py::test_interpret_against_float64_golden"
  "[128-64-full-det-fp16]":
  # dK/dV + dQ with dv != d: 64-128-causal-det; not causal: 256-128-full
  "64-128-causal-det, 256-128-full",
  "tests/test_modifiers_kernels.py::test_interpret_against_float64_golden"
  "[b1_q256_kv256_h4/2_d64-causal-float64-3.0-full-full]":
  # softcap, causal, fused: the window + softcap + sinks case
  "b1_q384_kv256 (all three, fused)",
  "tests/test_fp8_quant_kernel.py::test_interpret_kernel_gives_the_twins_bits"
  "[128-64-128-256-bfloat16-True]": "128-64-128-200 (no rotation), 128-128-64-190 (rotation, partial tile)",
  "tests/test_fp8_quant_kernel.py::test_interpret_kernel_gives_the_twins_bits"
  "[64-64-128-300-bfloat16-True]": "64-64-256-100 (d64, rotation)",
  "tests/test_head_dim_v.py::test_interpret_against_float64_golden"
  "[256-128-full]": "64-128-causal-det (dK/dV + dQ with dv != d); test_sm90_bwd d256 c2h2q2h2 (the d256 head splits); the aot tier compiles 256/128",
  "tests/test_large_logits.py::"
  "test_finite_scaled_scores_give_finite_correct_results[full-interpret]": "[causal-interpret] (the kernels at every scale), [full-blockwise] (not causal)",
  # -- CUDA lowering and the deviceless compile -----------------------------
  "tests/test_head_dim_v.py::test_grad_through_mosaic_lowers_to_the_kernels"
  "[256-128-fused]": "[256-128-det] (d256 is never fused: the same three kernels)",
  "tests/test_head_dim_v.py::test_grad_through_mosaic_lowers_to_the_kernels"
  "[128-64-fused]": "[192-128-fused] (fused, dv < d); the aot tier compiles 128/64's fused default",
  "tests/test_fp8_modifiers.py::test_mosaic_lowers_with_every_option[window]": "[all]",
  "tests/test_fp8_modifiers.py::test_mosaic_lowers_with_every_option[softcap]": "[all]",
  "tests/test_fp8_modifiers.py::test_mosaic_lowers_with_every_option[sinks]": "[all]",
  "tests/test_fp8_modifiers.py::test_mosaic_lowers_with_every_option"
  "[segment_ids]": "[all]",
  "tests/test_sm90_bwd.py::test_grad_of_mosaic_exports_for_cuda[96]": "test_every_backward_config_lowers_for_cuda d96 (the kernels); [64], [128] (the API route)",
  "tests/test_sm90_bwd.py::test_grad_of_mosaic_exports_for_cuda[192]": "test_every_backward_config_lowers_for_cuda d192 (the kernels); [256] (the API route, head splits)",
  "tests/test_sm90_fused_bwd.py::test_grad_and_vmap_of_mosaic_lower_to_two_kernels"
  "[64]": "[128]",
  "tests/test_sm90_fused_bwd.py::test_grad_and_vmap_of_mosaic_lower_to_two_kernels"
  "[192]": "[128]; test_every_fused_config_lowers_to_one_kernel d192",
  "tests/test_segments_kernels.py::test_grad_through_mosaic_lowers_with_segment_ids"
  "[128-False]": "[64-False] (fused), [128-True]",
  "tests/test_segments_kernels.py::test_grad_through_mosaic_lowers_with_segment_ids"
  "[64-True]": "[128-True] (deterministic), [64-False]",
  "tests/test_sm90_aot.py::test_aot_flags_a_compiled_oversubscribed_split": "test_register_pool_check (the check on PTX); test_default_configs_compile_without_spills (the check on every compiled default)",
  "tests/test_sm90_aot.py::test_fp8_call_temporaries_stay_below_its_arguments"
  "[128]": "[256]",
  # -- the 8-device suites (tests/test_scale_out.py) -----------------------
  "tests/multidevice/check_ring_attention.py::test_ring_matches_single_device"
  "[4-full]": "[2-full]; [4-causal] (ring 4, run twice: bit-identical)",
  "tests/multidevice/check_ring_attention.py::test_ring_matches_single_device"
  "[8-full]": "[2-full], [8-causal]",
  "tests/multidevice/check_ring_modifiers.py::test_ring_with_modifiers"
  "[window-causal-4]": "all-causal-8 (causal + window), check_ring_attention [4-causal]",
  "tests/multidevice/check_ring_modifiers.py::test_ring_with_modifiers"
  "[window-right-4]": "window-both-8 (a right window, not causal), test_window_with_unequal_lengths[cross-4] (ring 4)",
  "tests/multidevice/check_ring_attention.py::test_ring_matches_single_device"
  "[2-causal]": "[2-full] (ring 2), [4-causal], [8-causal]",
  "tests/multidevice/check_ring_attention.py::test_ring_float32_mqa": "check_ring_segments::test_segment_skip_never_touches_a_shard_no_query_meets[causal] (float32, causal ring); check_sequence_sharded [seq8-causal-gqa] (kv heads shared)",
  "tests/multidevice/check_ring_segments.py::"
  "test_segment_skip_never_touches_a_shard_no_query_meets[full]": "[causal] (the skip); test_segment_skip_is_a_cond_around_every_step[full]",
  "tests/multidevice/check_sharded_attention.py::"
  "test_window_softcap_sinks_shard_over_batch_and_heads[True]": "[False]; test_explicit_mesh_axes",
  "tests/multidevice/check_ring_modifiers.py::test_ring_with_modifiers"
  "[sinks-full-4]": "sinks-causal-8, all-causal-8",
  "tests/multidevice/check_ring_modifiers.py::test_ring_with_modifiers"
  "[window-causal-8]": "all-causal-8 (window (24, None), causal, 8)",
  "tests/multidevice/check_ring_modifiers.py::test_ring_with_modifiers"
  "[softcap-causal-4]": "all-causal-8, softcap-full-8",
  "tests/multidevice/check_ring_modifiers.py::test_ring_with_modifiers"
  "[sinks-causal-8]": "all-causal-8",
  "tests/multidevice/check_ring_segments.py::test_ring_with_segment_ids"
  "[full]": "full-cross-padded",
  "tests/multidevice/check_ring_segments.py::test_ring_with_segment_ids"
  "[causal-padded]": "causal-zigzag, full-cross-padded",
  "tests/multidevice/check_ulysses.py::test_ulysses_matches_golden"
  "[mqa-causal-4]": "gqa-causal-8, head-axes-reference (kv repeated 4x)",
  "tests/multidevice/check_ring_segments.py::test_ring_with_segment_ids"
  "[causal-batch-axes]": "check_ring_window::test_window_with_batch_axes",
  "tests/multidevice/check_ring_window.py::test_window_with_batch_axes"
  "[explicit]": "[auto]; check_ring_attention::test_explicit_mesh_axes",
  "tests/multidevice/check_ring_window.py::test_window_with_segment_ids"
  "[causal]": "[both-zigzag]",
  "tests/multidevice/check_sequence_sharded.py::"
  "test_sequence_sharded_flash_attention_runs_the_ring[batch-seq-full-cross]": "seq8-causal-gqa; check_ring_segments [full-cross-padded]",
  "tests/multidevice/check_sequence_sharded.py::"
  "test_sequence_sharded_flash_attention_runs_the_ring[modifiers-batch-seq]": "modifiers-seq8-explicit",
  "tests/multidevice/check_sharded_attention.py::"
  "test_sharded_matches_single_device[2x4_batch_heads]": "[1x8_heads], [8x1_batch_mqa]",
  "tests/multidevice/check_ulysses.py::test_ulysses_matches_golden"
  "[mha-full-8]": "gqa-causal-8, modifiers-cross-4",
  "tests/multidevice/check_ring_attention.py::test_ring_with_batch_or_head_axes"
  "[batch]": "check_ring_window::test_window_with_batch_axes[auto]",
}
