"""The baseline: what NCCL does with no tuning."""

from __future__ import annotations

from lagom.search.base import Evaluator, Problem, SearchResult, nccl_configs


def search(problem: Problem, evaluator: Evaluator) -> SearchResult:
    configs = nccl_configs(problem)
    result = evaluator.evaluate(configs)
    notes = {k: "NCCL default channels/threads/buffer; algorithm and protocol by NCCL's cost model" for k in configs}
    return SearchResult("nccl", configs, result, evaluator.evaluations, notes)
