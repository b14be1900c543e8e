"""Analytic SGD steps for many clients of a Linear/ReLU model at once.

The vectorised engine's path for models made of ``Flatten``, ``Linear`` and ``ReLU``
(``mlp``, ``logreg``) trained on plain cross-entropy with no penalty: the forward pass,
the cross-entropy gradient and the backward pass written out as batched matrix products
over a block of clients, with plain SGD applied in place (``W -= lr * g^T h`` as one
``baddbmm_``, no gradient tensor). It computes what autograd and ``torch.optim.SGD``
compute, up to floating-point rounding (``tests/test_engines.py``); docs/performance.md
measures what it saves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LinearNames = tuple[str, str | None]
"""A Linear layer's parameter names in ``named_parameters``: (weight, bias or None)."""


def linear_stack(model: nn.Module) -> list[LinearNames] | None:
    """The Linear layers of ``model`` in order, if it is an ``nn.Sequential`` of an
    optional leading ``Flatten`` then ``Linear``, ``ReLU``, ..., ``Linear``; else None."""
    if not isinstance(model, nn.Sequential):
        return None
    modules = list(model.named_children())
    if modules and isinstance(modules[0][1], nn.Flatten):
        modules = modules[1:]
    if len(modules) % 2 == 0:
        return None
    layers: list[LinearNames] = []
    for position, (name, module) in enumerate(modules):
        if position % 2 == 1:
            if type(module) is not nn.ReLU:
                return None
            continue
        if type(module) is not nn.Linear:
            return None
        layers.append((f"{name}.weight", f"{name}.bias" if module.bias is not None else None))
    return layers


@dataclass(frozen=True)
class LinearStackStep:
    """One SGD step of every client of a block, on a model :func:`linear_stack` accepts.

    Parameters are ``[clients, *shape]`` tensors keyed by name; a batch is ``inputs``
    ``[clients, width, *input_shape]``, ``targets`` and ``mask`` ``[clients, width]``
    (1 for a real sample, 0 for padding). A client's loss is the mean cross-entropy over
    its real samples, as the sequential engine's ``F.cross_entropy`` of its batch.
    """

    layers: list[LinearNames]

    def __call__(
        self, params: dict[str, Tensor], inputs: Tensor, targets: Tensor, mask: Tensor, lr: float | None
    ) -> tuple[dict[str, Tensor] | None, Tensor]:
        """With ``lr``: apply ``w -= lr * grad`` in place and return ``(None, losses)``;
        with ``lr=None``: return ``(gradients, losses)``. ``losses[n]`` is client n's
        batch loss (detached)."""
        clients, width = targets.shape
        activations = [inputs.reshape(clients, width, -1)]
        last = len(self.layers) - 1
        for index, (weight_name, bias_name) in enumerate(self.layers):
            weight = params[weight_name].transpose(1, 2)
            if bias_name is None:
                out = torch.bmm(activations[-1], weight)
            else:
                out = torch.baddbmm(params[bias_name].unsqueeze(1), activations[-1], weight)
            activations.append(out.clamp_(min=0.0) if index < last else out)
        logits = activations.pop()
        scale = mask / mask.sum(dim=1, keepdim=True).clamp_min(1.0)  # 1 / real samples, 0 on padding
        log_probs = F.log_softmax(logits, dim=-1)
        picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        losses = -(picked * scale).sum(dim=1)
        # d(mean CE)/d(logits) = (softmax - onehot) / real samples, per client.
        delta = log_probs.exp_()
        delta.scatter_add_(-1, targets.unsqueeze(-1), torch.full_like(picked, -1.0).unsqueeze(-1))
        delta.mul_(scale.unsqueeze(-1))
        gradients: dict[str, Tensor] = {}
        for index in range(last, -1, -1):
            weight_name, bias_name = self.layers[index]
            weight, inputs_here = params[weight_name], activations[index]
            # The gradient reaching the layer below uses this layer's weights before the step.
            below = torch.bmm(delta, weight).mul_(inputs_here > 0) if index > 0 else None
            if lr is None:
                gradients[weight_name] = torch.bmm(delta.transpose(1, 2), inputs_here)
                if bias_name is not None:
                    gradients[bias_name] = delta.sum(dim=1)
            else:
                weight.baddbmm_(delta.transpose(1, 2), inputs_here, alpha=-lr)
                if bias_name is not None:
                    params[bias_name].sub_(delta.sum(dim=1), alpha=lr)
            if below is not None:
                delta = below
        return (None if lr is not None else gradients), losses.detach()
