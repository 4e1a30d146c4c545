"""The training example: a byte-level GPT on pallas-fa3 attention (`gpt`, its
config `gpt_config`) trained on the Python standard library's sources
(`data`, packed batches `packing`) by one jitted step (`step`) in a loop
with evaluation, orbax checkpoints and resume (`train`, `checkpoint`,
`report`: progress bar and metrics log), then generating from a trained run
(`restore`, `generate`: prefill and cached decode steps, `sampling`); `cli`
holds the commands `python -m models train|generate` (`__main__`; also
`pallas-fa3 train|generate`).
More: docs/training.md#train-a-model-pallas-fa3-train
"""
