"""A catalogue of optimizers as users write them over ``shards(model)``: every ``torch.optim``
optimizer and a broad list from ``pytorch_optimizer``, each with the way it is stepped.

``catalogue_body(names)`` runs on the harness ranks: for each optimizer it trains the same model in
one process and sharded, ``STEPS`` steps in float64, and returns, per name, either the relative
error (max |difference| / max |movement|) or the refusal's message, and the path taken.
"""

from __future__ import annotations

import copy
import random
import sys
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from test_whole_optim import Shapes

STEPS = 5
DTYPE = torch.float64

Factory = Callable[[list], Any]
"""Builds an optimizer (or a list of them, the first taking the closure) over the model's tensors."""


def _po() -> Any:
    import pytorch_optimizer
    return pytorch_optimizer


def _muon_groups(params: list, adamw_first: bool) -> list[dict]:
    muon = {"params": [p for p in params if p.ndim == 2], "use_muon": True, "lr": 2e-2}
    adamw = {"params": [p for p in params if p.ndim != 2], "use_muon": False, "lr": 1e-2}
    return [adamw, muon] if adamw_first else [muon, adamw]


class MuonAdamW(torch.optim.Optimizer):
    """A user's combined class: Muon-style orthogonalised momentum on 2-D tensors, AdamW on the rest,
    in one ``Optimizer`` (its ``__init__`` reads ``p.ndim`` of every parameter it is given)."""

    def __init__(self, params, lr=2e-2, adamw_lr=1e-2, betas=(0.9, 0.95), eps=1e-8):
        params = list(params)
        groups = [{"params": [p for p in params if p.ndim == 2], "muon": True, "lr": lr},
                  {"params": [p for p in params if p.ndim != 2], "muon": False, "lr": adamw_lr}]
        super().__init__(groups, {"betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["muon"]:
                    buf = state.setdefault("momentum", torch.zeros_like(p)).mul_(b1).add_(p.grad)
                    x = buf / buf.norm().clamp(min=1e-12)
                    for _ in range(3):
                        x = 1.5 * x - 0.5 * x @ x.T @ x
                    p.add_(x, alpha=-group["lr"])
                    continue
                m = state.setdefault("m", torch.zeros_like(p)).mul_(b1).add_(p.grad, alpha=1 - b1)
                v = state.setdefault("v", torch.zeros_like(p)).mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-group["lr"])


class GlobalNormSGD(torch.optim.Optimizer):
    """A user's class: SGD on grads divided by their norm over all parameters (couples every tensor)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / norm, alpha=-group["lr"])


def torch_specs() -> dict[str, Factory]:
    o = torch.optim
    return {
        "SGD": lambda p: o.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2),
        "Adam": lambda p: o.Adam(p, lr=1e-2, amsgrad=True),
        "AdamW": lambda p: o.AdamW(p, lr=1e-2),
        "Adagrad": lambda p: o.Adagrad(p, lr=1e-2),
        "Adadelta": lambda p: o.Adadelta(p),
        "Adamax": lambda p: o.Adamax(p, lr=1e-2),
        "ASGD": lambda p: o.ASGD(p, lr=1e-2, t0=2),
        "NAdam": lambda p: o.NAdam(p, lr=1e-2),
        "RAdam": lambda p: o.RAdam(p, lr=1e-2, decoupled_weight_decay=True, weight_decay=1e-2),
        "RMSprop": lambda p: o.RMSprop(p, lr=1e-2, centered=True, momentum=0.5),
        "Rprop": lambda p: o.Rprop(p, lr=1e-2),
        "SparseAdam": lambda p: o.SparseAdam(p, lr=1e-2),
        "LBFGS": lambda p: o.LBFGS(p, lr=0.5, max_iter=4, history_size=3),
        "LBFGS(strong_wolfe)": lambda p: o.LBFGS(p, lr=1, max_iter=4, line_search_fn="strong_wolfe"),
        "Adafactor": lambda p: o.Adafactor(p, lr=1e-2),
        "SGD(closure)": lambda p: o.SGD(p, lr=1e-2, momentum=0.9),
        "Adafactor(closure)": lambda p: o.Adafactor(p, lr=1e-2),
        "Muon+AdamW": lambda p: [o.Muon([t for t in p if t.ndim == 2], lr=2e-2),
                                 o.AdamW([t for t in p if t.ndim != 2], lr=1e-2)],
    }


def po_specs() -> dict[str, Factory]:
    names = ("A2Grad AccSGD AdaBelief AdaBound AdaDelta AdaFactor AdaGC Adai Adalite AdaMax AdamC AdamG AdaMod "
             "AdamP AdamS AdamWSN Adan AdaNorm AdaPNM AdaSmooth AdaTAM AdEMAMix ADOPT AggMo Aida Alice "
             "Amos Ano APOLLO ApolloDQN AvaGrad BCOS CAME Conda DAdaptAdaGrad DAdaptAdam DAdaptAdan DAdaptLion "
             "DiffGrad DualAdam EmoNavi EXAdam Fira FOCUS Fromage FTRL GaLore Grams Gravity "
             "GrokFastAdamW Kate Kron Lamb LaProp LARS Lion MADGRAD MARS MSVAG Nero NovoGrad PAdam PID PNM Prodigy "
             "QHAdam QHM RACS Ranger SCION SGDP SGDSaI SGDW Shampoo SignSGD SimplifiedAdEMAMix SM3 SPAM "
             "SPlus SRMM StableAdamW StableSPAM SWATS TAM Tiger VSGD Yogi").split()
    specs: dict[str, Factory] = {f"po.{n}": (lambda n: lambda p: getattr(_po(), n)(p))(n) for n in names}
    specs.update({
        "po.Lamb(pre_norm)": lambda p: _po().Lamb(p, pre_norm=True),
        "po.Ranger21": lambda p: _po().Ranger21(p, num_iterations=STEPS, num_warm_up_iterations=1,
                                                num_warm_down_iterations=1),
        "po.LBFGS": lambda p: _po().LBFGS(p, lr=0.5, max_iter=4),
        "po.SAM(AdamW)": lambda p: _po().SAM(p, torch.optim.AdamW, lr=1e-2),
        "po.FriendlySAM(AdamW)": lambda p: _po().FriendlySAM(p, torch.optim.AdamW, lr=1e-2),
        "po.LookSAM(AdamW)": lambda p: _po().LookSAM(p, torch.optim.AdamW, k=2, lr=1e-2),
        "po.BSAM": lambda p: _po().BSAM(p, num_data=48, lr=1e-2),
        "po.AliG": lambda p: _po().AliG(p, max_lr=None),
        "po.AdaHessian": lambda p: _po().AdaHessian(p),
        "po.SophiaH": lambda p: _po().SophiaH(p),
        "po.Muon(adamw first)": lambda p: _po().Muon(_muon_groups(p, True)),
        "po.Muon": lambda p: _po().Muon(_muon_groups(p, False)),
        "po.GaLore(rank)": lambda p: _po().GaLore([
            {"params": [t for t in p if t.ndim == 2], "rank": 2, "update_proj_gap": 2, "scale": 0.25,
             "projection_type": "std"}, {"params": [t for t in p if t.ndim != 2]}], lr=1e-2),
        "po.ScalableShampoo(from step 2)": lambda p: _po().ScalableShampoo(
            p, start_preconditioning_step=2, preconditioning_compute_steps=1, statistics_compute_steps=1),
        "po.SOAP": _soap,
        "po.SOAP(every 2 steps)": lambda p: _soap(p, precondition_frequency=2),
        "po.AdaShift": lambda p: _po().AdaShift(p, keep_num=2),
        "po.DAdaptSGD": lambda p: _po().DAdaptSGD(p, d0=1e-3),
        "po.Lookahead(AdamW)": lambda p: _po().Lookahead(torch.optim.AdamW(p, lr=1e-2), k=2),
        "po.Lookahead(Adafactor)": lambda p: _po().Lookahead(torch.optim.Adafactor(p, lr=1e-2), k=2),
    })
    return specs


MODES = {"LBFGS": "closure", "LBFGS(strong_wolfe)": "closure", "SGD(closure)": "closure",
         "Adafactor(closure)": "closure", "po.LBFGS": "closure", "po.SAM(AdamW)": "sam", "po.BSAM": "sam",
         "po.FriendlySAM(AdamW)": "sam", "po.LookSAM(AdamW)": "sam", "po.AliG": "loss",
         "po.AdaHessian": "hessian", "po.SophiaH": "hessian"}
"""How each optimizer not stepped plainly is stepped: ``step(closure)``; a backward, then
``step(closure)`` (SAM's docs); ``step(lambda: loss)`` after a backward (AliG's docs); a backward
that keeps its graph for a Hessian estimate (``create_graph=True``)."""


def user_specs() -> dict[str, Factory]:
    """Optimizers users write themselves."""
    return {"MuonAdamW (user class)": MuonAdamW, "GlobalNormSGD (user class)": GlobalNormSGD}


def specs() -> dict[str, Factory]:
    """Every catalogued optimizer by name."""
    return {**torch_specs(), **user_specs(), **po_specs()}


def _full_rank(params: list) -> tuple[list, list]:
    """(the matrices whose grads have full rank in ``Shapes``: no 1-wide side, the rest)."""
    matrices = [t for t in params if t.ndim == 2 and min(t.shape) > 1]
    return matrices, [t for t in params if all(t is not m for m in matrices)]


def _soap(params: list, **options: Any) -> list:
    """SOAP on full-rank statistics only (matrices with no 1-wide side, preconditioned along their shorter
    side): the eigenbasis of a rank-deficient statistic is not unique, and one process whose grads differ
    by 1e-15 moves 0.1-0.4 of the way elsewhere."""
    matrices, rest = _full_rank(params)
    return [_po().SOAP(matrices, max_precondition_dim=5, **options), torch.optim.AdamW(rest, lr=1e-2)]


def _optimizers(name: str, params: list, path: Any = None) -> list[torch.optim.Optimizer]:
    """The optimizers of ``name`` over ``params``, routed to ``path`` if one is named."""
    built = specs()[name](params)
    opts = built if isinstance(built, list) else [built]
    if path is not None:
        from parts.partition import route
        route(opts[0], path)
    return opts


def _batch(step: int, rank: Any, world: int) -> torch.Tensor:
    x = torch.randn(4 * 12, 5, generator=torch.Generator().manual_seed(100 + step), dtype=DTYPE)
    return x if rank is None else x.chunk(world)[rank]


def _step(name: str, model: torch.nn.Module, opts: list, x: torch.Tensor) -> None:
    def closure() -> torch.Tensor:
        for o in opts:
            o.zero_grad()
        loss = model(x)
        loss.backward()
        return loss
    mode = MODES.get(name, "plain")
    if mode in ("closure", "sam"):
        if mode == "sam":
            closure()
        opts[0].step(closure)
        return
    loss = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_graph=True warns of a reference cycle
        loss.backward(create_graph=mode == "hessian")
    for o in opts:
        o.step((lambda: loss) if mode == "loss" else None)


def step_both(reference: torch.nn.Module, model: torch.nn.Module, opts: tuple, step: int) -> None:
    """Step ``step``: ``reference`` on the whole batch, ``model`` on this rank's slice of it, then every
    optimizer of ``opts`` steps and zeroes its grads."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
    reference(x).backward()
    model(x.chunk(world)[rank]).backward()
    for o in opts:
        o.step()
        o.zero_grad()


def _train(name: str, model: torch.nn.Module, params: list, rank: Any, world: int, path: Any = None) -> list:
    """The optimizers of ``name`` after ``STEPS`` steps of ``model``."""
    opts = _optimizers(name, params, path)
    for step in range(STEPS):
        _step(name, model, opts, _batch(step, rank, world))
        for o in opts:
            o.zero_grad()
    return opts


def _seed(seed: int) -> None:
    """Seed every generator an optimizer may draw from (Kron draws from numpy's)."""
    torch.manual_seed(seed)
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)


