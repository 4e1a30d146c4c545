"""Scale-out: batch/head sharding (`partitioning`) and context parallelism (`ring`)."""
