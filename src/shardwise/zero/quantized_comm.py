"""ZeRO++'s quantized collectives: the weight all-gather (qwZ) and the gradient reduce-scatter (qgZ).

What travels: block-quantized chunks (`quantize.py`), bits/8 bytes per element plus one fp32 scale per
block, i.e. bits/8 + 4/block bytes per element: 1.016 for int8 with blocks of 256 (a quarter of fp32's 4,
half of bf16's 2), 0.516 for int4.

Weights (`quantized_all_gather`): each rank quantizes its shard once, the packed chunks are all-gathered as
bytes, and every chunk, this rank's own included, is dequantized into the full flat buffer, so every rank
computes with bit-identical weights. Each element is off by at most its block's scale / 2.

Gradients (`QuantizedReduceScatter`): each rank quantizes the group.size chunks of its bucket, one all-to-all
sends chunk r to rank r, and each rank dequantizes what it received and sums it in fp32, in rank order. Why
all-to-all and not a ring: a ring reduce-scatter adds on the way, and a sum of quantized values would have
to be quantized again at every hop, its error growing with the number of ranks; with all-to-all each value
is quantized once and each rank reduces only the chunk it owns. The bytes each rank sends are the same as
a ring reduce-scatter's at the quantized size: (group.size - 1) / group.size of its bucket.
Error bound: with the bucket scaled by `before` first, element i of the result is off from the exact mean by
at most after * sum over ranks r of scale_r(i) / 2, where scale_r(i) is the absmax of rank r's scaled block
holding i over qmax (plus fp32 rounding of the sum).
"""

from __future__ import annotations

import torch

from ..distributed import Collectives, Group
from ..distributed.collectives import Pending
from .quantize import BlockQuant
from .reducers import BucketLike, GradAveraging, Reduction, _on_wire, partitioned_norm

__all__ = ["QuantizedGather", "QuantizedReduceScatter", "quantized_all_gather"]


class QuantizedGather:
    """A launched quantized all-gather: `done()` says without waiting whether the bytes arrived; `wait()`
    waits for them and dequantizes every chunk into the output (once)."""

    def __init__(self, pending: Pending, packed: torch.Tensor, output_flat: torch.Tensor, quant: BlockQuant,
                 size: int):
        self._pending, self._packed, self._output, self._quant, self._size = pending, packed, output_flat, quant, size

    def done(self) -> bool:
        return self._pending.done()

    def wait(self) -> None:
        self._pending.wait()
        if self._packed is None:
            return
        packed, self._packed = self._packed, None  # free the bytes once unpacked
        chunk = self._output.numel() // self._size
        self._quant.unpack_rows(packed.view(self._size, -1), chunk, self._output.view(self._size, chunk))


def quantized_all_gather(comm: Collectives, output_flat: torch.Tensor, shard: torch.Tensor, group: Group,
                         quant: BlockQuant) -> QuantizedGather:
    """Gather every rank's `shard` into `output_flat` through one uint8 all-gather of quantized chunks.

    `shard` has output_flat.numel() // group.size elements. At `wait()`, this rank's own chunk of
    `output_flat` holds the dequantized shard too (not the exact one), so a `shard` that is a view of
    `output_flat` loses precision there: keep the exact shard elsewhere (ZeRO-3 keeps it in its own buffer).
    """
    chunk = output_flat.numel() // group.size
    if output_flat.numel() != chunk * group.size or shard.numel() != chunk:
        raise ValueError(f"quantized_all_gather: a shard of 1/{group.size} of the output ({group.name} group) is "
                         f"required; got a shard of {shard.numel()} and an output of {output_flat.numel()} elements.")
    chunk_bytes = quant.packed_bytes(chunk)
    packed = torch.empty(group.size * chunk_bytes, dtype=torch.uint8, device=shard.device)
    mine = packed[group.rank * chunk_bytes : (group.rank + 1) * chunk_bytes]
    quant.pack(shard.reshape(-1), mine)
    pending = comm.all_gather(packed, mine, group)  # in place: `mine` is this rank's chunk of `packed`
    return QuantizedGather(pending, packed, output_flat, quant, group.size)


class QuantizedReduceScatter:
    """The `Reducer` of quantized gradients (ZeRO++'s qgZ, for ZeRO-3): like `ReduceScatterMean` with
    `accumulate=True`, each reduction adds this rank's averaged chunk into `bucket.shard_grad`; the chunks
    travel quantized through one all-to-all and are summed in fp32 (module docstring: error bound)."""

    rereduce_safe = True  # each reduction adds into the shard: reducing again adds the new gradients' mean

    def __init__(self, comm: Collectives, group: Group, averaging: GradAveraging, quant: BlockQuant):
        self.comm, self.group, self.averaging, self.quant = comm, group, averaging, quant

    def launch(self, bucket: BucketLike) -> Reduction:
        flat, size = bucket.flat, self.group.size
        if flat is None or flat.numel() % size:
            raise ValueError(f"QuantizedReduceScatter: a bucket whose flat gradient splits into {size} equal chunks "
                             f"({self.group.name} group) is required; got {None if flat is None else flat.numel()}.")
        chunk = flat.numel() // size
        _on_wire(flat, self.averaging.before, flat.dtype)  # in place: the bucket is scratch until the reduction is finished
        chunk_bytes = self.quant.packed_bytes(chunk)
        # One allocation for both sides: `then` holds `received`, which keeps `sent` alive until the exchange is over.
        sent, received = torch.empty(2, size, chunk_bytes, dtype=torch.uint8, device=flat.device)
        self.quant.pack_rows(flat.view(size, chunk), sent)
        pending = self.comm.all_to_all(received.view(-1), sent.view(-1), self.group)

        def then() -> None:
            parts = torch.empty(size, chunk, dtype=torch.float32, device=flat.device)
            self.quant.unpack_rows(received, chunk, parts)
            total = parts[0]
            for part in parts[1:]:  # rank order, the same on every rank and in every run
                total.add_(part)
            bucket.shard_grad.add_(total, alpha=self.averaging.after)

        return Reduction(pending, then)

    def global_norm(self, results: list[torch.Tensor]) -> torch.Tensor:
        return partitioned_norm(self.comm, self.group, results)
