"""Models trained with pallas-fa3 attention: the training example.

gpt         GPTConfig and GPT: a byte-level decoder-only transformer whose
            attention is pallas_fa3.flax.FlashMultiHeadAttention
            (optionally: per-layer sliding windows, softcap, sinks)
gpt_config  GPTConfig's fields and their checks
data        the Python standard library's sources as a byte corpus;
            deterministic batches
packing     packed batches: files side by side, with segment ids,
            restarting positions and a loss mask
step        TrainConfig, build_program (the jitted step), evaluate
train       train(): the loop, evaluation, checkpoints and resume
checkpoint  orbax checkpoints of the training state
restore     a trained model from a run folder or checkpoint, for inference
generate    generate(): prefill, then cached decode steps (or recomputed)
sampling    Sampling and sample(): greedy, temperature, top-k, top-p
report      progress bar and metrics log

cli         `python -m models train|generate` (`__main__.py`; also
            `pallas-fa3 train|generate`): the commands' flags and handlers
"""
