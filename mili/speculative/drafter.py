"""Drafter: what the scheduler asks for draft tokens (speculative decoding), per the engine's SpeculativeConfig.
N-gram drafts are copied here; MTP drafts are placeholders the runner computes at the start of the step
(mili/speculative/mtp.py), for a sequence that keeps the hidden state they start from."""

from __future__ import annotations

from mili.config import SpeculativeConfig
from mili.errors import InvalidRequest
from mili.speculative import mtp
from mili.speculative.ngram import NgramProposer


class Drafter:
    """``max_seqs``: sequences that may verify drafts in one step (a hybrid needs a spare state row for each:
    runtime/recurrent_state.py); ``active(num_running)``: speculation is off for a step whose running batch
    exceeds ``disable_by_batch_size`` (there the verification's extra positions cost more than they save)."""

    def __init__(self, config: SpeculativeConfig, max_seqs: int):
        self.config = config
        self.num_tokens = config.num_speculative_tokens
        self.max_seqs = max_seqs
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) \
            if config.method == "ngram" else None

    @staticmethod
    def check(config: SpeculativeConfig, model_path: str) -> None:
        """Refuse, before anything loads, a method this checkpoint (or MILI) cannot do."""
        if config.method == "mtp":
            from mili.model.checkpoint import tensor_names

            if not any(name.startswith("mtp.") for name in tensor_names(model_path)):
                raise InvalidRequest(f"speculative_config: method mtp needs the checkpoint's MTP head (mtp.* "
                                     f"tensors, as Qwen3.5/3.6 and Qwen3-Next ship); {model_path} has none: use "
                                     f"method ngram", param="speculative_config")

    def active(self, num_running: int) -> bool:
        return num_running <= self.config.disable_by_batch_size

    def propose(self, seq, k: int) -> list[int]:
        if self.ngram is None:  # mtp: computed by the runner before the step's forward
            return [mtp.PENDING] * k if mtp.can_draft(seq) else []
        return self.ngram.propose(seq.token_ids, k)
