"""The pipeline engine: DeepSpeed's `PipelineEngine` surface (`train_batch`, `eval_batch`, stage queries) on
top of `Engine`, for a `PipelineModule` (one stage's layers) on a pipe × data × tensor topology: with
tensor parallelism, each stage's layers are split over its tensor group and every tensor rank exchanges
activations with the peer stage of the same tensor coordinate (`Topology.pipe_peer`).

A batch is one schedule (`pipeline/schedule.py`) that the executor runs: its micro-batches are the
gradient-accumulation steps. Each stage's sharding strategy (ZeRO 0-2 over the stage's data-parallel
replicas) sees the batch as one accumulation window: gradients accumulate locally through the
micro-batches and are reduced during the stage's last backward (ZeRO-2 reduces in every backward, as it
always does). Clipping and the fp16 overflow check use the norm over every stage's gradients; the
optimizer steps each stage's own parameters. The loss `train_batch` returns is the mean over the
micro-batches and the data-parallel replicas, on every rank, as in DeepSpeed.

ZeRO-3 is refused: its parameter gathering around forward and backward is not yet proven under the
executor's interleaving of micro-batches.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import torch

from ..config.notes import note_once_per_job
from ..distributed.grid import Grid
from ..pipeline import gpipe, interleaved_1f1b, one_f_one_b
from ..pipeline import inference as inference_schedule
from ..pipeline.executor import BatchResult, StageExecutor
from ..pipeline.instructions import Schedule
from ..pipeline.module import PipelineModule
from ..pipeline.p2p import StageLink
from ..pipeline.tied import TiedWeights
from .data import RepeatingLoader, move_to_device
from .engine import Engine, _cast_floats


class PipelineError(RuntimeError):
    """A call a pipeline engine does not take (forward / backward / step: it trains with train_batch)."""


class PipelineEngine(Engine):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        module = self.module
        if not isinstance(module, PipelineModule):
            raise TypeError(f"PipelineEngine: a PipelineModule is required; got {type(module).__name__}.")
        if self.config.zero_optimization.stage == 3:
            raise ValueError("zero_optimization.stage: pipeline parallelism runs with ZeRO stages 0, 1 and 2; stage 3 "
                             "is not supported with a PipelineModule yet. Use stage 2 (gradients and optimizer "
                             "state partitioned across each stage's data-parallel replicas).")
        self.grid = Grid(self.topology)
        self.stage_id, self.num_stages = module.stage_id, module.num_stages
        self.micro_batches = self.gradient_accumulation_steps()
        self._schedule = _training_schedule(self.config.pipeline.schedule, self.num_stages, self.micro_batches,
                                            module.num_chunks)
        peers = [self.topology.pipe_peer(s) for s in range(self.num_stages)]
        self.link = StageLink(self.comm, self.topology.pipe, peers, self.device)
        self.tied = TiedWeights(module, self.link, self.device, self.precision.param_dtype,
                                self.precision.grad_accum_dtype)
        self.tied.sync_weights()
        self._hooks = _StageHooks(self)
        self.executor = StageExecutor(self._hooks, self.link, self.stage_id, self.num_stages, module.num_chunks)
        self.data_iterator: Iterator[Any] | None = None
        self.agg_train_loss: torch.Tensor | None = None
        self.agg_eval_loss: torch.Tensor | None = None
        self.last_batch: BatchResult | None = None
        """The executor's record of the last train_batch (timeline when executor.record_timeline, in-flight peak)."""
        self._link_training: bool | None = None
        if self.num_stages > 1 and self.config.gradient_clipping > 0:
            note_once_per_job(logging.getLogger("shardwise"), logging.INFO, (
                f"gradient_clipping {self.config.gradient_clipping:g}: clipped by the norm over every stage's "
                "gradients, as the single-process model would be. DeepSpeed 0.19.8's PipelineEngine clips by the "
                "first stage's norm alone, so once clipping engages the losses differ from a DeepSpeed run's."))

    # --- where this rank sits ---------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    @property
    def is_pipe_parallel(self) -> bool:
        return self.num_stages > 1

    @property
    def is_data_parallel(self) -> bool:
        return self.topology.data.size > 1

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        self.data_iterator = iterator

    def reset_activation_shape(self) -> None:
        """Negotiate the shapes sent between stages again at the next batch (they changed)."""
        self.link.reset()

    # --- training and evaluation ----------------------------------------------------------------
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches; the mean loss on every rank."""
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch(): gradients are disabled (inside torch.no_grad()); call it with "
                                "gradients enabled, or use eval_batch() to evaluate.")
        self.checkpoint_writer.check()
        self.instruments.reporter.mark_start()  # the executor's forwards bypass engine.forward, which starts it
        self.module.train()
        self._hooks.begin(self._data(data_iter, "train_batch"), self.micro_batches, labels=True,
                          need="a batch needs {n} micro-batches (gradient_accumulation_steps)")
        self._hooks.aggregated = None
        self._grads_since_step = True
        self._agree_activations(training=True)
        self.last_batch = self.executor.run(self._schedule.per_stage[self.stage_id], train=True)
        self._hooks.finish()
        self.micro_steps += self.micro_batches
        self.agg_train_loss = self._hooks.aggregated
        return self.agg_train_loss

    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forward only over `num_micro_batches` (default gradient_accumulation_steps) micro-batches: the loss
        averaged over them and the data-parallel replicas (on every rank with `bcast_loss`, else on the last
        stage); with `return_logits`, also the last stage's output of the last micro-batch (None elsewhere). Without
        `compute_loss`, the outputs' mean on the last stage and None elsewhere (DeepSpeed's)."""
        if reduce_output not in ("avg", None):
            raise ValueError(f'reduce_output: "avg" or None is required; got {reduce_output!r}.')
        micro_batches = num_micro_batches or self.micro_batches
        schedule = inference_schedule(self.num_stages, micro_batches, labels=compute_loss)
        if self.module.num_chunks > 1:
            raise PipelineError("eval_batch(): evaluation of a module with num_chunks > 1 is not supported yet.")
        self._hooks.begin(self._data(data_iter, "eval_batch"), micro_batches, labels=compute_loss,
                          need="eval_batch needs {n} micro-batches (num_micro_batches, default "
                               "gradient_accumulation_steps)")
        was_training = self.module.training
        self.module.eval()
        self._agree_activations(training=False)
        try:
            with torch.no_grad():
                result = self.executor.run(schedule.per_stage[self.stage_id], train=False, compute_loss=compute_loss)
            self._hooks.finish()
        finally:
            self.module.train(was_training)
        # without a loss the last stage's outputs stay there, as in DeepSpeed: they have no scalar to broadcast
        output = self._eval_output(result, reduce_output, bcast_loss and compute_loss)
        self.agg_eval_loss = output
        if return_logits:
            return output, result.last_output if self.is_last_stage() else None
        return output

    def _agree_activations(self, training: bool) -> None:
        """Activations need gradients in training and none in evaluation, so their descriptions differ between the
        two: the stages agree on them again when the engine switches (every stage switches at the same call)."""
        if self._link_training is not None and self._link_training != training:
            self.link.reset()
        self._link_training = training

    def _eval_output(self, result: BatchResult, reduce_output: str | None, bcast: bool) -> Any:
        if reduce_output is None:
            return result.losses if self.is_last_stage() else None
        if not bcast:
            return self._mean_over_replicas(result.losses) if self.is_last_stage() else None
        return self._aggregate(result.losses)

    def _aggregate(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The last stage's mean loss, averaged over the data-parallel replicas, on every stage."""
        out = self._mean_over_replicas(losses) if self.is_last_stage() else torch.zeros((), device=self.device)
        self.comm.broadcast(out, self.num_stages - 1, self.topology.pipe).wait()
        return out

    def _mean_over_replicas(self, losses: list[torch.Tensor]) -> torch.Tensor:
        mean = torch.stack([loss.float() for loss in losses]).mean(dim=0)
        self.comm.all_reduce(mean, self.topology.data).wait()
        return mean / self.topology.data.size

    def _data(self, data_iter: Iterator[Any] | None, caller: str) -> Iterator[Any] | None:
        if not (self.is_first_stage() or self.is_last_stage()):
            return None  # middle stages read nothing
        if data_iter is not None:
            if caller == "train_batch":  # as in DeepSpeed: later train_batch() calls read on from it
                self.data_iterator = data_iter
            return data_iter
        if caller == "eval_batch":
            # the engine's own iterator is training's: evaluating on it would take training's next micro-batches
            raise PipelineError(f"eval_batch(): no data on stage {self.stage_id}; pass data_iter (an iterator of "
                                "(inputs, labels) micro-batches to evaluate): the training iterator is not read for "
                                "evaluation.")
        if self.data_iterator is None and self.training_dataloader is not None:
            self.data_iterator = iter(RepeatingLoader(self.training_dataloader))
        if self.data_iterator is None:
            raise PipelineError(f"{caller}(): no data on stage {self.stage_id}; pass data_iter (an iterator of "
                                "(inputs, labels) micro-batches), set_dataiterator(), or initialize(training_data=...).")
        return self.data_iterator

    # --- what a pipeline engine does not take --------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("a pipeline engine runs forward inside train_batch() / eval_batch(); call those instead "
                            "of engine(...) (as DeepSpeed's PipelineEngine requires).")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("engine.backward(): a pipeline engine runs backward inside train_batch(); call "
                            "train_batch(data_iter) once per optimizer step.")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError("engine.step(): a pipeline engine steps inside train_batch(); call train_batch(data_iter) "
                            "once per optimizer step.")

    def save_16bit_model(self, *args: Any, **kwargs: Any) -> str | None:
        raise PipelineError("save_16bit_model(): each pipeline stage holds only its own layers, so no rank has the whole "
                            "model; save a checkpoint (engine.save_checkpoint) and consolidate it with `shardwise "
                            "checkpoint to-fp32 <save_dir> <out_dir>`, which reads every stage's weights by name.")

    def _zero3_consolidated_16bit_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor] | None:
        return self.save_16bit_model()

    def _consolidated_16bit_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor] | None:
        return self.save_16bit_model()

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> tuple[str | None, dict[str, Any]]:
        loaded = super().load_checkpoint(*args, **kwargs)
        self.tied.sync_weights()  # only the owner's copy is in the checkpoint
        self.data_iterator = None  # the loader's position moved: a new iterator starts there
        return loaded


