"""ampgraph/runtime/cpu/buffers.py: a kept buffer is handed out only while nothing else holds
it."""

from __future__ import annotations

import torch

from ampgraph.runtime.cpu.buffers import take_free


def make(n: int = 4):
    made = []

    def new() -> torch.Tensor:
        made.append(torch.zeros(n))
        return made[-1]

    return new, made


def test_a_released_buffer_is_reused_and_a_held_one_never():
    pool: list = []
    new, made = make()
    first = take_free(pool, lambda b: True, new, limit=4)
    assert len(made) == 1 and first._base is made[0]  # a view: marks the buffer in use
    second = take_free(pool, lambda b: True, new, limit=4)
    assert len(made) == 2 and second.data_ptr() != first.data_ptr()
    ptr = first.data_ptr()
    del first
    again = take_free(pool, lambda b: True, new, limit=4)
    assert len(made) == 2 and again.data_ptr() == ptr


def test_only_a_buffer_that_fits_is_taken():
    pool: list = []
    small = take_free(pool, lambda b: True, lambda: torch.zeros(2), limit=4)
    del small  # free, but too small for the next call
    big = take_free(pool, lambda b: b.numel() == 4, lambda: torch.zeros(4), limit=4)
    assert big.numel() == 4 and len(pool) == 2


def test_the_oldest_buffer_goes_once_the_limit_is_kept():
    pool: list = []
    new, made = make()
    held = [take_free(pool, lambda b: True, new, limit=2) for _ in range(3)]
    assert len(made) == 3 and [b for b, _ in pool] == made[1:]
    del held


def test_a_buffer_made_under_inference_mode_stays_writable_outside_it():
    pool: list = []
    new, made = make()
    with torch.inference_mode():
        view = take_free(pool, lambda b: True, new, limit=2)
    assert not made[0].is_inference() and not view.is_inference()
    del view
    take_free(pool, lambda b: True, new, limit=2).add_(1)  # outside inference mode: fine
