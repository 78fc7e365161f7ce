"""The sampler decides its path from host facts (SamplingParams), never by reading the device."""

from __future__ import annotations

import math

import pytest
import torch

from nanoref.layers.sampler import Sampler, SamplingBatch, sample_seeded_row


def fresh_logits(seed: int, rows: int, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_host_facts_from_sampling_settings():
    g = torch.Generator().manual_seed(5)
    all_greedy = SamplingBatch.from_host([0.0, 0.0], [0, 5], [1.0, 0.5])
    assert all_greedy.all_greedy and all_greedy.temperatures is None
    mixed = SamplingBatch.from_host([0.0, 0.7, 1.0], [0, 0, 0], [1.0, 1.0, 1.0])
    assert not mixed.all_greedy and mixed.any_greedy and not mixed.any_filtered and mixed.top_k is None
    filtered = SamplingBatch.from_host([0.7, 1.0], [0, 4], [1.0, 1.0])
    assert filtered.any_filtered and not filtered.any_greedy and filtered.top_k.tolist() == [0, 4]
    seeded = SamplingBatch.from_host([1.0, 0.5], [3, 0], [0.9, 1.0], [g, None])
    # the seeded row filters alone, one by one: the batch's own path stays the one-pass temperature sampler
    assert not seeded.any_filtered and [row for row, *_ in seeded.seeded] == [0]
    assert seeded.seeded[0][1:4] == (1.0, 3, 0.9)
    greedy_seeded = SamplingBatch.from_host([0.0], [0], [1.0], [g])
    assert greedy_seeded.all_greedy and not greedy_seeded.seeded  # temperature 0 wins over a seed


@pytest.fixture
def no_device_reads(monkeypatch):
    """Reading a tensor's value on the host (the sync the sampler must avoid) raises inside the block."""

    def refuse(*args, **kwargs):
        raise AssertionError("the sampler read a device value to decide its path")

    for name in ("__bool__", "item", "tolist", "any", "all"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


@pytest.mark.parametrize(
    "temperatures, top_k, top_p, seeds",
    [
        ([0.0, 0.0, 0.0], [0, 0, 0], [1.0, 1.0, 1.0], [None] * 3),  # all greedy
        ([0.0, 0.8, 1.2], [0, 0, 0], [1.0, 1.0, 1.0], [None] * 3),  # greedy + temperature only
        ([0.0, 0.8, 1.2], [0, 5, 0], [1.0, 1.0, 0.8], [None] * 3),  # greedy + top-k / top-p
        ([0.9, 0.8, 0.0], [3, 0, 0], [0.9, 1.0, 1.0], [11, None, 12]),  # seeded, greedy and plain rows
    ],
)
def test_sampler_paths_never_read_the_device(temperatures, top_k, top_p, seeds, no_device_reads):
    logits = fresh_logits(0, len(temperatures))
    generators = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    batch = SamplingBatch.from_host(temperatures, top_k, top_p, generators)
    ids = Sampler()(logits, batch=batch)
    assert ids.shape == (len(temperatures),)
    values = ids.numpy()  # numpy reads memory directly: not one of the refused calls
    for row, t in enumerate(temperatures):
        if t == 0:
            assert values[row] == int(logits[row].numpy().argmax()), f"greedy row {row}"
        if top_k[row] and seeds[row] is None:
            assert values[row] in set(logits[row].topk(top_k[row]).indices.numpy()), f"top-k row {row}"


def test_seeded_row_does_not_depend_on_its_batch():
    logits = fresh_logits(1, 4)
    target = logits[2].clone()
    alone = sample_seeded_row(target, 0.9, 7, 0.95, torch.Generator().manual_seed(42))
    for others in ([0.0, 0.5, 0.9, 1.3], [1.0, 1.0, 0.9, 1.0]):
        for top_k in ([0, 0, 7, 0], [3, 0, 7, 9]):
            gens = [None, None, torch.Generator().manual_seed(42), None]
            batch = SamplingBatch.from_host(others, top_k, [1.0, 0.5, 0.95, 1.0], gens)
            ids = Sampler()(logits, batch=batch)
            assert ids[2].item() == alone.item()


def test_a_seeded_row_samples_at_its_temperature_not_its_square_and_the_logits_stay_as_they_were():
    """The batched draw scaled the batch's float32 logits in place, and a seeded row then read them and scaled
    them again (temperature t sampled at t**2). Each seeded row must draw what it draws from the raw logits."""
    logits = fresh_logits(0, 4)  # (B, V) float32
    before = logits.clone()
    temperatures, seeds = [0.9, 0.3, 0.5, 0.2], [None, 1, None, 2]
    for draw in range(20):  # (at t**2 some draws differ)
        generators = [None if s is None else torch.Generator().manual_seed(s + 100 * draw) for s in seeds]
        batch = SamplingBatch.from_host(
            temperatures, [0] * 4, [1.0] * 4, generators, default_generator=torch.Generator()
        )
        sampled = Sampler()(logits, batch=batch)
        assert torch.equal(logits, before), "the sampler changed its input logits"
        for row, seed in enumerate(seeds):
            if seed is not None:
                own = torch.Generator().manual_seed(seed + 100 * draw)
                assert sampled[row].item() == sample_seeded_row(before[row], temperatures[row], 0, 1.0, own).item()


def test_temperature_sampling_follows_the_distribution():
    # two tokens with probabilities 1/4 and 3/4 at temperature 1; 4000 rows sampled in one call
    logits = torch.tensor([[0.0, math.log(3.0)]]).repeat(4000, 1)
    torch.manual_seed(3)
    ids = Sampler()(logits, batch=SamplingBatch.from_host([1.0] * 4000, [0] * 4000, [1.0] * 4000))
    share = ids.float().mean().item()
    assert abs(share - 0.75) < 0.03, f"token 1 drawn {share:.3f} of the time, expected 0.75"


def test_tensor_form_equals_host_form_for_greedy_and_filters():
    logits = fresh_logits(2, 3)
    temps, top_k, top_p = torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0, 1, 0]), torch.tensor([1.0, 1.0, 1e-6])
    ids = Sampler()(logits, temps, top_k, top_p)
    assert ids.tolist() == logits.argmax(dim=-1).tolist()  # greedy, top-1 and a tiny nucleus all take the argmax


def test_the_device_read_guard_catches_a_read(no_device_reads):
    with pytest.raises(AssertionError, match="read a device value"):
        Sampler()(fresh_logits(4, 2), torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0]))
