"""Recovery and lifecycle (issue 12): errors that say what is wrong, openers that adopt
what is stored, crashed takers that leave nothing stranded."""

from __future__ import annotations

import numpy as np
import pytest

import accumulator

SHAPE = (3, 2)


def make(target, shared_name="r", shape=SHAPE, **kw):
    return accumulator.ConditionalAccumulator(
        np.float32, shape, shared_name=shared_name, client=target.client(), **kw
    )


def test_a_timed_out_take_says_what_it_waited_for(target):
    acc = make(target, container="jobs")
    acc.set_global_step(5)
    acc.apply_grad(np.ones(SHAPE), local_step=5)
    with pytest.raises(accumulator.DeadlineExceededError) as err:
        acc.take_grad(3, timeout=0.1)
    text = str(err.value)
    assert text.startswith("Timed out waiting for notification")  # TF's words first
    assert "'r' in container 'jobs'" in text
    assert "1 of 3 gradients at global step 5 after 0.1s" in text


def test_an_unknown_shape_opener_adopts_the_stored_shape(target):
    make(target).apply_grad(np.ones(SHAPE))
    later = make(target, shape=None)
    assert later.shape == SHAPE
    np.testing.assert_array_equal(later.take_grad(1), np.ones(SHAPE))
    with pytest.raises(accumulator.InvalidArgumentError, match="already exists"):
        accumulator.ConditionalAccumulator(np.float64, None, shared_name="r",
                                           client=target.client())  # fmt: skip


def test_a_shared_name_that_is_not_text_is_a_clear_type_error(target):
    with pytest.raises(TypeError, match="shared_name must be a str, not int"):
        make(target, shared_name=123)
