"""Beam search (docs/ENGINE.md §8): which continuations of a job's beams survive a step.

These functions score and choose; the generator carries the choice out on the cache
(a beam chosen twice forks, sharing its pages copy-on-write; a beam not chosen
releases its pages at once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from engine.generator.job import BeamHypothesis, Job, Sequence
from engine.generator.sampler import NOTHING_LEFT, process_logits
from engine.generator.stops import StopReason


@dataclass(frozen=True)
class Continuation:
    parent: Sequence
    token: int
    score: float  # the parent's score plus log p(token)


@dataclass(frozen=True)
class BeamStep:
    keep: list[Continuation]  # the beams of the next step, best first
    finished: StopReason | None = None  # set when the search ends on this step


def select_continuations(job: Job, beams: list[Sequence], logits: torch.Tensor) -> BeamStep:
    """Extend every beam (its logits are row i of `logits`) by its best continuations
    and keep the `beam_width` best. A continuation ending in a stop token, or reaching
    max_new_tokens, becomes a finished hypothesis on the job; the search ends when
    there are `beam_width` of those, or nothing is left to extend."""
    width = job.request.beam_width
    # Beams rank by the model's own log-probabilities: bias and penalties apply,
    # temperature and truncation (which would make greedy settings one-hot) do not.
    ranking = replace(job.request.sampling, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    scores = process_logits(
        logits,
        [ranking] * len(beams),
        [job.prompt_ids] * len(beams),
        [b.generated for b in beams],
    )
    logp = torch.log_softmax(scores, dim=-1)  # a row with no token left is NaN
    total = logp + torch.tensor([b.score for b in beams], device=logp.device)[:, None]
    flat = total.flatten().nan_to_num(nan=-math.inf)
    k = min(2 * width, int(torch.isfinite(flat).sum()))
    if k == 0 and not job.hypotheses:
        raise ValueError(NOTHING_LEFT)
    values, order = flat.topk(k)
    vocab = logp.shape[1]
    keep: list[Continuation] = []
    length = len(beams[0].generated) + 1
    lp = job.request.length_penalty
    for rank, (value, flat_index) in enumerate(zip(values.tolist(), order.tolist(), strict=True)):
        parent, token = beams[flat_index // vocab], flat_index % vocab
        if token in job.stop_token_ids:
            if rank < width:
                hyp = BeamHypothesis(
                    parent.generated + [token],
                    _normalised(value, length, lp),
                    str(StopReason.STOP_TOKEN),
                )
                job.hypotheses.append(hyp)
            continue
        keep.append(Continuation(parent, token, value))
        if len(keep) == width:
            break
    at_limit = length >= job.request.max_new_tokens
    if at_limit:
        for c in keep:
            hyp = BeamHypothesis(
                c.parent.generated + [c.token],
                _normalised(c.score, length, lp),
                str(StopReason.MAX_NEW_TOKENS),
            )
            job.hypotheses.append(hyp)
    if at_limit or len(job.hypotheses) >= width or not keep:
        return BeamStep([], StopReason.MAX_NEW_TOKENS if at_limit else StopReason.STOP_TOKEN)
    return BeamStep(keep)


def best_hypotheses(job: Job) -> list[BeamHypothesis]:
    """The job's finished hypotheses, best first, at most `beam_width` of them."""
    ranked = sorted(job.hypotheses, key=lambda h: h.score, reverse=True)
    return ranked[: job.request.beam_width]


def _normalised(score: float, length: int, length_penalty: float) -> float:
    """score / length ** length_penalty, saturating where the power leaves float range
    (a huge penalty would otherwise raise OverflowError or divide by zero)."""
    try:
        divisor = float(length) ** length_penalty
    except OverflowError:
        divisor = math.inf
    if divisor == 0:
        return math.copysign(math.inf, score) if score else 0.0
    return score / divisor
