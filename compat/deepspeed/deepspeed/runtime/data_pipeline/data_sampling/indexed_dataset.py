"""`deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset`: Megatron's `.bin`/`.idx` dataset format, in
which DeepSpeed's DataAnalyzer writes its results. shardwise's DataAnalyzer writes `.npy` files instead
(`shardwise.data_efficiency.index`) and shardwise reads no `.bin`/`.idx`, so the reader and writer refuse."""

from shardwise.unsupported import unsupported_class

_INSTEAD = ("shardwise's DataAnalyzer writes <save_path>/<metric>/*.npy, not Megatron's .bin/.idx; read them with "
            "numpy.load (an accumulate_value_over_samples metric is <save_path>/<metric>/metric_value.npy).")

MMapIndexedDataset = unsupported_class(
    "deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset.MMapIndexedDataset", _INSTEAD)
MMapIndexedDatasetBuilder = unsupported_class(
    "deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset.MMapIndexedDatasetBuilder", _INSTEAD)

__all__ = ["MMapIndexedDataset", "MMapIndexedDatasetBuilder"]
