"""ZeRO: the flat-buffer primitive, gradient buckets and the sharding strategies for stages 0-3."""
