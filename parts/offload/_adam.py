"""Adam and AdamW stepped in place for ``OffloadedOptimizer``: torch's update, no fresh temporaries.

torch's single-tensor Adam (the CPU path) allocates two parameter-sized temporaries per
parameter and step (``exp_avg_sq.sqrt()`` and its quotient by the bias correction). Above
the mmap threshold the store fixes (``_heap``), each is a fresh mapping whose every page
faults when written: two faults per 4 KiB of parameter per step, CPU time in the kernel. This
update runs the same operations in the same order on the same operands, writing the
denominator into one scratch buffer the optimizer keeps (``out=`` and in-place ops; a large
parameter a slice at a time), so its bits are torch's. It takes only what it reproduces
exactly: ``torch.optim.Adam`` or ``AdamW`` themselves (not subclasses), float ``lr`` and
betas, real floating CPU parameters with dense grads, the default (single-tensor)
implementation, no step hooks, and state already initialised (a parameter's first step goes
through torch). Anything else returns False and the caller runs the wrapped optimizer's own
``step()``.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

_KINDS = (torch.optim.Adam, torch.optim.AdamW)


def _group_ok(group: dict[str, Any]) -> bool:
    """True for a group whose options take the single-tensor path with scalar hyperparameters."""
    beta1, beta2 = group["betas"]
    scalars = all(isinstance(v, float) for v in (group["lr"], beta1, beta2, group["eps"]))
    return scalars and "decoupled_weight_decay" in group and not group.get("foreach") and not group.get("fused") \
        and not group.get("capturable") and not group.get("differentiable")


def _param_ok(p: torch.Tensor, state: dict[str, Any], amsgrad: bool) -> bool:
    """True for a real floating CPU parameter with a dense grad and its Adam state in memory."""
    names = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    return (p.device.type == "cpu" and p.is_floating_point() and not p.grad.is_sparse
            and all(isinstance(state.get(n), torch.Tensor) for n in names)
            and state["step"].device.type == "cpu" and p.grad.dtype == p.dtype)


def _hooked(optimizer: torch.optim.Optimizer) -> bool:
    """True if the optimizer has step hooks of its own (its ``step()`` would run them)."""
    return bool(getattr(optimizer, "_optimizer_step_pre_hooks", None)
                or getattr(optimizer, "_optimizer_step_post_hooks", None))


SLICE_BYTES = 8 << 20
"""The denominator is computed this many bytes of a parameter at a time (a multiple of every
vector width: each slice but the last runs whole vectors, as the whole tensor would), so the
scratch stays small however large the parameter; the ops are elementwise: the same bits."""


def _slices(param: torch.Tensor, exp_avg: torch.Tensor, second: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """``(param, exp_avg, second)`` as aligned flat slices of ``SLICE_BYTES``, or whole if any is not contiguous."""
    tensors = (param, exp_avg, second)
    if not all(t.is_contiguous() for t in tensors):
        yield tensors
        return
    span = max(1, SLICE_BYTES // param.element_size())
    flat = [t.view(-1) for t in tensors]
    for start in range(0, param.numel(), span):
        yield tuple(t[start:start + span] for t in flat)


class InplaceAdam:
    """Steps a plain Adam/AdamW in place (module docstring); ``scratch`` is its one reused buffer."""

    def __init__(self) -> None:
        self.scratch = torch.empty(0, device="cpu")
        self.steps = 0  # parameters stepped here (for tests and benchmarks)

    @property
    def held_bytes(self) -> int:
        """Bytes of the scratch buffer (at most ``SLICE_BYTES``, or a non-contiguous parameter's size)."""
        return self.scratch.nbytes

    def applies(self, optimizer: torch.optim.Optimizer) -> bool:
        """True if ``step`` reproduces ``optimizer.step()`` for the parameters now in its groups."""
        if type(optimizer) not in _KINDS or _hooked(optimizer):
            return False
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params and not _group_ok(group):
                return False
            if not all(_param_ok(p, optimizer.state.get(p, {}), group["amsgrad"]) for p in params):
                return False
        return True

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One Adam/AdamW step of every parameter with a grad in ``optimizer``'s groups."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, optimizer.state[p], group)

    def _denominator(self, like: torch.Tensor) -> torch.Tensor:
        """The scratch buffer as a tensor shaped and typed like ``like`` (grown if too small)."""
        if self.scratch.nbytes < like.nbytes:
            self.scratch = torch.empty(like.nbytes, dtype=torch.uint8, device="cpu")
        return self.scratch[:like.nbytes].view(like.dtype).view(like.shape)

    def _update(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """torch's ``_single_tensor_adam`` for one parameter (non-capturable, real), denominator in scratch."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        grad = param.grad if not group["maximize"] else -param.grad
        exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
        step_t += 1
        if wd != 0:
            if group["decoupled_weight_decay"]:
                param.mul_(1 - lr * wd)
            else:
                grad = grad.add(param, alpha=wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = step_t.item()
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        second = exp_avg_sq
        if group["amsgrad"]:
            torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
            second = state["max_exp_avg_sq"]
        for p, m, v in _slices(param, exp_avg, second):
            denom = self._denominator(v)
            torch.sqrt(v, out=denom)
            denom.div_(bias_correction2_sqrt).add_(eps)
            p.addcdiv_(m, denom, value=-step_size)
        self.steps += 1
