"""The optimizer step and gradient clipping on the local tensors of one-rank DTensors.

On a mesh of one rank (FSDP2 at world size 1) every DTensor's local tensor *is* the whole
tensor, so arithmetic on the local tensors is the arithmetic on the DTensors, bit for bit, for
any optimizer (Adafactor's row/column statistics included) and for the gradient norm. What
the DTensor path adds on top is host work per call: every ``_fused_adamw_``, ``_foreach_norm``,
``stack``, ``_foreach_mul_`` over ~150 parameters goes through DTensor's dispatch (sharding
propagation, a cache lookup hashing every argument's spec, unwrapping, rewrapping), and the norm
is redistributed (``full_tensor``) before it scales the gradients. On several ranks the local
tensors are shards and the DTensor path stays (sharded norms need their all-reduce).

``LocalShardStep`` keeps the optimizer's parameters and state DTensors between steps (what
``torch.distributed.checkpoint`` saves and reshards) and hands ``step()`` their local tensors:
a step pre-hook swaps each group's ``params`` and the ``state`` mapping to local views of the same
storage (the update lands in the DTensors' memory), the post-hook swaps them back and wraps any
state the step created (the first step's moments) as DTensors of the parameter's layout.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["LocalShardStep", "whole_local", "clip_local_"]


def whole_local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local tensor when ``t`` is a DTensor on a one-rank mesh (the whole tensor); ``t`` otherwise.

    Raises:
        ValueError: a DTensor on a mesh of several ranks (its local tensor is a shard).
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if t.device_mesh.size() != 1:
        raise ValueError(f"a DTensor on a mesh of {t.device_mesh.size()} ranks holds a shard, not the whole tensor")
    return t._local_tensor  # the same storage; to_local() would add an autograd node for nothing


def clip_local_(grads: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` on plain tensors without a host sync: the total L2 norm as a 0-dim tensor.

    The same arithmetic as ``torch.nn.utils.get_total_norm`` + ``clip_grads_with_norm_``
    (``coef = min(max_norm / (norm + 1e-6), 1)``, one ``_foreach_mul_``); ``max_norm = inf`` only
    measures (the coefficient would be 1).
    """
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(list(grads), 2.0)
    if max_norm < math.inf:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(list(grads), coef)
    return norm


class LocalShardStep:
    """Steps ``optimizer`` on the local tensors of its one-rank DTensor parameters (see the module docstring).

    Args:
        optimizer: an optimizer over DTensor parameters of one-rank meshes (plain tensors pass through).

    ``remove()`` detaches the hooks (the optimizer then steps on the DTensors again).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                whole_local(p)  # a shard fails here, at setup, not inside a step
        self.optimizer = optimizer
        self._saved: list[list[torch.Tensor]] | None = None
        self._state: Any = None
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (local view, the optimizer's parameter)
        # id(parameter) -> (its DTensor state dict, that dict's length, the dict of local views)
        self._cache: dict[int, tuple[dict[str, Any], int, dict[str, Any]]] = {}
        self._handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # ~10 us per parameter would cost as much as DTensor's dispatch saves: plain attribute reads, no
        # function calls per parameter, and the local state dicts reused while their DTensor dicts are the same
        from torch.distributed.tensor import DTensor

        if self._saved is not None:  # the previous step raised before its post-hook: put the DTensors back first
            self._post(optimizer, args, kwargs)
        dstate = optimizer.state
        lstate: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        cache = self._cache
        self._saved, self._pairs = [], []
        for group in optimizer.param_groups:
            self._saved.append(group["params"])
            params = []
            for p in group["params"]:
                if isinstance(p, DTensor):
                    local = p._local_tensor  # the whole tensor (checked at setup): the same storage
                    grad = p.grad
                    # .grad of the local view: the DTensor gradient's local tensor (set each step, cleared after)
                    local.grad = grad._local_tensor if grad is not None else None
                    src = dstate.get(p)
                    if src is not None:
                        hit = cache.get(id(p))
                        if hit is None or hit[0] is not src or hit[1] != len(src):
                            # a new or reloaded state (load_state_dict makes new dicts): local views of it; the
                            # step updates their tensors in place, so the views stay valid until it changes
                            hit = (src, len(src), {k: v._local_tensor if isinstance(v, DTensor) else v
                                                   for k, v in src.items()})
                            cache[id(p)] = hit
                        lstate[local] = hit[2]
                else:
                    local = p
                    if p in dstate:
                        lstate[p] = dstate[p]  # a plain parameter: its own state dict, updated in place
                params.append(local)
                self._pairs.append((local, p))
            group["params"] = params
        self._state, optimizer.state = dstate, lstate

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        from torch.distributed.tensor import DTensor

        lstate, optimizer.state = optimizer.state, self._state
        for group, saved in zip(optimizer.param_groups, self._saved or [], strict=True):
            group["params"] = saved
        for local, p in self._pairs:
            if local is not p:
                local.grad = None  # the DTensor keeps its gradient; the view must not keep it alive after zero_grad
            if p in optimizer.state or local not in lstate:
                continue  # state that existed before the step was updated in place, through the views
            if local is p:
                optimizer.state[p] = lstate[p]
                continue
            # state the step created (the first step): DTensors laid out as the parameter, over the same memory
            optimizer.state[p] = {
                k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
                if isinstance(v, torch.Tensor) and v.shape == local.shape and k != "step" else v
                for k, v in lstate[local].items()
            }
        self._saved, self._state, self._pairs = None, None, []
