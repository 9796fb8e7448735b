"""F1 as a local `evaluate` metric script: what a recipe's `evaluate.metrics` loads without the network.

``evaluate.load("f1")`` fetches the Hub's F1 (scikit-learn underneath); this file computes the same
number by hand, macro-averaged or of one positive class, so the shipped recipes and the tests run
offline. A recipe names it by its path relative to the recipe: ``metrics: [{name: metrics/f1.py,
kwargs: {average: macro}}]``.
"""

from __future__ import annotations

import datasets
import evaluate


class SimpleF1(evaluate.Metric):
    """F1 of integer class predictions: ``average="macro"`` (the mean over classes seen) or binary."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="F1 computed without scikit-learn",
            citation="",
            inputs_description="predictions and references: class ids",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions: list[int], references: list[int], average: str = "binary") -> dict[str, float]:
        def f1(c: int) -> float:
            tp = sum(p == c and r == c for p, r in zip(predictions, references, strict=True))
            fp = sum(p == c and r != c for p, r in zip(predictions, references, strict=True))
            fn = sum(p != c and r == c for p, r in zip(predictions, references, strict=True))
            return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0

        if average == "binary":
            if not set(predictions) | set(references) <= {0, 1}:
                raise ValueError("Target is multiclass but average='binary'; choose average='macro'")
            return {"f1": f1(1)}
        if average != "macro":
            raise ValueError(f"average must be 'binary' or 'macro', not {average!r}")
        classes = sorted(set(predictions) | set(references))
        return {"f1": sum(f1(c) for c in classes) / len(classes)}
