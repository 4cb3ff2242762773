"""`deepspeed.runtime.sequence_parallel`: Ulysses sequence parallelism (shardwise.sequence_parallel)."""