class _StageHooks:
    """What the executor asks of this stage (`pipeline.executor.StageHooks`), answered by the engine."""

    def __init__(self, engine: PipelineEngine):
        self.engine = engine
        self.data: Iterator[Any] | None = None
        self.aggregated: torch.Tensor | None = None
        self._begin_state(0, 0, "")

    def begin(self, data: Iterator[Any] | None, micro_batches: int, labels: bool, need: str) -> None:
        """A new train_batch / eval_batch: it reads exactly `micro_batches` micro-batches of its own from `data`;
        nothing read by an earlier call is served again (see `_micro_batch`)."""
        engine = self.engine
        # who on this rank takes each micro-batch: the first stage its inputs, the last stage its labels
        takers = int(engine.is_first_stage()) + int(engine.is_last_stage() and labels)
        self.data = data
        self._begin_state(micro_batches, takers, need.format(n=micro_batches))

    def _begin_state(self, micro_batches: int, takers: int, need: str) -> None:
        self._micro_batches, self._takers, self._need = micro_batches, takers, need
        self._read = 0
        self._held: dict[int, tuple[Any, int]] = {}
        """Micro-batches read but not yet taken by every taker on this rank: (inputs, labels), times taken."""

    def finish(self) -> None:
        """Read what the schedule did not: every stage that reads keeps to one item per micro-batch (a last stage
        evaluating without labels too, as in DeepSpeed), so stages sharing an iterator stay in step."""
        if self.data is not None:
            while self._read < self._micro_batches:
                self._next()
        self._held.clear()

    def _next(self) -> Any:
        try:
            batch = next(self.data)
        except StopIteration:
            raise PipelineError(f"the data iterator ran out at micro-batch {self._read}; {self._need}.") from None
        self._read += 1
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            size = f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""
            raise PipelineError(f"a pipeline micro-batch must be a pair (inputs, labels); got a {type(batch).__name__}"
                                f"{size}. Yield (inputs, labels) from the data iterator.")
        return batch

    def _micro_batch(self, micro_batch: int) -> Any:
        """(inputs, labels) of `micro_batch` of this call: read once, though a single stage asks for its inputs and
        its labels, and dropped once both are taken."""
        while self._read <= micro_batch:
            index = self._read
            self._held[index] = (move_to_device(tuple(self._next()), self.engine.device), 0)
        if micro_batch not in self._held:
            raise RuntimeError(f"pipeline stage {self.engine.stage_id}: micro-batch {micro_batch} was asked for after "
                               "every part of it was taken; the schedule reads each micro-batch's inputs and labels "
                               "once (this is a bug in shardwise).")
        batch, taken = self._held[micro_batch]
        if taken + 1 >= self._takers:
            del self._held[micro_batch]
        else:
            self._held[micro_batch] = (batch, taken + 1)
        return batch

    def inputs(self, micro_batch: int) -> Any:
        inputs = self._micro_batch(micro_batch)[0]
        if self.engine.precision.auto_cast:
            inputs = _cast_floats(inputs, self.engine.precision.param_dtype)
        return inputs

    def labels(self, micro_batch: int) -> Any:
        return self._micro_batch(micro_batch)[1]

    def forward(self, inputs: Any, chunk: int) -> Any:
        with self.engine._autocast():
            return self.engine.module(inputs, chunk=chunk)

    def loss(self, outputs: Any, labels: Any) -> torch.Tensor:
        loss_fn = self.engine.module.loss_fn
        loss = loss_fn(outputs, labels) if loss_fn is not None else outputs
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise PipelineError(f"the last stage's loss must be a one-element tensor; got "
                                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}. Give "
                                "PipelineModule a loss_fn(outputs, labels), or make the last layer return the loss.")
        return loss

    def loss_factor(self) -> float:
        return self.engine.precision.loss_scaler.scale / self.engine.micro_batches

    def begin_weight_grads(self, last: bool) -> None:
        if last:
            self.engine.tied.expect_grads()
        self.engine.strategy.begin_backward(last)

    def end_weight_grads(self, last: bool) -> None:
        self.engine.strategy.finish_backward()
        if last:
            self.engine.tied.check_added()

    def reduce_grads(self, losses: list[torch.Tensor]) -> None:
        """After the last backward: tied gradients to their owners; the batch's loss to every stage (before the
        step, so that rank 0 reports it)."""
        self.engine.tied.send_grads()
        self.aggregated = self.engine._aggregate(losses)

    def optimizer_step(self) -> None:
        engine = self.engine
        engine._window_loss = self.aggregated * engine.micro_batches
        engine._take_model_step(None)
        engine.tied.sync_weights()


def _training_schedule(name: str, stages: int, micro_batches: int, chunks: int) -> Schedule:
    if name == "interleaved_1f1b":
        if chunks < 2:
            raise ValueError('pipeline.schedule: "interleaved_1f1b" needs a PipelineModule with num_chunks >= 2 (model '
                             "chunks per stage); build it with num_chunks=2, or use \"1f1b\".")
        return interleaved_1f1b(stages, micro_batches, chunks)
    if chunks > 1:
        raise ValueError(f'pipeline.schedule: "{name}" runs one model chunk per stage, but the PipelineModule has '
                         f'num_chunks={chunks}; use "interleaved_1f1b" or build the module with num_chunks=1.')
    return one_f_one_b(stages, micro_batches) if name == "1f1b" else gpipe(stages, micro_batches)
