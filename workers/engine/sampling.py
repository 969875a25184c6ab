"""The engine's sampler: the next token of each sampling sequence, from its last hidden row.

Two ways, chosen per step by `TokenSampler.pick`:

- every sequence greedy (`temperature <= 0`) and the LM head screened (`EngineConfig.
  screen_lm_head`, CPU, float32 rows): the head's argmax without its full logits. A float32
  head: `kernels.greedy_head.greedy_tokens`, from an int8 copy screened by a rigorous error
  bound; an int8 head (`--quantize`): `kernels.int8_head_screen.screened_int8_argmax`, from an
  int4 copy screened by a 6-sigma margin, the candidates rescored by the int8 rows. A sequence
  that asks for its tokens' log-probabilities (`SamplingParams.logprobs`: the cascade's small
  model) keeps the int8 head's screen (`screened_int8_argmax_logprob`: the normaliser from the
  int4 logits outside the candidates); a float32 head's screen gives none, so it goes the
  other way;
- otherwise the model's full logits `[N, V]`: the argmax for greedy rows, and for the others a
  draw from the temperature-scaled softmax, cut to the top-p nucleus when `top_p < 1`. Each
  token's log-softmax is kept on a sequence that asks for it.

Each sampled request draws from its own CPU `torch.Generator`, seeded once from its
`SamplingParams.seed` (0 when none) on its first sampled token, so a request's tokens depend on
its seed alone, not on what else shares its batches. The engine calls `forget` when a request
finishes to drop its generator. Compiled CPU steps (`workers/engine/compiled.py`) bring their
hidden rows to `pick` as eager ones do; CUDA graph steps bring their own logits and greedy
tokens and go through `sample` directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from kernels.greedy_head import Int8Screen, greedy_tokens
from kernels.int8_head_screen import Int4Screen, screened_int8_argmax, screened_int8_argmax_logprob
from workers.engine.model import Transformer
from workers.engine.scheduler import SequenceState
from workers.engine.swaps import HeadScreen, WeightOnlyInt8Linear


class TokenSampler:
    """Picks tokens for one engine; lives on the engine's loop thread (not thread-safe)."""

    def __init__(self, model: Transformer, lm_screen: HeadScreen | None) -> None:
        self.model = model
        self.lm_screen = lm_screen  # None: always through the full logits
        self._generators: dict[str, torch.Generator] = {}  # request id -> its seeded generator

    def screens(self, seqs: Sequence[SequenceState]) -> bool:
        """Whether `pick` takes these sequences' tokens from the screened LM head: all greedy,
        and none keeping log-probabilities unless the screen gives them (an int8 head's)."""
        gives_logprobs = isinstance(self.lm_screen, Int4Screen)
        return self.lm_screen is not None and all(
            s.request.params.temperature <= 0 and (gives_logprobs or not s.request.params.logprobs)
            for s in seqs
        )

    def greedy(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The greedy tokens [N] of `rows` [N, D] through the head's screen, or None where none
        applies (no screen, rows not float32)."""
        screen, cap = self.lm_screen, self.model.config.final_logit_softcapping
        if screen is None or rows.dtype != torch.float32:
            return None
        if isinstance(screen, Int8Screen):  # a float32 head: no logits needed
            return greedy_tokens(rows, self.model.lm_head.weight, screen, cap)
        head = cast(WeightOnlyInt8Linear, self.model.lm_head)  # an int8 head
        return screened_int8_argmax(rows, head.weight, head.scales, screen, cap)

    def argmax(self, rows: torch.Tensor) -> torch.Tensor:
        """The greedy tokens [N] of `rows` [N, D]: through the head's screen where one applies,
        else the full logits' argmax (draft checks, workers/engine/forward.py)."""
        tokens = self.greedy(rows)
        return tokens if tokens is not None else self.model.compute_logits(rows).argmax(dim=-1)

    def greedy_logprobs(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The greedy tokens [N] of `rows` [N, D] and their log-softmax [N] through an int8
        head's screen; None where none applies."""
        screen, cap = self.lm_screen, self.model.config.final_logit_softcapping
        if not isinstance(screen, Int4Screen) or rows.dtype != torch.float32:
            return None
        head = cast(WeightOnlyInt8Linear, self.model.lm_head)
        return screened_int8_argmax_logprob(rows, head.weight, head.scales, screen, cap)

    def pick(self, seqs: list[SequenceState], rows: torch.Tensor) -> dict[str, int]:
        """Each sequence's next token from its last hidden row, `rows` [N, D]."""
        if self.screens(seqs):
            if any(s.request.params.logprobs for s in seqs):
                screened = self.greedy_logprobs(rows)
                if screened is not None:
                    tokens, values = screened
                    for seq, value in zip(seqs, values.tolist(), strict=True):
                        if seq.request.params.logprobs:
                            seq.sampled_logprobs.append(value)
                    return dict(zip((s.request_id for s in seqs), tokens.tolist(), strict=True))
            else:
                greedy = self.greedy(rows)
                if greedy is not None:
                    return dict(zip((s.request_id for s in seqs), greedy.tolist(), strict=True))
        return self.sample(seqs, self.model.compute_logits(rows))  # logits [N, V] float32

    def sample(
        self, seqs: list[SequenceState], logits: torch.Tensor, greedy: torch.Tensor | None = None
    ) -> dict[str, int]:
        """Tokens from `logits` [N, V]; `greedy` [N], when given (a compiled step), is taken
        as the argmax of every row."""
        # greedy for all (given by a compiled step); sampled rows replaced below
        tokens = (greedy if greedy is not None else logits.argmax(dim=-1)).tolist()
        for row, seq in enumerate(seqs):
            p = seq.request.params
            if p.temperature <= 0:
                continue
            gen = self._generators.get(seq.request_id)
            if gen is None:
                gen = torch.Generator(device="cpu")
                gen.manual_seed(p.seed if p.seed is not None else 0)
                self._generators[seq.request_id] = gen
            probs = torch.softmax(logits[row].float().cpu() / p.temperature, dim=-1)
            if p.top_p < 1.0:
                sorted_p, order = probs.sort(descending=True)
                keep = sorted_p.cumsum(0) - sorted_p < p.top_p
                probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
            tokens[row] = int(torch.multinomial(probs, 1, generator=gen).item())
        kept = [row for row, seq in enumerate(seqs) if seq.request.params.logprobs]
        if kept:  # the log-softmax of each picked token (unscaled logits: the model's own)
            picked = torch.tensor([tokens[r] for r in kept], device=logits.device)
            values = (
                torch.log_softmax(logits[kept].float(), dim=-1).gather(1, picked[:, None])[:, 0]
            ).tolist()
            for row, value in zip(kept, values, strict=True):
                seqs[row].sampled_logprobs.append(value)
        return {seq.request_id: tok for seq, tok in zip(seqs, tokens, strict=True)}

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator."""
        self._generators.pop(request_id, None)
