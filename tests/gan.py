"""A two-engine script: a tiny GAN trained in the order of DeepSpeed's DCGAN tutorial, and its oracle.

The generator's loss is computed through the discriminator, so the generator's backward also reaches
the discriminator's parameters. Torch leaves those gradients in `param.grad`, and the tutorial's
`netD.zero_grad()` at the top of the next iteration clears them; an engine that kept them would step
the discriminator on the generator's loss too.

`gan_run` runs with any library that has DeepSpeed's API (`shardwise`, `deepspeed`), `gan_oracle` is
the same loop in plain PyTorch on the whole global batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NOISE, HIDDEN, FEATURES, MICRO = 4, 16, 6, 4


def make_gan(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    generator = torch.nn.Sequential(torch.nn.Linear(NOISE, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, FEATURES))
    discriminator = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.LeakyReLU(0.2),
                                        torch.nn.Linear(HIDDEN, 1))
    return generator, discriminator


def gan_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step `step`: real samples and generator noise."""
    g = torch.Generator().manual_seed(500 + step)
    real = torch.randn(size, FEATURES, generator=g) * 0.5 + 1.0
    noise = torch.randn(size, NOISE, generator=g)
    return real, noise


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits.squeeze(-1), torch.full((logits.shape[0],), target))


def gan_iteration(net_g: Any, net_d: Any, backward_d: Any, step_d: Any, backward_g: Any, step_g: Any,
                  real: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One iteration in the tutorial's order; returns the discriminator's and the generator's loss."""
    net_d.zero_grad()
    err_real = _bce(net_d(real), 1.0)
    backward_d(err_real)
    fake = net_g(noise)
    err_fake = _bce(net_d(fake.detach()), 0.0)
    backward_d(err_fake)
    step_d()
    net_g.zero_grad()
    err_g = _bce(net_d(fake), 1.0)
    backward_g(err_g)
    step_g()
    return (err_real + err_fake).detach(), err_g.detach()


def gan_config(stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        # small modules: keep every parameter partitioned (from world 2: alone, [Note: a unit of one] reads them whole)
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "steps_per_print": 10_000, "zero_optimization": zero,
            "optimizer": {"type": "Adam", "params": {"lr": 5e-2, "betas": [0.5, 0.999]}}}


def gan_run(library: str, stage: int, steps: int) -> tuple[list[float], list[float]]:
    """On each rank: two engines, the tutorial's loop; the losses averaged over the global batch."""
    import importlib

    import torch.distributed as dist

    ds = importlib.import_module(library)
    if library == "deepspeed" and not dist.is_initialized():
        ds.init_distributed(dist_backend="gloo")
    generator, discriminator = make_gan()
    engine_d, *_ = ds.initialize(model=discriminator, model_parameters=discriminator.parameters(),
                                 config=gan_config(stage))
    engine_g, *_ = ds.initialize(model=generator, model_parameters=generator.parameters(), config=gan_config(stage))
    rank, world = dist.get_rank(), dist.get_world_size()
    d_losses, g_losses = [], []
    for step in range(steps):
        real, noise = (t[rank * MICRO : (rank + 1) * MICRO] for t in gan_batch(step, MICRO * world))
        # The tutorial calls the modules (netD, netG) and the engines' backward and step.
        err_d, err_g = gan_iteration(engine_g.module, engine_d.module, engine_d.backward, engine_d.step,
                                     engine_g.backward, engine_g.step, real, noise)
        both = torch.stack([err_d, err_g]).float()
        dist.all_reduce(both)
        d_losses.append(both[0].item() / world)
        g_losses.append(both[1].item() / world)
    return d_losses, g_losses


def gan_oracle(steps: int, world: int) -> tuple[list[float], list[float]]:
    generator, discriminator = make_gan()
    opt_g = torch.optim.Adam(generator.parameters(), lr=5e-2, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=5e-2, betas=(0.5, 0.999))
    d_losses, g_losses = [], []
    for step in range(steps):
        real, noise = gan_batch(step, MICRO * world)
        err_d, err_g = gan_iteration(generator, discriminator, torch.Tensor.backward, opt_d.step,
                                     torch.Tensor.backward, opt_g.step, real, noise)
        d_losses.append(err_d.item())
        g_losses.append(err_g.item())
    return d_losses, g_losses
