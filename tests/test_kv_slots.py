"""The continuous loop's KV cache: after rows join, decode and leave, and its buffers grow
or compact, the window it hands the model holds what the padded, concatenated cache of
the same rows would hold."""

import random

import pytest

torch = pytest.importorskip("torch")

from rawserve.worker import kv_slots  # noqa: E402
from rawserve.worker.kv_slots import KvSlots  # noqa: E402

LAYERS, HEADS, DIM = 2, 3, 4


class Reference:
    """The same cache kept the slow way: padded and concatenated on joins and steps,
    index-selected when rows leave, leading padding cut."""

    def __init__(self):
        self.keys: list = []
        self.values: list = []
        self.mask = torch.zeros((0, 0), dtype=torch.long)
        self.ids: list[int] = []

    def join(self, ids, keys, values, mask):
        if not self.ids:
            self.keys, self.values, self.mask = keys, values, mask
        else:
            length, width = self.mask.shape[1], mask.shape[1]
            pad_old, pad_new = max(width - length, 0), max(length - width, 0)

            def pad(t, n):
                return torch.nn.functional.pad(t, (0, 0, n, 0))

            self.keys = [
                torch.cat([pad(a, pad_old), pad(b, pad_new)])
                for a, b in zip(self.keys, keys, strict=True)
            ]
            self.values = [
                torch.cat([pad(a, pad_old), pad(b, pad_new)])
                for a, b in zip(self.values, values, strict=True)
            ]
            self.mask = torch.cat(
                [
                    torch.nn.functional.pad(self.mask, (pad_old, 0)),
                    torch.nn.functional.pad(mask, (pad_new, 0)),
                ]
            )
        self.ids += ids

    def decode(self, keys, values):
        self.keys = [torch.cat([a, b], dim=2) for a, b in zip(self.keys, keys, strict=True)]
        self.values = [torch.cat([a, b], dim=2) for a, b in zip(self.values, values, strict=True)]
        self.mask = torch.cat([self.mask, torch.ones((len(self.ids), 1), dtype=torch.long)], dim=1)

    def leave(self, gone):
        keep = [i for i, row in enumerate(self.ids) if row not in gone]
        self.ids = [self.ids[i] for i in keep]
        index = torch.tensor(keep, dtype=torch.long)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.mask = self.mask.index_select(0, index)
        if keep:
            used = self.mask.any(dim=0).nonzero()
            first = int(used[0]) if len(used) else self.mask.shape[1]
            self.keys = [k[:, :, first:] for k in self.keys]
            self.values = [v[:, :, first:] for v in self.values]
            self.mask = self.mask[:, first:]


def assert_same(slots: KvSlots, ids: list[int], reference: Reference):
    assert sorted(ids) == sorted(reference.ids)
    if not ids:
        assert slots.rows == 0
        return
    order = torch.tensor([reference.ids.index(row) for row in ids])
    mask = reference.mask.index_select(0, order)
    assert torch.equal(slots.mask, mask)
    seen = mask.bool()[:, None, :, None].expand(-1, HEADS, -1, DIM)
    for layer in range(LAYERS):
        keys, values = slots.view(layer)
        # padding columns may hold anything finite (they are masked); real ones must match
        assert torch.equal(keys[seen], reference.keys[layer].index_select(0, order)[seen])
        assert torch.equal(values[seen], reference.values[layer].index_select(0, order)[seen])
        assert torch.isfinite(keys).all() and torch.isfinite(values).all()


