"""When a decode step verifies proposals, and when it runs plain: speculation only where it pays.

A verify step computes k + 1 tokens per sequence to gain 1 + (accepted proposals) of them. Where decode is
memory-bound (a GPU at small batch), the extra k query tokens cost little, and any acceptance pays; as the batch
grows the step turns compute-bound and the proposals' rows cost nearly what plain decode steps would, while the
host's share (proposing, the acceptance rule) grows with the batch too. Three rules, all deterministic (the same
requests take the same steps):

- batch: a step with more running sequences than `disable_by_batch_size` runs plain (vLLM's rule and name);
- acceptance: while the tokens gained per sequence and verify step (a moving average, 1.0 when nothing is
  accepted) stay below `min_tokens_per_step`, steps run plain; a probe still verifies now and then, so the average
  follows text that becomes predictable (a repeated list, code being quoted): after 8 plain steps, and twice as
  many after each probe that did not pay (up to 64), since a probe costs a verify step (with a draft model, its
  forwards and its catch-up on the tokens it missed);
- a draft model's own cost: its k forwards per verify step read its weights k times, so with a draft the bar is
  `min_tokens_per_step` + k x (the draft's parameters / the target's). A draft as large as the target raises it past
  k + 1, the most a verify step can gain: such a draft can never pay, so it is not loaded and the engine decodes
  without speculation (`runner.unpaid_draft`; measured on one H200 at batch 1: a draft identical to the target,
  4.79 tokens per verify step, ran at 0.56x plain decoding).

A plain step inside the speculative loop is the engine's ordinary decode step (its CUDA graphs included); a draft
model simply catches up on the tokens it missed at its next verify step. Above the batch limit a prefill step leaves
the draft out too (`within_batch_limit`): its K/V would serve only verify steps.
"""

from __future__ import annotations

from dataclasses import dataclass

# measured on one H200 (benchmarks/results/speculative_h200.md) and this project's 2-core CPU: the largest batch
# at which n-gram speculation still beat plain decoding on the benchmark's workloads
DEFAULT_BATCH_LIMIT = {"cuda": 32, "cpu": 4}


@dataclass
class SpeculationPolicy:
    disable_by_batch_size: int  # 0: never by batch size
    min_tokens_per_step: float  # 0: never by acceptance
    probe_every: int = 8  # plain steps before the next probe (doubled after each probe that did not pay)
    max_probe_every: int = 64
    smoothing: float = 0.3  # the weight of the latest verify step in the moving average
    tokens_per_step: float | None = None  # the moving average (None before the first verify step)
    plain_since_verify: int = 0

    def within_batch_limit(self, num_seqs: int) -> bool:
        """Whether a decode step of num_seqs sequences may verify (the batch rule alone)."""
        return not self.disable_by_batch_size or num_seqs <= self.disable_by_batch_size

    def speculate(self, num_seqs: int) -> bool:
        """Whether the decode step of num_seqs sequences about to run verifies proposals."""
        if not self.within_batch_limit(num_seqs):
            return False
        average = self.tokens_per_step
        if average is None or average >= self.min_tokens_per_step:
            return True
        return self.plain_since_verify + 1 >= self.probe_every  # probe: has the text become predictable?

    def verified(self, num_seqs: int, num_gained: int) -> None:
        """A verify step of num_seqs sequences gained num_gained tokens in all."""
        gain = num_gained / max(num_seqs, 1)
        average = self.tokens_per_step
        probing = average is not None and average < self.min_tokens_per_step  # (this step was a probe)
        self.tokens_per_step = gain if average is None else (1 - self.smoothing) * average + self.smoothing * gain
        if self.tokens_per_step >= self.min_tokens_per_step:
            self.probe_every = 8
        elif probing:
            self.probe_every = min(2 * self.probe_every, self.max_probe_every)
        self.plain_since_verify = 0

    def ran_plain(self) -> None:
        self.plain_since_verify += 1


def draft_cost(num_speculative_tokens: int, draft_parameters: int, target_parameters: int) -> float:
    """The tokens per verify step a draft model's k forwards cost, in target decode steps: k x its share of the
    weights a step reads (what bounds a decode forward at the batch sizes speculation runs at)."""
    return num_speculative_tokens * draft_parameters / target_parameters
