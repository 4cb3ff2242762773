"""The Engine: DeepSpeed's training facade (forward / backward / step / save / load).

It stays small because it only sequences the pieces: the sharding strategy owns parameters,
gradients and the optimizer; the precision policy owns dtypes and the loss scaler; `take_step`
owns the step arithmetic; the checkpoint package owns files.

What a training loop may do, and what happens:
- `engine.backward(loss)` then `engine.step()`: the loss is divided by gradient_accumulation_steps
  (and multiplied by fp16's loss scale), gradients are reduced during backward.
- `loss.backward()` then `engine.step()` (a direct backward): the gradients land in `param.grad` as in
  plain PyTorch; `step()` takes them, divides them by gradient_accumulation_steps and reduces them, so
  the run is the same as with `engine.backward(loss)` (as in DeepSpeed). Refused with fp16, whose loss
  scale only `engine.backward` applies. Gradients that another engine's backward leaves in this model's
  `param.grad` (a GAN's generator loss through the discriminator) are treated the same way, so a
  `model.zero_grad()` before this engine's own backward clears them, as in PyTorch (zero/grad_buckets.py,
  [Note: whose gradient is it]).
- `engine.step()` with no gradient since the last step: weights and optimizer state stay as they are
  (torch's `optimizer.step()` skips parameters without a gradient), the step still counts (global_steps,
  the lr scheduler), and a warning says so once.
- a nan/inf gradient norm in fp32/bf16: the update is skipped and counted in `skipped_steps` with a
  warning naming the step and the norm, or with `"nonfinite_grads": "raise"` skipped and raised.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.distributed as dist

from ..config import Config
from ..distributed import Collectives, Topology
from ..monitor.reporter import StepFigures
from ..precision import PrecisionPolicy
from ..precision.autocast import AUTOCAST_AS_IS, forward_autocast
from ..profiling.instruments import Instruments
from ..profiling.memory import MemoryBreakdown
from ..profiling.noop import NOTHING
from ..profiling.throughput import ThroughputTimer
from ..protocols import ShardingStrategy
from ..tensor_parallel import TensorParallelModel, TensorShard
from . import param_access, watchers
from .call_checks import check_loss, explain_dtype_error
from .out_of_memory import OutOfMemoryExplainer
from .curriculum_surface import DataEfficiencySurface
from .deepspeed_surface import DeepSpeedSurface
from .state_offload import StateParking, kind_names, state_tensors
from .weights_surface import ConsolidatedWeights
from .step import NonFiniteGradientError, StepResult, take_step

logger = logging.getLogger(__name__)


_STEP_STATE = frozenset({"global_steps", "global_samples", "skipped_steps", "micro_steps", "window_micro_steps",
                         "_last_step", "_grads_since_step", "_window_loss", "_window_tokens"})
"""The engine's counters, set on every forward, backward and step: never parameters, buffers or modules."""


