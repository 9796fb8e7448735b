"""Scoring weights: a state dict's loss and metrics on the evaluation batches, as written."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hf_rebasin.evaluation.evaluate import Metric, Task, evaluate_loss
from hf_rebasin.io.rebuild import rebuilt

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["Scorer"]


class Scorer:
    """Scores state dicts on one rebuilt model per (template, untie), loading each in place:
    rebuilding per α or per comparison would re-initialise every weight first (2.7 s for GPT-2
    small on 2 cores, against 0.04 s to load new weights).

    ``dtype`` is the dtype the output is written in (``dtypes``: the tensors written in one of
    their own): each state dict is rounded to it (and back to float32, where the scoring runs)
    first, so a score is that of the weights the user gets, not of the float32 weights before the
    cast. float32 changes nothing. The scorer keeps its copy for that rounding only: what is
    written reads the workspace's `run.dtypes.OutputDtype`."""

    def __init__(
        self,
        dtype: torch.dtype = torch.float32,
        metrics: Sequence[Metric] = (),
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        self._models: dict[tuple[int, bool], PreTrainedModel] = {}
        self._dtype = dtype
        self._dtypes = dict(dtypes or {})  # tensors written in a dtype of their own (a bf16 model's float32 norms)
        self.metrics = tuple(metrics)  # `evaluate.metrics`, scored beside the loss

    def __call__(
        self,
        template: PreTrainedModel,
        sd: Mapping[str, Tensor],
        untie: bool,
        batches: Sequence[Mapping[str, Tensor]],
        task: Task,
    ) -> dict[str, Any]:
        """Loss and metric of ``sd`` on the evaluation batches (``rebasin.json``'s ``merged``)."""
        if self._dtype != torch.float32 or any(d != torch.float32 for d in self._dtypes.values()):
            sd = {
                k: v.to(self._dtypes.get(k, self._dtype)).to(v.dtype) if v.is_floating_point() else v
                for k, v in sd.items()
            }
        key = (id(template), untie)
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = rebuilt(template, sd, untie)
        else:
            model.load_state_dict(dict(sd), strict=True)
        result = evaluate_loss(model, batches, task, self.metrics)
        return {"loss": result.loss, "metric": dict(result.metric), "count": result.count}

    def model(self, model: Any, batches: Sequence[Mapping[str, Tensor]], task: Task) -> dict[str, Any]:
        """Loss and metric of a model as it is (an input: not rounded, not rebuilt)."""
        result = evaluate_loss(model, batches, task, self.metrics)
        return {"loss": result.loss, "metric": dict(result.metric)}
