"""Stage 1's batches: rows of the memory-mapped buffer, read one step ahead in a background thread."""

import threading

import torch

from hybrid_scale.data.staging import Stager


class Recorded:
    """A buffer that records which rows were read, and signals when the rows of `wait_for` are."""

    def __init__(self, data: torch.Tensor, wait_for: list[int]):
        self.data, self.wait_for, self.reads, self.event = data, wait_for, [], threading.Event()

    def __getitem__(self, index):
        rows = index.tolist()
        self.reads.append(rows)
        if rows == self.wait_for:
            self.event.set()
        return self.data[index]


def test_rows_arrive_in_order_and_the_next_step_is_read_while_the_current_one_computes():
    data = torch.arange(6 * 3, dtype=torch.float32).view(6, 3)
    plan = [[0, 2], [], [5], [1, 3, 4]]
    buf = Recorded(data, wait_for=[5])
    steps = Stager(buf, torch.device("cpu")).steps(plan)
    first = next(steps)
    assert torch.equal(first, data[[0, 2]])
    assert next(steps) is None  # a step without rows on this rank
    # step 2's rows are read in the background before the caller asks for them
    assert buf.event.wait(timeout=5) and buf.reads[-1] == [5]
    rest = list(steps)
    assert torch.equal(rest[0], data[[5]]) and torch.equal(rest[1], data[[1, 3, 4]])
    assert buf.reads == [[0, 2], [5], [1, 3, 4]]