@pytest.mark.parametrize("seed", range(6))
def test_joins_steps_and_leaves_keep_what_the_concatenated_cache_keeps(seed, monkeypatch):
    monkeypatch.setattr(kv_slots, "FIRST_LENGTH_CAPACITY", 4)  # grow and compact often
    rng = random.Random(seed)
    slots = KvSlots(torch.device("cpu"), 64)
    reference = Reference()
    ids: list[int] = []  # the row ids in the slots' order
    made = 0
    for _ in range(120):
        action = rng.random()
        if action < 0.2 or not ids:
            count = rng.randint(1, 4)
            lengths = [rng.randint(1, 12) for _ in range(count)]
            width = max(lengths)
            mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
            keys = [torch.randn(count, HEADS, width, DIM) for _ in range(LAYERS)]
            values = [torch.randn(count, HEADS, width, DIM) for _ in range(LAYERS)]
            new = list(range(made, made + count))
            made += count
            slots.join(keys, values, mask)
            reference.join(new, keys, values, mask)
            ids += new
        elif action < 0.4:
            gone = {row for row in ids if rng.random() < 0.3}
            holes, movers = slots.keep([row not in gone for row in ids])
            for hole, mover in zip(holes, movers, strict=True):
                ids[hole] = ids[mover]
            del ids[len(ids) - len(gone) :]
            reference.leave(gone)
        else:
            keys = [torch.randn(len(ids), HEADS, 1, DIM) for _ in range(LAYERS)]
            values = [torch.randn(len(ids), HEADS, 1, DIM) for _ in range(LAYERS)]
            cache, mask = slots.open_column()
            assert mask.shape == (len(ids), slots.end - slots.start + 1)
            for layer in range(LAYERS):
                seen_keys, seen_values = cache.layers[layer].update(keys[layer], values[layer])
                assert seen_keys.shape[2] == mask.shape[1]
            slots.close_column()
            order = torch.tensor([ids.index(row) for row in reference.ids])  # its row order
            reference.decode(
                [k.index_select(0, order) for k in keys], [v.index_select(0, order) for v in values]
            )
        assert_same(slots, ids, reference)


def test_a_full_buffer_compacts_or_doubles_rather_than_growing_each_step(monkeypatch):
    monkeypatch.setattr(kv_slots, "FIRST_LENGTH_CAPACITY", 4)
    slots = KvSlots(torch.device("cpu"), 64)
    one = [torch.ones(1, HEADS, 2, DIM) for _ in range(LAYERS)]
    slots.join(one, one, torch.ones((1, 2), dtype=torch.long))
    buffers = []
    for _ in range(100):
        cache, _ = slots.open_column()
        for layer in range(LAYERS):
            cache.layers[layer].update(one[layer][:, :, :1], one[layer][:, :, :1])
        slots.close_column()
        buffers.append(slots.keys[0])
    assert slots.end - slots.start == 102
    assert len({id(b) for b in buffers}) <= 6  # 4 -> 8 -> ... -> 128 columns, then none


def test_on_a_gpu_the_first_buffers_hold_every_row_and_the_columns_memory_allows():
    """New buffers drop the decoding steps' CUDA graphs: on a GPU the first ones take
    every row at once and as many columns as a quarter of the free memory holds, up to
    twice the model's length (the window then always compacts)."""
    per_token = 2 * LAYERS * HEADS * DIM * 4  # keys and values, float32
    one = [torch.ones(1, HEADS, 5, DIM) for _ in range(LAYERS)]
    mask = torch.ones((1, 5), dtype=torch.long)

    def first_buffers(free_tokens: int, max_length: int) -> tuple[int, int]:
        slots = KvSlots(torch.device("cpu"), 16, max_length)
        slots.free_memory = lambda: free_tokens * per_token * 4  # a quarter: free_tokens
        slots.join(one, one, mask)
        return slots.capacity

    assert first_buffers(16 * 64, 1024) == (16, 64)  # every row, the first columns
    assert first_buffers(16 * 300, 1024) == (16, 256)  # columns doubled while they fit
    assert first_buffers(16 * 128, 1024) == (16, 128)  # doubled to exactly what fits
    assert first_buffers(16 * 10_000, 256) == (16, 512)  # exactly twice the model's length
    assert first_buffers(16 * 10_000, 300) == (16, 512)  # past the model's length, under twice
    assert first_buffers(16 * 10_000, 1025) == (16, 2048)  # (the doubling went to 4,096)
    assert first_buffers(16 * 63, 1024) == (1, 64)  # not even that: as on a CPU
    slots = KvSlots(torch.device("cpu"), 16, 1024)
    slots.join(one, one, mask)
    assert slots.free_memory is None and slots.capacity == (1, 64)  # a CPU's, as before


