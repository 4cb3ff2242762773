"""ZeRO stage 3: parameters partitioned into units, gathered by forward/backward hooks, released after use;
zero.Init, GatheredParameters and the DeepSpeed attributes of partitioned parameters.

The strategy is `strategy.Stage3`, built by `zero/factory.py`; the public names are exported by `shardwise.zero`.
"""
