"""Scale-out: batch/head sharding (`partitioning`) and context parallelism
(`context`, `ring`, `ulysses`): docs/scale_out.md.
"""
