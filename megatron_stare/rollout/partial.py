"""Partial rollouts: a generation batch produced in segments, each under the weights of its time.

A ``SegmentedBatch`` generates its responses ``segment_tokens`` new tokens at a time. Between
two segments the engine's weights may change (the trainer pushed a new policy version): the
unfinished responses then continue under the new weights from ``prompt + prefix``, and every
token records the version that produced it and its behaviour log-prob under that version.

Determinism: where a response is cut depends only on token counts, never on time, and every
segment's request is seeded from (the batch's seed, the segment, the response): the first
segment is one ``n``-sample request per prompt seeded exactly as an unsegmented call, a
continuation is a one-sample request per response, seeded by ``segment_seed`` and the response's
global index ``prompt_index * n + sample_index``. So the same schedule of versions gives the same
tokens, whatever the timing.

The prefix's KV cache is recomputed under the new weights: a continuation is a new request, and
the engines reset their prefix cache after every weight push. Keeping the old KV entries would
condition new tokens on keys and values the old weights computed; recomputing is the safe default.

A response is finished when it stopped (a stop token), reached ``max_new_tokens``, or got fewer
tokens than its segment asked for without stopping (the engine's context length ended it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence

import torch

from megatron_stare.rollout.base import GenerationResult, RolloutEngine, SamplingParams

__all__ = ["PartialResponse", "SegmentedBatch", "segment_seed"]


def segment_seed(seed: int, segment: int) -> int:
    """The call seed of continuation segment ``segment`` (>= 1) of a batch seeded ``seed``."""
    return (seed * 998_244_353 + segment * 1_000_000_007) % (2 ** 61 - 1)


@dataclass
class PartialResponse:
    """One response in progress: its tokens so far, each token's behaviour log-prob and policy
    version; ``finish_reason`` None while it continues."""

    prompt_index: int
    sample_index: int
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None

    def result(self) -> GenerationResult:
        return GenerationResult(self.prompt_index, self.sample_index, list(self.token_ids),
                                torch.tensor(self.logprobs, dtype=torch.float32), self.finish_reason or "length",
                                versions=list(self.versions))


class SegmentedBatch:
    """The responses of one ``generate`` call (``prompts`` with their batch ``prompt_indices``,
    ``params.n`` samples each), produced ``segment_tokens`` new tokens per ``advance``.

    ``advance(engine, version)`` runs one segment for every unfinished response under the
    engine's current weights, labelled ``version``; ``finished`` says when none is left;
    ``results()`` gives the ``GenerationResult``s (with ``versions``) in the engine's order,
    prompt-major. Not thread-safe: one caller at a time (the pipeline's worker, or the main
    thread once the worker is drained).
    """

    def __init__(self, prompts: Sequence[Sequence[int]], prompt_indices: Sequence[int], params: SamplingParams,
                 segment_tokens: int):
        if segment_tokens < 1:
            raise ValueError(f"segment_tokens must be >= 1, got {segment_tokens}")
        if len(prompts) != len(prompt_indices):
            raise ValueError(f"{len(prompt_indices)} prompt_indices for {len(prompts)} prompts")
        self.prompts = [list(p) for p in prompts]
        self.prompt_indices = [int(i) for i in prompt_indices]
        self.params, self.segment_tokens = params, segment_tokens
        self.segments = 0
        """Segments run so far."""
        self.responses: List[PartialResponse] = []

    @property
    def finished(self) -> bool:
        return self.segments > 0 and all(r.finish_reason is not None for r in self.responses)

    def advance(self, engine: RolloutEngine, version: int) -> None:
        """One segment under ``version`` (the engine must hold that version's weights)."""
        if self.finished:
            return
        p = self.params
        if self.segments == 0:
            # As an unsegmented call, cut at the segment: same seeds, same first tokens.
            params = replace(p, max_new_tokens=min(self.segment_tokens, p.max_new_tokens))
            out = engine.generate(self.prompts, params, prompt_indices=self.prompt_indices) if self.prompts else []
            self.responses = [PartialResponse(r.prompt_index, r.sample_index) for r in out]
            self._extend(self.responses, out, version, [params.max_new_tokens] * len(out))
        else:
            todo = [r for r in self.responses if r.finish_reason is None]
            asks = [min(self.segment_tokens, p.max_new_tokens - len(r.token_ids)) for r in todo]
            prompt_of = dict(zip(self.prompt_indices, self.prompts))
            # One request per distinct budget (the last segment may ask less); each response is
            # its own prompt (prompt + prefix), seeded by its global index.
            for ask in sorted(set(asks)):
                group = [r for r, a in zip(todo, asks) if a == ask]
                params = replace(p, n=1, max_new_tokens=ask,
                                 seed=None if p.seed is None else segment_seed(p.seed, self.segments))
                got = engine.generate([prompt_of[r.prompt_index] + r.token_ids for r in group], params,
                                      prompt_indices=[r.prompt_index * p.n + r.sample_index for r in group])
                if [o.prompt_index for o in got] != [r.prompt_index * p.n + r.sample_index for r in group]:
                    raise RuntimeError(f"partial rollout: the engine answered {len(got)} continuations out of "
                                       f"order or count for {len(group)} responses")
                self._extend(group, got, version, [ask] * len(group))
        self.segments += 1

    def _extend(self, responses: List[PartialResponse], out: List[GenerationResult], version: int,
                asked: List[int]) -> None:
        for r, o, ask in zip(responses, out, asked):
            r.token_ids += list(o.token_ids)
            r.logprobs += o.logprobs.tolist()
            r.versions += [version] * len(o.token_ids)
            if o.finish_reason == "stop":
                r.finish_reason = "stop"
            elif len(r.token_ids) >= self.params.max_new_tokens or len(o.token_ids) < ask:
                r.finish_reason = "length"

    def results(self) -> List[GenerationResult]:
        if not self.finished:
            raise RuntimeError("partial rollout: results() before every response finished")
        return [r.result() for r in self.responses]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """JSON-able (float32 log-probs round-trip exactly through Python floats)."""
        return {"segments": self.segments,
                "responses": [[r.prompt_index, r.sample_index, r.token_ids, r.logprobs, r.versions, r.finish_reason]
                              for r in self.responses]}

    def load_state_dict(self, state: dict) -> None:
        self.segments = int(state["segments"])
        self.responses = [PartialResponse(int(p), int(s), list(t), [float(x) for x in lp], [int(v) for v in vs], f)
                          for p, s, t, lp, vs, f in state["responses"]]
