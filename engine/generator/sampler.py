"""Token sampling for the continuous-batching generator (docs/ENGINE.md §7).

Every row of a batch has its own `SamplingSettings` and its own random generator.
The logits pipeline runs vectorised over [B, V]; the only per-row Python is one
uniform draw from that row's generator, and the draw picks a token by inverse CDF
over the row's own probabilities. So a sequence's tokens never depend on which
other sequences share the batch: same seed and settings, same text.

The order of operations is that of transformers' logits processors: logit bias,
repetition penalty, presence / frequency penalties, temperature, top-k, top-p,
min-p. Temperature 0 is greedy: the argmax after bias and penalties, with no
random draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MAX_SEED = 2**64  # torch.Generator.manual_seed accepts [0, 2**64)
# Far beyond any useful logit shift (model logits are tens at most), far inside float32:
# a larger value would only overflow to inf, and two infs make NaN.
_MAX_ADJUSTMENT = 1e6
# Settings are checked again on every step (`_check_batch`), on the engine thread: a bias list
# as long as the vocabulary would cost every job in the batch. OpenAI's API allows 300.
MAX_LOGIT_BIAS = 1024

NOTHING_LEFT = "every token was excluded by logit_bias / penalties: nothing left to sample"


class NothingToSample(ValueError):
    """Some rows have no token left (every logit -inf); raised before any row draws."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"{NOTHING_LEFT} (rows {rows})")
        self.rows = rows


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.7  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off; keeps tokens with p >= min_p * p_max
    repetition_penalty: float = 1.0  # CTRL-style over prompt + generated tokens; 1 = off
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); -inf bans a token
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        if (
            not _is_real(self.temperature)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        rp = self.repetition_penalty
        if not _is_real(rp) or not math.isfinite(rp) or rp <= 0:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {rp!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not abs(value) <= _MAX_ADJUSTMENT:
                raise ValueError(
                    f"{name} must be a number in [-{_MAX_ADJUSTMENT:g}, {_MAX_ADJUSTMENT:g}], "
                    f"got {value!r}"
                )
        if not isinstance(self.logit_bias, tuple | list):
            raise ValueError(
                f"logit_bias must be a list of (token_id, bias) pairs, got {self.logit_bias!r:.40}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias has {len(self.logit_bias):,} entries: at most {MAX_LOGIT_BIAS} are allowed"
            )
        seen: set[int] = set()
        for entry in self.logit_bias:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise ValueError(
                    f"logit_bias entries must be (token_id, bias) pairs, got {entry!r:.40}"
                )
            token, bias = entry
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias token id must be an integer >= 0, got {token!r}")
            if token in seen:
                raise ValueError(f"logit_bias lists token {token} more than once")
            seen.add(token)
            if not _is_real(bias) or not (bias == -math.inf or abs(bias) <= _MAX_ADJUSTMENT):
                raise ValueError(
                    f"logit_bias for token {token} must be -inf (ban) or a number in "
                    f"[-{_MAX_ADJUSTMENT:g}, {_MAX_ADJUSTMENT:g}], got {bias!r}"
                )
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _MAX_SEED):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one sequence: seeded, or from OS entropy when seed is None.

    Draws stay on the CPU whatever device the logits are on, so a seed gives the same
    uniforms on every machine."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def process_logits(
    logits: torch.Tensor,
    settings: Sequence[SamplingSettings],
    prompt_tokens: Sequence[Sequence[int]],
    generated_tokens: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Logits [B, V] after every processor, float32; removed tokens are -inf.

    A greedy row keeps only its argmax, so softmax of the result is exactly the
    distribution each row samples from. A row with no token left is all -inf (see
    `empty_rows`); NaN never survives, and +inf becomes the largest float32."""
    _check_batch(logits, settings, prompt_tokens, generated_tokens)
    scores = logits.float().clone()
    _apply_logit_bias(scores, settings)
    _apply_repetition_penalty(scores, settings, prompt_tokens, generated_tokens)
    _apply_presence_frequency_penalties(scores, settings, generated_tokens)
    _make_orderable(scores)
    greedy = [s.greedy for s in settings]
    greedy_tokens = scores.argmax(dim=-1) if any(greedy) else None
    scores = _apply_temperature(scores, settings)
    _make_orderable(scores)
    scores = _apply_top_k_top_p(scores, settings)
    scores = _apply_min_p(scores, settings)
    if greedy_tokens is not None:
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep.scatter_(1, greedy_tokens[:, None], True)
        greedy_rows = torch.tensor(greedy, device=scores.device)[:, None]
        scores.masked_fill_(greedy_rows & ~keep, -math.inf)
    return scores


def empty_rows(scores: torch.Tensor) -> list[int]:
    """Rows of processed scores with no token left to sample (every score -inf)."""
    return torch.isneginf(scores).all(dim=-1).nonzero().flatten().tolist()


class Sampler:
    """Picks one token per row; stateless, the randomness lives in each row's generator."""

    def probabilities(
        self,
        logits: torch.Tensor,
        settings: Sequence[SamplingSettings],
        prompt_tokens: Sequence[Sequence[int]],
        generated_tokens: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """The distribution [B, V] each row samples from (one-hot for greedy rows)."""
        return process_logits(logits, settings, prompt_tokens, generated_tokens).softmax(dim=-1)

    def sample(
        self,
        logits: torch.Tensor,
        settings: Sequence[SamplingSettings],
        generators: Sequence[torch.Generator | None],
        prompt_tokens: Sequence[Sequence[int]],
        generated_tokens: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """One token id per row, int64 [B] on the logits' device.

        A sampled row draws exactly one uniform from its own generator per call; a
        greedy row draws none. None as a generator uses torch's global generator.
        Raises NothingToSample, before any row draws, when a row has no token left."""
        if len(generators) != len(settings):
            raise ValueError(f"got {len(generators)} generators for {len(settings)} rows")
        if all(_plain_greedy(s) for s in settings):
            # Nothing to process: the argmax of the raw logits (the common chat case,
            # and most of a decode step's sampling time otherwise).
            _check_batch(logits, settings, prompt_tokens, generated_tokens)
            return argmax_rows(logits)
        scores = process_logits(logits, settings, prompt_tokens, generated_tokens)
        empty = empty_rows(scores)
        if empty:
            raise NothingToSample(empty)
        tokens = scores.argmax(dim=-1)  # greedy rows: their only finite token
        rows = [i for i, s in enumerate(settings) if not s.greedy]
        if not rows:
            return tokens
        uniforms = torch.tensor([_draw_uniform(generators[i]) for i in rows], dtype=torch.float32)
        uniforms = uniforms.to(scores.device)[:, None]
        sampled_scores = scores if len(rows) == len(settings) else scores[rows]
        cdf = sampled_scores.softmax(dim=-1).cumsum(dim=-1)
        total = cdf[:, -1:]
        # Strictly below the total, so the search lands on a token with p > 0.
        target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
        picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
        if len(rows) == len(settings):
            return picked
        tokens[torch.tensor(rows, device=tokens.device)] = picked
        return tokens


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``; float32 CPU logits through numpy's vectorised argmax
    (16 x 128k: 0.28 against torch's 1.5 ms, 2 threads; 2% of a 16-sequence decode step
    at the 1B shape). The same answers: the first of equal maxima, the first NaN where
    a row has one."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def model_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Per row of logits [B, V]: the log-probability of its chosen token [B] under the
    model's own distribution (no setting applied), and the ids and log-probabilities of
    its `k` likeliest tokens, best first. Read from the logits as the model gave them, so
    computing these never touches what a row samples."""
    scores = logits.float().clone()
    _make_orderable(scores)  # a NaN logit is no token, as when sampling
    logp = torch.log_softmax(scores, dim=-1)
    picked = logp.gather(1, chosen.to(logp.device, torch.long)[:, None]).squeeze(1)
    top_logp, top_ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return picked.tolist(), top_ids.tolist(), top_logp.tolist()


def _make_orderable(scores: torch.Tensor) -> None:
    """NaN (inf - inf, 0 * inf) becomes -inf and +inf the largest float32, in place, so
    argmax, softmax and the CDF search only ever see ordered values."""
    scores.nan_to_num_(nan=-math.inf, posinf=torch.finfo(scores.dtype).max, neginf=-math.inf)


def _plain_greedy(s: SamplingSettings) -> bool:
    return (
        s.greedy
        and not s.logit_bias
        and s.repetition_penalty == 1.0
        and s.presence_penalty == 0.0
        and s.frequency_penalty == 0.0
    )


def _draw_uniform(generator: torch.Generator | None) -> float:
    if generator is None:
        return float(torch.rand(1, dtype=torch.float64))
    return float(torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device))


def _check_batch(logits, settings, prompt_tokens, generated_tokens) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    lengths = (len(settings), len(prompt_tokens), len(generated_tokens))
    if lengths != (batch, batch, batch):
        raise ValueError(
            f"batch of {batch} logits rows needs as many settings, prompts and generations, "
            f"got {lengths[0]}, {lengths[1]}, {lengths[2]}"
        )
    for s in settings:
        s.validate()
        for token, _ in s.logit_bias:
            if token >= vocab:
                raise ValueError(f"logit_bias token {token} is outside the vocabulary of {vocab}")


def _row_column(scores: torch.Tensor, values: list[float]) -> torch.Tensor:
    """A per-row setting as a [B, 1] float32 column on the scores' device."""
    return torch.tensor(values, dtype=torch.float32, device=scores.device)[:, None]


def _token_index(
    scores: torch.Tensor, rows: list[int], token_lists: list[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs for the given rows, dropping ids outside the vocabulary."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for row, tokens in zip(rows, token_lists):
        row_ids.extend([row] * len(tokens))
        token_ids.extend(tokens)
    row_t = torch.tensor(row_ids, dtype=torch.long, device=scores.device)
    token_t = torch.tensor(token_ids, dtype=torch.long, device=scores.device)
    valid = (token_t >= 0) & (token_t < scores.shape[-1])
    return row_t[valid], token_t[valid]


def _apply_logit_bias(scores: torch.Tensor, settings: Sequence[SamplingSettings]) -> None:
    rows = [i for i, s in enumerate(settings) for _ in s.logit_bias]
    if not rows:
        return
    tokens = [t for s in settings for t, _ in s.logit_bias]
    biases = [float(b) for s in settings for _, b in s.logit_bias]
    index = (
        torch.tensor(rows, dtype=torch.long, device=scores.device),
        torch.tensor(tokens, dtype=torch.long, device=scores.device),
    )
    scores.index_put_(
        index, torch.tensor(biases, dtype=scores.dtype, device=scores.device), accumulate=True
    )


def _apply_repetition_penalty(scores, settings, prompt_tokens, generated_tokens) -> None:
    rows = [i for i, s in enumerate(settings) if s.repetition_penalty != 1]
    if not rows:
        return
    history = [[*prompt_tokens[i], *generated_tokens[i]] for i in rows]
    seen = torch.zeros_like(scores, dtype=torch.bool)
    seen[_token_index(scores, rows, history)] = True
    penalty = _row_column(scores, [s.repetition_penalty for s in settings])
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    scores.copy_(torch.where(seen, penalised, scores))


def _apply_presence_frequency_penalties(scores, settings, generated_tokens) -> None:
    rows = [
        i for i, s in enumerate(settings) if s.presence_penalty != 0 or s.frequency_penalty != 0
    ]
    if not rows:
        return
    counts = torch.zeros_like(scores)
    index = _token_index(scores, rows, [generated_tokens[i] for i in rows])
    counts.index_put_(index, torch.ones_like(index[0], dtype=counts.dtype), accumulate=True)
    presence = _row_column(scores, [s.presence_penalty for s in settings])
    frequency = _row_column(scores, [s.frequency_penalty for s in settings])
    scores.sub_(frequency * counts + presence * (counts > 0))


def _apply_temperature(scores: torch.Tensor, settings: Sequence[SamplingSettings]) -> torch.Tensor:
    temperatures = [1.0 if s.greedy else s.temperature for s in settings]
    if all(t == 1 for t in temperatures):
        return scores
    return scores / _row_column(scores, temperatures)


def _apply_top_k_top_p(scores: torch.Tensor, settings: Sequence[SamplingSettings]) -> torch.Tensor:
    """Top-k then top-p, as transformers' warpers (ties with the k-th logit survive top-k;
    top-p drops the low tail whose mass is <= 1 - top_p, never the top token)."""
    vocab = scores.shape[-1]
    ks = [min(s.top_k, vocab) if s.top_k > 0 and not s.greedy else 0 for s in settings]
    top_p_rows = [s.top_p < 1 and not s.greedy for s in settings]
    if not any(top_p_rows) and not any(ks):
        return scores
    # A full sort of V (up to 262144) dominates the cost; when every top-p row also has
    # top-k, only its k best tokens can survive, so a partial sort is enough.
    if any(top_p_rows) and not all(k > 0 for k, p in zip(ks, top_p_rows) if p):
        sorted_scores, sorted_index = scores.sort(dim=-1, descending=True)
    else:
        sorted_scores, sorted_index = scores.topk(max(ks), dim=-1)
    if any(ks):
        kth_index = torch.tensor([max(k - 1, 0) for k in ks], device=scores.device)[:, None]
        no_top_k = torch.tensor([k == 0 for k in ks], device=scores.device)[:, None]
        kth = sorted_scores.gather(1, kth_index).masked_fill(no_top_k, -math.inf)
        scores = scores.masked_fill(scores < kth, -math.inf)
        if not any(top_p_rows):
            return scores
        sorted_scores = sorted_scores.masked_fill(sorted_scores < kth, -math.inf)
    probs = sorted_scores.softmax(dim=-1)
    # Mass of each token and everything below it: transformers' ascending cumsum.
    tail_mass = probs.flip(-1).cumsum(dim=-1).flip(-1)
    cut = _row_column(scores, [1 - s.top_p if p else -1.0 for s, p in zip(settings, top_p_rows)])
    remove_sorted = tail_mass <= cut
    remove_sorted[:, 0] = False
    remove = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, sorted_index, remove_sorted)
    return scores.masked_fill(remove, -math.inf)


def _apply_min_p(scores: torch.Tensor, settings: Sequence[SamplingSettings]) -> torch.Tensor:
    if not any(s.min_p > 0 and not s.greedy for s in settings):
        return scores
    probs = scores.softmax(dim=-1)
    min_p = _row_column(scores, [0.0 if s.greedy else s.min_p for s in settings])
    floor = min_p * probs.amax(dim=-1, keepdim=True)
    return scores.masked_fill(probs < floor, -math.inf)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
