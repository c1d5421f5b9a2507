"""COD (conditional drop): counts per depth, nested chains, reproducibility, eligibility."""

from __future__ import annotations

import doctest

import pytest
import torch

from peagle.training import cod, cod_counts, cod_sample


def test_docstring_examples():
    result = doctest.testmod(cod, verbose=False)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize(
    "n,k,r,rmin",
    [(10, 4, 0.5, 0.2), (57, 8, 0.8, 0.2), (100, 6, 0.7, 0.0), (5, 3, 1.0, 0.0), (9, 4, 0.0, 0.0)],
)
def test_cod_counts_and_nested_chains(n, k, r, rmin):
    expected = [n] + [min(n, int(max(r**d, rmin) * n + 0.5)) for d in range(1, k)]
    for d in range(1, k):
        expected[d] = min(expected[d], expected[d - 1])
    assert cod_counts(n, k, r, rmin) == expected
    for seed in range(5):
        keep = cod_sample(n, k, r, rmin, generator=torch.Generator().manual_seed(seed))
        assert keep.shape == (k, n)
        assert keep[0].all()
        assert keep.sum(1).tolist() == expected
        assert bool((keep[1:] <= keep[:-1]).all()), "a kept (a, d) needs its (a, d-1)"


def test_cod_reproducible_and_random():
    a = cod_sample(200, 6, 0.7, 0.2, generator=torch.Generator().manual_seed(3))
    b = cod_sample(200, 6, 0.7, 0.2, generator=torch.Generator().manual_seed(3))
    c = cod_sample(200, 6, 0.7, 0.2, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_cod_eligible_restricts_the_pool():
    n, k = 30, 5
    eligible = torch.zeros(k, n, dtype=torch.bool)
    eligible[:, 10:20] = True
    keep = cod_sample(n, k, 0.9, 0.2, generator=torch.Generator().manual_seed(0), eligible=eligible)
    assert keep[0].all()
    assert not keep[1:, :10].any() and not keep[1:, 20:].any()
    assert keep[1].sum() == 9  # round(0.9 * 10 eligible)
    assert bool((keep[1:] <= keep[:-1]).all())
    with pytest.raises(ValueError, match="ratios"):
        cod_sample(4, 2, 1.5)