def _compare(name: str, rank: int, world: int, path: Any = None) -> tuple[Any, Any]:
    """(The relative error of ``name`` sharded against one process, or the message it was refused with;
    the path its first optimizer took)."""
    from parts.partition import attach, detach, full_state_dict, partition_module, route, shards
    torch.manual_seed(0)
    reference = Shapes().to(DTYPE)
    start = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    model = partition_module(copy.deepcopy(reference))
    _seed(1)
    try:
        _train(name, reference, list(reference.parameters()), None, world)
        failed = None
    except Exception as error:  # SparseAdam steps no dense grads anywhere: the sharded run must refuse it
        failed = f"one process fails: {type(error).__name__}: {error}"
    attach(model)
    _seed(1)
    try:
        taken = route(_train(name, model, shards(model), rank, world, path)[0])
    except Exception as error:  # a refusal: every rank raises it before any collective of the step
        return f"{type(error).__name__}: {error}", None
    finally:
        got = full_state_dict(model, rank0_only=False)
        detach(model)
    moved = max(float((v - start[k]).abs().max()) for k, v in reference.state_dict().items())
    if failed or moved < 1e-6:
        return failed or f"the one-process model did not move ({moved:.1e})", taken
    return max(float((got[k] - v).abs().max()) for k, v in reference.state_dict().items()) / moved, taken


def catalogue_body(names: list[str], path: Any = None) -> dict[str, tuple[Any, Any]]:
    """Per name: (the relative error of the sharded run (routed to ``path`` if named), or its refusal's
    message; the path taken)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return {name: _compare(name, rank, world, path) for name in names}