class Engine(DeepSpeedSurface, DataEfficiencySurface, ConsolidatedWeights, torch.nn.Module):
    sequence_witness: Callable[[bool], ContextManager[None]] = staticmethod(lambda training: NOTHING)
    """Under sequence parallelism, the check that attention went through Ulysses (sequence_parallel/setup.py)."""

    def __setattr__(self, name: str, value: Any) -> None:
        # nn.Module's own looks for a parameter, buffer or submodule of that name first (~4 us a call): a
        # two-engine GAN iteration set the counters 26 times, 0.1 ms of a 1.3 ms iteration.
        if name in _STEP_STATE:
            object.__setattr__(self, name, value)
        else:
            torch.nn.Module.__setattr__(self, name, value)

    def __init__(
        self,
        config: Config,
        topology: Topology,
        strategy: ShardingStrategy,
        precision: PrecisionPolicy,
        comm: Collectives,
        lr_scheduler: Any,
        device: torch.device,
        local_rank: int,
        tensor_parallel: TensorParallelModel | None = None,
    ):
        super().__init__()
        self.module = strategy.module
        self.config = config
        self.topology = topology
        self.strategy = strategy
        self.precision = precision
        self.comm = comm
        self.lr_scheduler = lr_scheduler
        self.tensor_parallel = tensor_parallel
        self.tensor_shards: dict[str, TensorShard] = tensor_parallel.shards if tensor_parallel else {}
        """Each tensor-parallel split parameter's place in the whole one (what checkpoints record)."""
        self.device = device
        self.local_rank = local_rank
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self.window_micro_steps = 0
        """Micro-steps since the last optimizer step: gradients accumulated that a checkpoint does not hold."""
        self._boundary_override: bool | None = None
        self._in_no_sync = False
        self._last_step: StepResult | None = None
        self._grads_since_step = False
        """A backward reached this engine since the last optimizer step (engine.backward or adopted grads)."""
        self._warned: set[str] = set()
        self._window_loss: torch.Tensor | float = 0.0
        """The window's summed loss, kept as a tensor until the step reports it: reading it every micro-step
        would wait for the device."""
        self._window_tokens = 0
        self.training_dataloader: Any = None
        from ..checkpoint.writer import CheckpointWriter

        self.checkpoint_writer = CheckpointWriter(config.checkpoint.async_save, config.checkpoint.tag_validation)
        self.instruments = Instruments(config, strategy, comm, device, self.global_rank, topology.data.size)
        self._autocast = forward_autocast(config.torch_autocast, device)
        self.monitor = self.instruments.monitor
        self.tput_timer = ThroughputTimer(config.train_batch_size)
        self.plan_probe = watchers.plan_probe(self)
        """The planner's step-2 check (`memory_breakdown: true`): `plan_probe.check` once step 2 is done."""
        watchers.autotune_trial(self, self.plan_probe)
        self.out_of_memory = OutOfMemoryExplainer(self)
        self._parking = StateParking()
        """What offload_states() took off the accelerator until reload_states()."""
        param_access.register(self)

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model, registered as the submodule "module" as in DeepSpeed's engine. Read here rather than
        through nn.Module's attribute fallback (~1.5 us a read, several in every forward, backward and step)."""
        try:
            return self.__dict__["_modules"]["module"]
        except KeyError:
            raise AttributeError("module") from None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """nn.Module's, asked of the submodules: the engine holds no parameter of its own, and walking its tree too
        cost a GAN iteration's two zero_grad() calls ~8 us."""
        if self._parameters:
            torch.nn.Module.zero_grad(self, set_to_none)
            return
        for child in self._modules.values():
            if child is not None:
                child.zero_grad(set_to_none)

    # --- accumulation boundaries (the rest of DeepSpeed's accessors: deepspeed_surface.py) -------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.strategy.optimizer

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = is_boundary

    # --- training ------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # [Note: the forward's fast path] A small model's forward is a few tens of microseconds, and every feature
        # checked here runs cache-cold between two backwards: each is asked with one attribute test, and the
        # contexts are entered only when one of them does something.
        if self._parking.offloaded:
            self._parking.check("engine.forward()", ("lp_params",))
        if self.precision.auto_cast:
            inputs, kwargs = _cast_floats((inputs, kwargs), self.precision.param_dtype)
        if self.config.curriculum_learning is not None:
            inputs, kwargs = self._curriculum_inputs(inputs, kwargs)  # the legacy seqlen curriculum's cut
        self._window_tokens += _token_count(inputs, kwargs)
        module = self.module
        if self.random_ltd_scheduler is not None and module.training:
            self.random_ltd_scheduler.update_seq(self.global_steps, self.window_micro_steps)
        instrumented = self.instruments.forward(module, self.global_steps)
        autocast, witness = self._autocast(), self.sequence_witness(module.training)
        try:
            if instrumented is NOTHING and witness is NOTHING and autocast is AUTOCAST_AS_IS:
                return module(*inputs, **kwargs)
            with instrumented, autocast, witness:
                return module(*inputs, **kwargs)
        except (RuntimeError, MemoryError) as error:
            self.out_of_memory.note("forward", error)
            if isinstance(error, RuntimeError):
                dtype_message = explain_dtype_error(error, inputs, kwargs, self.precision.param_dtype,
                                                    self.config.fp16.enabled)
                if dtype_message:
                    raise TypeError(dtype_message) from error
                message = self.strategy.explain_forward_error(error)
                if message:
                    raise RuntimeError(message) from error
            raise

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        self._check_trains("engine.backward(loss)")
        check_loss(loss)
        if self._parking.offloaded:
            self._parking.check("engine.backward(loss)", ("lp_params", "lp_grads"))
        self._adopt_param_grads("engine.backward(loss)")  # they sum with this backward's, as torch would
        reduce = self.is_gradient_accumulation_boundary() and not self._in_no_sync
        self._grads_since_step = True
        self.strategy.begin_backward(reduce)
        # The window's first loss is kept as it is: an add into 0.0 is a kernel (~6 us on CPU) on every backward.
        window = self._window_loss
        self._window_loss = loss.detach() if isinstance(window, float) and window == 0.0 else window + loss.detach()
        factor = self.precision.loss_scaler.scale
        if scale_wrt_gas:
            factor /= self.gradient_accumulation_steps()
        scaled = loss * factor if factor != 1.0 else loss
        instrumented, reducing = self.instruments.backward(), self.instruments.reduce()
        try:  # an except clause, not a context to build ([Note: the forward's fast path])
            with instrumented:
                scaled.backward(retain_graph=retain_graph)
                with reducing:
                    self.strategy.finish_backward()
        except (RuntimeError, MemoryError) as error:
            self.out_of_memory.note("backward", error)
            raise
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        self._check_trains("engine.step()")
        if self._in_no_sync:
            raise RuntimeError("engine.step(): called inside engine.no_sync(); leave the context before stepping.")
        if self._parking.offloaded:
            self._parking.check("engine.step()")
        self.checkpoint_writer.check()  # a failed background save is raised here, not lost
        boundary = self.is_gradient_accumulation_boundary()
        if self._adopt_param_grads("engine.step()"):
            # A backward this engine did not start (a direct loss.backward()): reduce its gradients now, as
            # engine.backward's window would have.
            self.strategy.begin_backward(boundary)
            with self.instruments.reduce():
                self.strategy.finish_backward()
        instrumented = self.instruments.step(boundary)
        try:  # an except clause, not a context to build ([Note: the forward's fast path])
            with instrumented:
                if boundary:
                    self._take_model_step(lr_kwargs)
        except (RuntimeError, MemoryError) as error:
            self.out_of_memory.note("step", error)
            raise
        self.micro_steps += 1
        self.window_micro_steps = 0 if boundary else self.window_micro_steps + 1

    def _check_trains(self, caller: str) -> None:
        if self.strategy.optimizer is None:
            raise RuntimeError(f"{caller}: this engine was built without an optimizer (none passed to initialize, no "
                               "\"optimizer\" section), so it runs forward only, as DeepSpeed's does (a reference or "
                               "evaluation model). Pass optimizer= to initialize or add an \"optimizer\" section to train.")

    def _take_model_step(self, lr_kwargs: dict[str, Any] | None) -> None:
        if self._parking.offloaded:
            self._parking.check("the optimizer step")  # the pipeline engine's train_batch steps here, not in step()
        if self._grads_since_step:
            self._last_step = take_step(self.strategy, self.precision.loss_scaler, self.config.gradient_clipping,
                                        self.instruments.allgather, self._grad_norm)
        else:
            self._last_step = StepResult(True, 0.0)  # nothing to apply: weights and optimizer state stay
            self._warn_once("no-gradients", f"engine.step(): no gradient reached the model since the last step "
                            f"(step {self.global_steps + 1}: no engine.backward(loss) or loss.backward() before it); "
                            "weights and optimizer state were left unchanged. Call engine.backward(loss) before "
                            "engine.step().")
        self._grads_since_step = False
        if self._last_step.applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            self.skipped_steps += 1
            if not self.precision.loss_scaler.checks_overflow:  # fp16 overflows are the loss scaler's business
                self._report_nonfinite(self._last_step.grad_norm)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.tput_timer.step_done()
        gas = self.gradient_accumulation_steps()
        loss = self._window_loss / gas if gas != 1 else self._window_loss
        self.instruments.on_step(StepFigures(
            self.global_steps, self.global_samples, loss, self.train_batch_size(),
            self._window_tokens * self.topology.data.size, self.get_lr(), self.loss_scale, self.get_global_grad_norm(),
        ))
        self._window_loss, self._window_tokens = 0.0, 0

    def _grad_norm(self) -> torch.Tensor:
        """The norm over the whole model's gradients: this rank's share, summed over the pipeline stages and
        tensor-parallel ranks that hold the rest (tied and replicated weights are counted on one rank only)."""
        norm = self.strategy.grad_norm()
        axes = self.topology.model_parallel
        if not axes:
            return norm
        squared = norm.float().pow(2).reshape(1).to(self.device)
        for group in axes:
            self.comm.all_reduce(squared, group).wait()
        return squared.sqrt()[0]

    def _adopt_param_grads(self, caller: str) -> bool:
        """Take gradients that a backward not started by engine.backward left in `param.grad`, divided by
        gradient_accumulation_steps as DeepSpeed divides a direct backward's (zero/grad_buckets.py, [Note: whose
        gradient is it]); true if there were any."""
        found = self.strategy.loose_param_grads()
        if not found:
            return False
        if self.precision.loss_scaler.checks_overflow:
            raise RuntimeError(
                f"{caller}: gradients that engine.backward(loss) did not produce are in param.grad of {found} "
                "parameters (a direct loss.backward(), or another model's backward through this one); with fp16 they "
                "lack the loss scale engine.backward applies, so the step would be wrong. Call engine.backward(loss) "
                "instead of loss.backward(), and zero_grad() this model before its own backward if another model's "
                "loss passes through it.")
        self.strategy.adopt_param_grads(1.0 / self.gradient_accumulation_steps())
        self._grads_since_step = True
        if self.strategy.reduces_every_micro_step:
            self._warn_once("adopted", f"{caller}: took gradients from param.grad (a direct loss.backward()?); "
                            "with gradients partitioned they were held whole until now and reduced without overlap. "
                            "engine.backward(loss) reduces them during backward.")
        return True

    def _report_nonfinite(self, norm: float) -> None:
        problem = (f"step {self.global_steps + 1}: the gradient norm is {norm} (a nan/inf loss or gradient); the "
                   f"update was skipped (skipped_steps = {self.skipped_steps})")
        if self.config.nonfinite_grads == "raise":
            raise NonFiniteGradientError(f'nonfinite_grads = "raise": {problem}. Find where the loss becomes '
                                         'non-finite, or set "nonfinite_grads": "skip" to go on.')
        if self.global_rank == 0:
            logger.warning('%s. Set "nonfinite_grads": "raise" to stop instead.', problem)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned and self.global_rank == 0:
            logger.warning(message)
        self._warned.add(key)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communication."""
        if self.strategy.reduces_every_micro_step:
            raise RuntimeError(
                "engine.no_sync(): ZeRO stage 2 reduces gradients into partitions during every backward, so "
                "there is no local accumulation to defer; use gradient_accumulation_steps instead."
            )
        previous, self._in_no_sync = self._in_no_sync, True
        try:
            yield
        finally:
            self._in_no_sync = previous

    # --- seeing the run (profiling/) ----------------------------------------------------------
    def comms_summary(self, print_table: bool = True) -> str:
        """The table of collectives this rank issued (op, group, size, count, latency, bandwidths);
        printed by global rank 0, returned on every rank."""
        table = self.instruments.comms_summary()
        if print_table and self.global_rank == 0:
            print(table, flush=True)
        return table

    def memory_breakdown(self) -> MemoryBreakdown:
        """Bytes of parameters / masters / gradients / optimizer state / buffers on this rank, with peaks."""
        return self.instruments.memory_breakdown()

    # --- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """Write `save_dir/<tag>/`; a tag is one directory name (see `shardwise.checkpoint.save_checkpoint`)."""
        from ..checkpoint import save_checkpoint

        self._parking.check("engine.save_checkpoint()")
        return save_checkpoint(self, save_dir, tag, client_state or {}, save_latest, exclude_frozen_parameters)

    # --- accelerator memory between phases (state_offload.py) ---------------------------------
    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """DeepSpeed's: free the accelerator memory of this rank's training state of the kinds in `include`
        (OffloadStateTypeEnum members; default all) by copying it to host memory, until `reload_states()`. State
        already in host memory stays there. Forward needs lp_params back, backward lp_params and lp_grads, the
        step and checkpoints everything."""
        device = getattr(device, "value", device)
        if device == "none":
            self._warn_once("offload-none", "engine.offload_states(device=none): nothing offloaded (as in DeepSpeed); "
                            "pass device=OffloadDeviceEnum.cpu to free accelerator memory.")
            return
        if device != "cpu":
            raise ValueError(f"engine.offload_states(): device {device!r} is not supported; states can be offloaded to "
                             "host memory only (OffloadDeviceEnum.cpu), as in DeepSpeed, which refuses nvme too.")
        kinds = kind_names(include, "engine.offload_states()")
        self.checkpoint_writer.wait()  # a background save may still be reading them
        self._parking.offload(state_tensors(self.strategy, self.optimizer), kinds, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Put back what `offload_states()` took, byte for byte; nothing to do when nothing is offloaded."""
        self._parking.reload(non_blocking)

    def destroy(self) -> None:
        """Finish a background save and release what the engine holds outside memory (NVMe swap files)."""
        self.checkpoint_writer.wait()
        self.strategy.close()

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict[str, Any]]:
        from ..checkpoint import load_checkpoint

        self._parking.check("engine.load_checkpoint()")
        self.checkpoint_writer.wait()
        return load_checkpoint(self, load_dir, tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states and not load_module_only,
                               load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only)


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def _token_count(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Tokens in a micro-batch: the size of the first integer tensor input (token ids), else 0."""
    for value in (*inputs, *kwargs.values()):
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim() >= 2:
            return value.numel()
    return 0
