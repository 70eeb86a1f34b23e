"""``DMTPCandidateGenerator``: the same drafters driven by Transformers' own assisted-decoding loop.

Stock ``_assisted_decoding`` runs only for non-stateful targets at batch size 1 (it cannot roll back recurrent
states). Where it can run, :func:`generate_with_transformers_loop` plugs a :class:`DMTPCandidateGenerator` into it,
so verification, sampling, cache cropping and stopping are Transformers' own while drafting is ours; everywhere
else (and by default) the project's loop in ``decoding.py`` runs the same drafters.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from .accept.processing import TokenSelector
from .drafters.base import Drafter
from .generate import ROUTER_ORIGINAL
from .stats import SpecStats
from .target.step import DrafterInputs, TargetStep


class DMTPCandidateGenerator(CandidateGenerator):
    """A ``transformers`` ``CandidateGenerator`` that drafts T1..TK with a :class:`Drafter` from the target's outputs.

    It asks the target for the hidden states it needs (``model_kwargs_overrides``), starts the drafter from the
    prefill outputs, advances it with the ``n_last_matches + 1`` verified rows of every later forward, and records
    the acceptance histogram in :attr:`stats` (tokens per round are counted before Transformers' length clipping).
    """

    requires_model_outputs = True

    def __init__(self, target, drafter: Drafter, logits_processor, generation_config) -> None:
        self.drafter = drafter
        drafter.reserve(generation_config.max_length + 1)  # fixed-slot state is sized for the whole call
        self.do_sample = bool(generation_config.do_sample)
        self.select = TokenSelector(logits_processor, self.do_sample)
        self.drafter_inputs = DrafterInputs(target, drafter)
        self.model_kwargs_overrides = {"output_hidden_states": self.drafter_inputs.hidden_indices or [-1]}
        self.stats = SpecStats(drafter.num_candidates, drafter.name)
        self.request = self.stats.new_request()
        self.started = False

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs: Any = None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
    ) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        """``(input_ids + K candidates, processed draft scores or None)``; the prefill call drafts nothing."""
        if is_first_iteration or model_outputs is None:
            return input_ids, None
        if not self.started:  # outputs of the prefill: every prompt position
            rows = input_ids.shape[1] - 1
            start = 0
        else:  # outputs of the last verify: [A, T1..TK], of which n_last_matches + 1 rows are history now
            rows = n_last_matches + 1
            start = input_ids.shape[1] - n_last_matches - 2
        features, mtp_hidden = self.drafter_inputs.read(model_outputs, rows)
        positions = torch.arange(start, start + rows, device=input_ids.device)[None]
        step = TargetStep(positions, input_ids[:, start + 1 :], None, mtp_hidden, features)
        if self.started:
            self.drafter.advance(step, self.stats)
        else:
            self.drafter.start(step)
            self.started = True
        anchor = torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)
        proposal = self.drafter.propose(input_ids[:, -1], anchor, self.select.for_prefix(input_ids), self.stats)
        scores = proposal.scores if self.do_sample else None
        return torch.cat([input_ids, proposal.tokens], dim=1), scores

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """Record the round's acceptance (the candidate budget itself is fixed)."""
        self.request.add_round(int(num_matches), int(num_matches) + 1)

    def close(self) -> None:
        """Detach the hidden-state hook from the target."""
        self.drafter_inputs.close()


def generate_with_transformers_loop(
    target, input_ids: torch.LongTensor, drafter: Drafter, *, stats: SpecStats | None = None, **generate_kwargs: Any
):
    """Run ``target.generate`` through Transformers' stock assisted-decoding loop with a ``DMTPCandidateGenerator``.

    Only for non-stateful targets at batch size 1 (Transformers refuses the others). Returns what ``generate``
    returns; the round statistics are added to ``stats`` when given.
    """
    if getattr(target, "_is_stateful", False):
        raise ValueError(
            f"{type(target).__name__} is stateful (linear-attention layers): Transformers' assisted loop cannot roll "
            "it back. Use dmtp_hf.generate(...) / target.generate(assistant_model=...) instead."
        )
    generators: list[DMTPCandidateGenerator] = []

    def get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, **_):
        generator = DMTPCandidateGenerator(self, drafter, logits_processor, generation_config)
        generators.append(generator)
        return generator

    original_generate = getattr(target, ROUTER_ORIGINAL, target.generate)
    # Transformers offers no argument to pass a candidate generator: this instance's factory method is overridden
    # for the duration of the call (nothing else changes, and it is removed afterwards).
    target._get_candidate_generator = types.MethodType(get_candidate_generator, target)
    try:
        # `prompt_lookup_num_tokens` only switches `generate` into assisted mode; the override above replaces the
        # prompt-lookup generator it would have built.
        return original_generate(input_ids, prompt_lookup_num_tokens=drafter.num_candidates, **generate_kwargs)
    finally:
        del target._get_candidate_generator
        for generator in generators:
            generator.close()
            if stats is not None:
                stats.merge(generator.stats)
