"""Cases the default run leaves to `-m slow` (issue 31: CI in 15 minutes on
2 cores), each beside the default-run case that runs the same code.
`tests/conftest.py` marks them; one that no longer names a collected case
is an error, so a renamed case cannot slip back in or vanish silently.

Most of the kernels' interpret cases cost seconds each in the interpreter's
callbacks; the ones here repeat a config feature (stages, consumers, head
splits, a dtype, a layout, an option) another default case already runs.
Every kernel path still runs in interpret mode in the default run. The
twins' and the reference's cases here repeat a dtype or a mask another
default case of the same implementation runs. The CUDA lowering cases here
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
  # head splits: the d256 (bitwise) and d192 c2h2 cases
  "test_interpret_gradients_are_bitwise_deterministic_with_lse_cotangent[256-config1] (d256 c2h2q2h2), d192 c2h2q2h2",
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
  "[128-64-128-256-bfloat16-True]": "128-64-128-200 (no rotation), test_q_residual_kernel_gives_the_twins_bits_and_the_residual_is_exact (d128, rotation, partial tiles)",
  "tests/test_fp8_quant_kernel.py::test_interpret_kernel_gives_the_twins_bits"
  "[128-128-64-190-float16-True]": "test_q_residual_kernel_gives_the_twins_bits_and_the_residual_is_exact (d128, rotation, 200 rows: partial 64- and 128-row tiles); float16: 64-64-256-100; 128-row tiles: 128-64-128-200",
  "tests/test_fp8_quant_kernel.py::"
  "test_interpret_attention_on_the_passs_output_equals_the_blockwise_twin": "test_q_residual_attention_kernel_matches_the_twin_and_cuts_the_error (the FP8 kernel at d128 on the pass's output, residual off and on); causal: test_fp8_kernel test_interpret_kernel_is_the_blockwise_twin [b1_q200_kv140...], test_interpret_paths",
  "tests/test_fp8_quant_kernel.py::test_interpret_kernel_gives_the_twins_bits"
  "[64-64-128-300-bfloat16-True]": "64-64-256-100 (d64, rotation)",
  "tests/test_head_dim_v.py::test_interpret_against_float64_golden"
  "[256-128-full]": "64-128-causal-det (dK/dV + dQ with dv != d); test_sm90_bwd test_interpret_gradients_are_bitwise_deterministic_with_lse_cotangent[256-config1] (the d256 head splits); the aot tier compiles 256/128",
  "tests/test_large_logits.py::"
  "test_finite_scaled_scores_give_finite_correct_results[full-interpret]": "[causal-interpret] (the kernels at every scale), [full-blockwise] (not causal)",
  "tests/test_sm90_bwd.py::test_interpret_gradients_match_golden"
  "[b1_q100_kv130_h2/1_d256-bfloat16-causal-64x64x2-c2h2q2h2]":
  # the same config, d256, causal, against the golden
  "test_interpret_gradients_are_bitwise_deterministic_with_lse_cotangent[256-config1]; GQA in the shared tiles: test_flex bias_alibi-128",
  "tests/test_sm90_fused_bwd.py::test_fused_interpret_gradients_match_golden"
  "[b1_q136_kv200_h2/1_d64-bfloat16-causal-64x64x2-c2h1q2h1]":
  # d64 causal: the sq > skv case; MQA: the non-causal d64 case; a GQA
  # group in the causal loop: the d128 GQA case (the same function)
  "b1_q200_kv70 (d64 causal), b1_q128_kv150 (d64 MQA), b1_q130_kv200_h4/2_d128",
  "tests/test_head_dim_v.py::test_interpret_against_float64_golden"
  "[192-128-causal-fused]": "test_interpret_with_every_modifier (192/128, causal, GQA, the same fused shared-tile config); test_sm90_fused_bwd d192 (causal, no modifier)",
  "tests/test_head_dim_v.py::test_decode_kernel_with_head_dim_v": "test_kvcache_kernel test_interpret_value_head_dim_unlike_the_query [d192-dv128-contiguous] (192/128, 2 splits), [d64-dv128-paged64] (dv != d paged)",
  "tests/test_modifiers_kernels.py::test_interpret_against_float64_golden"
  "[b1_q300_kv200_h2/1_d64-causal-float64-float64-causal-causal]":
  # the backward kernels never see sinks (folded into the lse)
  "sinks: the all-three fused cases; dK/dV + dQ at d64: the left-window case; rows that see no key: test_sm90_bwd b1_q200_kv70",
  "tests/test_modifiers_kernels.py::test_interpret_against_float64_golden"
  "[b1_q200_kv256_h4/2_d128-causal-float64-5.0-full-causal]":
  # the d128 GQA fused case stays (the shared tile, all three modifiers)
  "test_flex bias_alibi-128 (the d128 shared dK/dV tile with GQA and a score's derivative); test_sm90_bwd d128 c1h1q2h1 (the dQ kernel's q2h1 at d128); test_property_golden mix310 (softcap in the deterministic shared tiles)",
  "tests/test_kvcache_kernel.py::test_interpret_against_float64_golden"
  "[query-tiles-12-gqa6-q128-prefill-chunk-append]": "test_interpret_layouts_the_tma_boxes_cannot_tile[page4-gqa-q64-append] (causal, two query tiles, appended), query-tiles-2 (splits over query tiles), query-tiles-5 (a partial last tile), page1-mqa-q3 (a group of 6)",
  "tests/test_kvcache_kernel.py::test_interpret_against_float64_golden"
  "[contiguous-g4-q1-lengths0-to-full]": "test_kvcache_leftpad test_interpret_leftpad_against_float64_golden[contiguous-pad-mid-tile] (the same contiguous g4 d64 cache, lengths 0, 100, 256, 1 and 3 splits, with a left pad); without one at seq_q 1: test_interpret_paths' decode kernel; its e4m3 twin: test_kvcache_fp8 [contiguous-g4]",
  "tests/test_kvcache_kernel.py::test_interpret_against_float64_golden"
  "[paged64-two-pages-per-tile-mqa-q4-append-window-softcap-sinks]": "test_kvcache_leftpad test_interpret_leftpad_against_float64_golden[paged64-two-pages-per-tile-window] (pages of 64 in 128-key tiles, window (60, 0), softcap 5, 2 splits); sinks: query-tiles-5",
  "tests/test_kvcache_mla_kernel.py::test_interpret_mla_against_float64_golden"
  "[contiguous-h16-q1-lengths-0-to-full]": "test_interpret_mla_e4m3_cache_against_the_dequantized_golden[contiguous-h16-q1-lengths-0-to-full-3-splits] (the layout, empty and full, 3 splits); 16-bit: d320-dv256-contiguous-append, paged64-h64-q2 (2 splits)",
  # -- the twins and the reference -------------------------------------------
  # float16 inputs change only their rounding: [float16-b2_q130_kv400...]
  "tests/test_fp8_kernel.py::test_blockwise_fp8_matches_golden"
  "[float16-b1_q200_kv330_h4/2_d64-False-(64, 64)]": "[bfloat16-...] of the shape; [float16-b2_q130_kv400_h2/1_d128-True-(64, 128)]",
  "tests/test_fp8_kernel.py::test_blockwise_fp8_matches_golden"
  "[float16-b1_q300_kv110_h2/2_d64-True-(64, 64)]": "[bfloat16-...] of the shape; [float16-b2_q130_kv400_h2/1_d128-True-(64, 128)]",
  "tests/test_fp8_kernel.py::test_blockwise_fp8_matches_golden"
  "[float16-b1_q96_kv160_h2/1_d256-False-(64, 64)]": "[bfloat16-...] of the shape; [float16-b2_q130_kv400_h2/1_d128-True-(64, 128)]",
  "tests/test_fp8_kernel.py::test_blockwise_fp8_matches_golden"
  "[float16-b1_q1_kv17_h2/1_d64-True-(64, 128)]": "[bfloat16-...] of the shape; [float16-b2_q130_kv400_h2/1_d128-True-(64, 128)]",
  "tests/test_large_logits.py::"
  "test_finite_scaled_scores_give_finite_correct_results[causal-reference]": "[full-reference] (the reference at every scale), [causal-blockwise], [causal-interpret] (causal)",
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
  "[4-full]": "[2-full]; [8-causal] (run twice: bit-identical); test_zigzag_layout_skips_the_permutation (ring 4)",
  "tests/multidevice/check_ring_attention.py::test_ring_matches_single_device"
  "[8-full]": "[2-full], [8-causal]",
  "tests/multidevice/check_ring_modifiers.py::test_ring_with_modifiers"
  "[window-causal-4]": "all-causal-8 (causal + window), check_ring_attention test_zigzag_layout_skips_the_permutation (ring 4, causal)",
  "tests/multidevice/check_ring_modifiers.py::test_ring_with_modifiers"
  "[window-right-4]": "check_sequence_sharded [modifiers-seq8-explicit] and check_ring_window [both-zigzag] (right windows), test_window_with_unequal_lengths[cross-4] (ring 4)",
  "tests/multidevice/check_ring_attention.py::test_ring_matches_single_device"
  "[2-causal]": "[2-full] (ring 2), [8-causal]",
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
