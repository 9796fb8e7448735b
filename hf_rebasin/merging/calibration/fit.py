"""Which of the moved model's parameters calibration fits, each set containing the one before:

- ``rows``: the rows of tokens the target lacks (a chat fine-tune's new tokens), embedding and head;
- ``norms``: those, and every normalization's scale and shift and every linear layer's bias;
- ``low-rank``: those, and a rank-r correction B·A beside every linear layer (attention, MLP,
  experts stored as linear layers), folded into its weight afterwards: the output is a plain model;
- ``full``: every parameter.

A LoRA adapter is fitted as it is written: its own factors at their rank (``adapter``), hooked
onto the target's layers with their scale, and the new tokens' rows.

A correction starts at zero (B = 0), so before the first step the student is the moved model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

__all__ = ["FITS", "Correction", "Fit", "Fitted", "adapter_fittable", "fittable"]

Fit = Literal["rows", "norms", "low-rank", "full", "adapter"]
FITS: tuple[Fit, ...] = ("rows", "norms", "low-rank", "full")


@dataclass
class Correction:
    """A rank-r update of one linear layer's output: ``x ↦ x·Aᵀ·Bᵀ``."""

    module: Any  # an nn.Linear or GPT-2's Conv1D
    a: nn.Parameter  # (r, in)
    b: nn.Parameter  # (out, r)
    transposed: bool  # GPT-2's Conv1D stores its weight (in, out)
    scale: float = 1.0

    def fold(self) -> None:
        delta = self.scale * (self.b @ self.a).detach()
        weight = self.module.weight
        weight.data += (delta.T if self.transposed else delta).to(weight.dtype)


@dataclass
class Fitted:
    """The parameters being fitted, and the corrections to fold when fitting ends."""

    fit: Fit
    params: list[nn.Parameter]
    corrections: list[Correction] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)
    rows: int = 0  # new tokens' rows fitted

    @property
    def size(self) -> int:
        """Numbers fitted (a masked embedding counts only its fitted rows)."""
        low = sum(c.a.numel() + c.b.numel() for c in self.corrections)
        return low + sum(p.numel() for p in self.params if not getattr(p, "_rows_only", False)) + self._row_numbers()

    def _row_numbers(self) -> int:
        return sum(self.rows * p.shape[1] for p in self.params if getattr(p, "_rows_only", False))

    def unhook(self) -> None:
        """The corrections taken off their layers (an adapter's factors are read, not folded)."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    def fold(self) -> None:
        """The corrections written into their layers' weights; hooks removed, nothing trainable left."""
        self.unhook()
        with torch.no_grad():
            for c in self.corrections:
                c.fold()
        self.corrections.clear()


def _linear(module: Any) -> tuple[int, int, bool] | None:
    """(in, out, transposed) of a linear layer; None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        fan_in, fan_out = module.weight.shape
        return int(fan_in), int(fan_out), True
    return None


def _norms(model: Any) -> Iterator[nn.Parameter]:
    for module in model.modules():
        if "norm" in type(module).__name__.lower():
            yield from module.parameters(recurse=False)
        elif _linear(module) is not None and getattr(module, "bias", None) is not None:
            yield module.bias


def _row_params(model: Any, new_rows: Tensor) -> list[nn.Parameter]:
    """The embedding and (untied) head, their gradients kept to ``new_rows``."""
    out: list[nn.Parameter] = []
    mask: Tensor | None = None
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or any(weight is p for p in out):
            continue
        if mask is None or mask.shape[0] != weight.shape[0]:
            mask = torch.zeros(weight.shape[0], 1, dtype=weight.dtype, device=weight.device)
            mask[new_rows.to(weight.device)] = 1
        keep = mask
        weight.requires_grad_(True)
        weight.register_hook(lambda g, keep=keep: g * keep)
        weight._rows_only = True  # type: ignore[attr-defined]
        out.append(weight)
    return out


def _corrections(model: Any, rank: int, generator: torch.Generator) -> list[Correction]:
    head = model.get_output_embeddings()
    out = []
    for module in model.modules():
        shape = _linear(module)
        if shape is None or module is head:
            continue
        fan_in, fan_out, transposed = shape
        weight = module.weight
        r = min(rank, fan_in, fan_out)
        a = torch.randn(r, fan_in, generator=generator) / math.sqrt(fan_in)
        a_param = nn.Parameter(a.to(device=weight.device, dtype=torch.float32))
        b_param = nn.Parameter(torch.zeros(fan_out, r, device=weight.device, dtype=torch.float32))
        out.append(Correction(module, a_param, b_param, transposed))
    return out


def fittable(model: Any, fit: Fit, *, rank: int, new_rows: Tensor, seed: int) -> Fitted:
    """``model``'s parameters for ``fit`` made trainable (every other one frozen), with the
    corrections of ``low-rank`` hooked onto their layers."""
    for p in model.parameters():
        p.requires_grad_(fit == "full")
    if fit == "full":
        return Fitted(fit, list(model.parameters()))
    params = _row_params(model, new_rows) if len(new_rows) else []
    if fit != "rows":
        params += [p for p in _norms(model) if all(p is not q for q in params)]
    for p in params:
        p.requires_grad_(True)
    fitted = Fitted(fit, params, rows=len(new_rows))
    if fit == "low-rank":
        fitted.corrections = _corrections(model, rank, torch.Generator().manual_seed(seed))
        for c in fitted.corrections:
            fitted.hooks.append(c.module.register_forward_hook(_hook(c)))
            fitted.params += [c.a, c.b]
    return fitted


def _hook(c: Correction) -> Any:
    def add(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        x = inputs[0]
        return output + (c.scale * ((x.to(c.a.dtype) @ c.a.T) @ c.b.T)).to(output.dtype)

    return add


def adapter_fittable(model: Any, factors: Mapping[str, tuple[Tensor, Tensor, float]], *, new_rows: Tensor) -> Fitted:
    """An adapter's factors (module name → (A, B, scale) as PEFT stores them: A (r, in), B (out, r))
    hooked onto ``model``'s layers and fitted, with the new tokens' rows; nothing else trains."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = _row_params(model, new_rows) if len(new_rows) else []
    fitted = Fitted("adapter", params, rows=len(new_rows))
    for name, (a, b, scale) in factors.items():
        module = model.get_submodule(name)
        weight = module.weight
        c = Correction(
            module,
            nn.Parameter(a.detach().to(device=weight.device, dtype=torch.float32).clone()),
            nn.Parameter(b.detach().to(device=weight.device, dtype=torch.float32).clone()),
            transposed=False,
            scale=scale,
        )
        fitted.corrections.append(c)
        fitted.hooks.append(module.register_forward_hook(_hook(c)))
        fitted.params += [c.a, c.b]
    return fitted