def test_rows_grow_by_doubling_up_to_the_batch_limit():
    """Joining rows past the allocated ones doubles the rows (amortised), never past
    `max_rows`, and takes at once as many as a large join needs."""
    one = [torch.ones(1, HEADS, 2, DIM) for _ in range(LAYERS)]
    mask = torch.ones((1, 2), dtype=torch.long)
    slots = KvSlots(torch.device("cpu"), 5)
    allocated = []
    for _ in range(5):
        slots.join(one, one, mask)
        allocated.append(slots.capacity[0])
    assert allocated == [1, 2, 4, 4, 5]  # doubled, then cut at max_rows
    slots = KvSlots(torch.device("cpu"), 16)
    slots.join(one, one, mask)
    three = [torch.ones(3, HEADS, 2, DIM) for _ in range(LAYERS)]
    slots.join(three, three, torch.ones((3, 2), dtype=torch.long))
    assert slots.capacity[0] == 4  # the rows the join needs, more than twice 1


def test_a_join_as_wide_as_a_full_window_keeps_its_columns(monkeypatch):
    """A row exactly as long as the window fits its columns: the buffer is not widened."""
    monkeypatch.setattr(kv_slots, "FIRST_LENGTH_CAPACITY", 4)
    slots = KvSlots(torch.device("cpu"), 16)
    two = [torch.ones(1, HEADS, 2, DIM) for _ in range(LAYERS)]
    slots.join(two, two, torch.ones((1, 2), dtype=torch.long))
    for _ in range(2):  # fill the buffer's 4 columns
        cache, _ = slots.open_column()
        for layer in range(LAYERS):
            cache.layers[layer].update(two[layer][:, :, :1], two[layer][:, :, :1])
        slots.close_column()
    assert (slots.start, slots.end, slots.capacity) == (0, 4, (1, 4))
    four = [torch.ones(1, HEADS, 4, DIM) for _ in range(LAYERS)]
    slots.join(four, four, torch.ones((1, 4), dtype=torch.long))
    assert (slots.start, slots.end, slots.capacity) == (0, 4, (2, 4))


def test_a_join_longer_than_the_buffer_widens_it_for_its_row_and_the_next_column(monkeypatch):
    """A row wider than the buffer's columns: the buffer takes it and the next step's
    column, so that step writes in place rather than allocating again."""
    monkeypatch.setattr(kv_slots, "FIRST_LENGTH_CAPACITY", 4)
    slots = KvSlots(torch.device("cpu"), 16)
    two = [torch.ones(1, HEADS, 2, DIM) for _ in range(LAYERS)]
    slots.join(two, two, torch.ones((1, 2), dtype=torch.long))
    nine = [torch.ones(1, HEADS, 9, DIM) for _ in range(LAYERS)]
    slots.join(nine, nine, torch.ones((1, 9), dtype=torch.long))
    assert (slots.start, slots.end, slots.capacity) == (0, 9, (2, 10))
    layout = slots.layout
    cache, mask = slots.open_column()
    assert slots.layout == layout and mask.shape == (2, 10)


@pytest.mark.parametrize(("length", "start", "grown"), [(4, 2, 4), (8, 3, 16)])
def test_a_full_buffer_compacts_when_half_of_it_is_free_else_doubles(
    length, start, grown, monkeypatch
):
    """A full buffer whose leading columns no row needs any more: it is compacted in
    place when they are half of it or more, else moved into one twice as long."""
    monkeypatch.setattr(kv_slots, "FIRST_LENGTH_CAPACITY", length)
    slots = KvSlots(torch.device("cpu"), 16)
    one = [torch.ones(1, HEADS, 1, DIM) for _ in range(LAYERS)]
    mask = torch.ones((1, 1), dtype=torch.long)

    def step():
        cache, _ = slots.open_column()
        for layer in range(LAYERS):
            cache.layers[layer].update(one[layer], one[layer])
        slots.close_column()

    slots.join(one, one, mask)
    for _ in range(start):
        step()
    slots.join(one, one, mask)  # its only column: `start`
    slots.keep([False, True])
    while slots.end < length:
        step()
    assert (slots.start, slots.capacity) == (start, (2, length))
    step()
    assert (slots.start, slots.end, slots.capacity) == (0, length - start + 1, (2, grown))


def test_the_first_buffer_holds_twice_the_first_rows():
    slots = KvSlots(torch.device("cpu"), 16)
    wide = [torch.ones(1, HEADS, 40, DIM) for _ in range(LAYERS)]
    slots.join(wide, wide, torch.ones((1, 40), dtype=torch.long))
    assert slots.capacity == (1, 80)  # FIRST_LENGTH_CAPACITY (64) is less
