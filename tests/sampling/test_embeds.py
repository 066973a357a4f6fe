"""Embeds, the text conditioning every family's velocity reads: rows of different lengths (a family that encodes
each prompt to its own length, with a mask) concatenate by zero padding at the end with mask 0; rows of different
lengths without a mask are refused rather than silently misaligned."""

import pytest
import torch

from gerl.sampling.loop import Embeds


def test_masked_rows_of_different_lengths_pad_at_the_end_with_mask_zero():
    a = Embeds(torch.ones(1, 2, 3), None, mask=torch.ones(1, 2, dtype=torch.long))
    b = Embeds(2 * torch.ones(1, 4, 3), None, mask=torch.ones(1, 4, dtype=torch.long))
    both = Embeds.cat([a, b])
    assert both.prompt.shape == (2, 4, 3) and both.pooled is None
    assert both.mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert both.prompt[0, :2].eq(1).all() and both.prompt[0, 2:].eq(0).all() and both.prompt[1].eq(2).all()
    neg = Embeds(torch.zeros(2, 1, 3), None, mask=torch.ones(2, 1, dtype=torch.long))
    guided = both.with_negative(neg).index(torch.tensor([1]))
    assert guided.neg_prompt.shape == (1, 1, 3) and guided.mask.tolist() == [[1, 1, 1, 1]]


def test_rows_of_different_lengths_without_a_mask_are_refused():
    a, b = Embeds(torch.ones(1, 2, 3), torch.ones(1, 5)), Embeds(torch.ones(1, 4, 3), torch.ones(1, 5))
    with pytest.raises(ValueError, match="need a mask"):
        Embeds.cat([a, b])
    same = Embeds.cat([a, a])  # SD3 and FLUX: every prompt padded to one length, no mask
    assert same.prompt.shape == (2, 2, 3) and same.mask is None and same.pooled.shape == (2, 5)
