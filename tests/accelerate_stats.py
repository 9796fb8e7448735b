"""Activation statistics of two tiny GPT-2 models, run alone or under ``accelerate launch``.

    python tests/accelerate_stats.py OUT.pt

tests/alignment/test_features.py runs both and checks that the results agree: splitting the batches over
processes and reducing the sums must not change the statistics. Rank 0 writes
``{"num_processes", "runs": {name: {"tokens", "residual_groups", "moments": {key: {field: tensor}}}}}``
for a run over six batches and one over a single batch (a process without any batch), and for the
six batches collected layer by layer (``lockstep``).

``accelerate launch --cpu --num_processes 2`` starts a single process in accelerate 1.x unless
``--mpirun_hostfile`` (MPI) is given; two CPU processes come from the torchrun launcher with
``ACCELERATE_USE_CPU=1``:

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 tests/accelerate_stats.py OUT.pt
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import tiny  # noqa: E402
from hf_rebasin.alignment.features import activation_stats  # noqa: E402
from hf_rebasin.alignment.features.lockstep import lockstep_plan, lockstep_stats  # noqa: E402
from hf_rebasin.symmetry.adapters import graph_for  # noqa: E402

FIELDS = ("count", "sum_a", "sum_b", "sq_a", "sq_b", "cross")


def batches(n: int = 6, size: int = 3, length: int = 16) -> list[dict[str, torch.Tensor]]:
    """Fixed random token batches; every other batch has right padding of varied length."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for i in range(n):
        ids = torch.randint(0, tiny.V, (size, length), generator=g)
        mask = torch.ones(size, length, dtype=torch.long)
        if i % 2 == 0:
            mask[-1, length - 2 - i :] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def run(model_a: torch.nn.Module, model_b: torch.nn.Module, data: list[dict[str, torch.Tensor]]) -> dict:
    graph = graph_for(model_a.config, model_a.state_dict().keys())
    stats = activation_stats(model_a, model_b, graph, data, residual="separate")
    return {
        "tokens": stats.tokens,
        "residual_groups": stats.residual_groups,
        "moments": {k: {f: getattr(m, f).clone() for f in FIELDS} for k, m in stats.moments.items()},
    }


def run_lockstep(model_a: torch.nn.Module, model_b: torch.nn.Module, data: list[dict[str, torch.Tensor]]) -> dict:
    """The same statistics layer by layer (MLP units and heads: lockstep has no residual keys)."""
    graph = graph_for(model_a.config, model_a.state_dict().keys())
    spaces = [n for n, s in graph.spaces.items() if s.kind != "residual"]
    plan = lockstep_plan(graph, model_a, spaces)
    assert not isinstance(plan, str), plan
    moments, tokens = {}, 0
    sd_a, sd_b = model_a.state_dict(), model_b.state_dict()
    for layer in lockstep_stats(model_a, model_b, sd_a, sd_b, graph, plan, data):
        moments.update({k: {f: getattr(m, f).clone() for f in FIELDS} for k, m in layer.stats.moments.items()})
        tokens = layer.stats.tokens
    return {"tokens": tokens, "residual_groups": [], "moments": moments}


def main(out: str) -> None:
    from accelerate import PartialState

    torch.set_num_threads(1)
    model_a, model_b = tiny.gpt2(0), tiny.gpt2(1)
    data = batches()
    start = time.perf_counter()
    # "one": a single batch, so with two processes one of them has no batch at all
    runs = {"six": run(model_a, model_b, data), "one": run(model_a, model_b, data[:1])}
    runs["lockstep"] = run_lockstep(model_a, model_b, data)
    seconds = time.perf_counter() - start
    state = PartialState()  # the one activation_stats set up
    if state.is_main_process:
        torch.save({"num_processes": state.num_processes, "runs": runs}, out)
        print(f"{state.num_processes} process(es): {runs['six']['tokens']} tokens in {seconds:.2f}s")
    state.wait_for_everyone()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
