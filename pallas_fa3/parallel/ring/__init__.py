"""Ring attention: context parallelism with the sequence sharded over one
mesh axis, K/V shards travelling around it. `attention.ring_attention` is
the entry point (through `pallas_fa3.vjp` like every call); `local` holds
the per-device passes and their shard_map, which the partitioner also runs
for sequence-sharded `flash_attention` (`parallel.context`); `plan`,
`steps`, `window`, `blocks`, `layout`, `skip` and `checks` their parts.
docs/scale_out.md
"""
