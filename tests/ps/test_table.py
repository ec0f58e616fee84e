"""One server's embedding table (tidal.ps.table.DynamicTable) and the hashing it rests on
(tidal.ps.api): rows exist only once trained, the optimizers are torch's, export and load
round-trip bitwise, and a row's initial value and virtual shard follow from (table, id) alone."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tidal.ps.api import PSError, TableSpec, initial_rows, virtual_shard
from tidal.ps.table import DynamicTable

STEPS = 5


def ids_of(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def grads(steps: int, n: int, dim: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=g) for _ in range(steps)]


# ---------------------------------------------------------------------------- rows
def test_a_read_of_untrained_ids_is_their_initial_value_and_stores_nothing() -> None:
    spec = TableSpec("t", 3, init_scale=0.5)
    table = DynamicTable(spec)
    ids = ids_of(9, 2, 40)
    assert torch.equal(table.read(ids), initial_rows(spec, ids))
    assert table.rows == 0 and table.nbytes == 0
    assert table.export()["ids"].numel() == 0

    table.apply(ids_of(2, 40), torch.ones(2, 3))
    assert table.rows == 2
    table.apply(ids_of(40, 7), torch.ones(2, 3))  # 40 again: one new row
    assert table.rows == 3
    got = table.read(ids_of(9, 7, 2))
    assert torch.equal(got[0], initial_rows(spec, ids_of(9))[0])  # still untrained, still not stored
    assert table.rows == 3
    assert table.read(ids_of()).shape == (0, 3)


def test_rows_grow_past_the_initial_capacity() -> None:
    spec = TableSpec("t", 2, optimizer="adam", lr=0.1)
    table = DynamicTable(spec, capacity=4)
    for start in range(0, 40, 8):
        table.apply(torch.arange(start, start + 8), torch.full((8, 2), 0.5))
    assert table.rows == 40
    out = table.export()
    assert torch.equal(out["ids"], torch.arange(40))
    assert torch.equal(out["steps"], torch.ones(40, dtype=torch.int64))
    # every row moved by one Adam step from its own initial value (|update| = lr for a constant grad)
    torch.testing.assert_close(out["weight"], initial_rows(spec, torch.arange(40)) - 0.1, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------- optimizers
Make = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def reference_run(spec: TableSpec, ids: torch.Tensor, steps: list[torch.Tensor], make: Make) -> torch.Tensor:
    """torch's optimizer ``make`` on the rows of ``ids`` as one dense parameter."""
    param = torch.nn.Parameter(initial_rows(spec, ids).clone())
    opt = make([param])
    for g in steps:
        opt.zero_grad()
        param.grad = g.clone()
        opt.step()
    return param.detach()


def table_run(spec: TableSpec, ids: torch.Tensor, steps: list[torch.Tensor]) -> torch.Tensor:
    table = DynamicTable(spec)
    for g in steps:
        table.apply(ids, g)
    return table.read(ids)


def test_sgd_is_torchs_sgd() -> None:
    spec = TableSpec("s", 4, optimizer="sgd", lr=0.3, init_scale=0.2)
    ids = ids_of(3, 1, 8)
    steps = grads(STEPS, 3, 4)
    want = reference_run(spec, ids, steps, lambda p: torch.optim.SGD(p, lr=0.3))
    torch.testing.assert_close(table_run(spec, ids, steps), want, atol=1e-6, rtol=1e-6)


def test_adagrad_is_torchs_adagrad() -> None:
    spec = TableSpec("g", 4, optimizer="adagrad", lr=0.05, eps=1e-10, init_scale=0.2)
    ids = ids_of(10, 11, 500)
    steps = grads(STEPS, 3, 4, seed=1)
    want = reference_run(spec, ids, steps, lambda p: torch.optim.Adagrad(
        p, lr=0.05, eps=1e-10, lr_decay=0.0, initial_accumulator_value=0.0))
    table = DynamicTable(spec)
    for g in steps:
        table.apply(ids, g)
    torch.testing.assert_close(table.read(ids), want, atol=1e-6, rtol=1e-6)
    state_sum = sum(g * g for g in steps)
    assert isinstance(state_sum, torch.Tensor)
    torch.testing.assert_close(table.export()["sum"][torch.argsort(ids)], state_sum[torch.argsort(ids)])


def test_adam_is_torchs_adam_on_rows_trained_every_step() -> None:
    spec = TableSpec("a", 4, optimizer="adam", lr=0.01, beta1=0.8, beta2=0.99, eps=1e-8, init_scale=0.2)
    ids = ids_of(4, 2, 77)
    steps = grads(STEPS, 3, 4, seed=2)
    want = reference_run(spec, ids, steps, lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), eps=1e-8))
    torch.testing.assert_close(table_run(spec, ids, steps), want, atol=1e-6, rtol=1e-6)


def test_adam_is_lazy_a_row_moves_only_with_its_gradient() -> None:
    """A row trained at steps 0, 2 and 3 only is Adam over those three gradients, step counts 1..3."""
    spec = TableSpec("a", 3, optimizer="adam", lr=0.01, eps=1e-8, init_scale=0.2)
    table = DynamicTable(spec)
    steps = grads(4, 2, 3, seed=3)
    for i, g in enumerate(steps):
        if i == 1:
            table.apply(ids_of(5), g[:1])  # row 9 sits this step out
        else:
            table.apply(ids_of(5, 9), g)
    adam: Make = lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-8)  # noqa: E731
    want9 = reference_run(spec, ids_of(9), [steps[i][1:] for i in (0, 2, 3)], adam)
    want5 = reference_run(spec, ids_of(5), [g[:1] for g in steps], adam)
    torch.testing.assert_close(table.read(ids_of(9)), want9, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(table.read(ids_of(5)), want5, atol=1e-6, rtol=1e-6)
    assert table.export()["steps"].tolist() == [4, 3]


# ---------------------------------------------------------------------------- export / load
def trained(spec: TableSpec) -> DynamicTable:
    table = DynamicTable(spec, capacity=2)
    g = torch.Generator().manual_seed(4)
    for batch in ([50, 3], [7, 1, 100], [3, -5, 2**40]):
        ids = torch.tensor(batch, dtype=torch.int64)
        table.apply(ids, torch.randn(len(batch), spec.dim, generator=g))
    return table


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_export_is_in_id_order_and_load_round_trips_bitwise(optimizer: str) -> None:
    spec = TableSpec("e", 3, optimizer=optimizer, lr=0.1)
    table = trained(spec)
    out = table.export()
    assert out["ids"].tolist() == sorted([50, 3, 7, 1, 100, -5, 2**40])
    assert torch.equal(out["weight"], table.read(out["ids"]))
    fields = {"sgd": {"ids", "weight"}, "adagrad": {"ids", "weight", "sum"},
              "adam": {"ids", "weight", "exp_avg", "exp_avg_sq", "steps"}}[optimizer]
    assert set(out) == fields

    # pieces: start and limit page through the same order
    pieces = [table.export(start, 3) for start in range(0, table.rows, 3)]
    assert torch.equal(torch.cat([p["ids"] for p in pieces]), out["ids"])

    fresh = DynamicTable(spec)
    for p in pieces:
        fresh.load(p)
    again = fresh.export()
    assert set(again) == set(out)
    for name in out:
        assert again[name].dtype == out[name].dtype
        assert torch.equal(again[name], out[name]), name

    # the optimizer state came along: one more identical step stays bitwise identical
    ids, g = ids_of(100, 3, 8), torch.full((3, 3), 0.25)
    table.apply(ids, g)
    fresh.apply(ids, g)
    for name, value in table.export().items():
        assert torch.equal(fresh.export()[name], value), name


def test_load_of_rows_already_stored_is_refused() -> None:
    spec = TableSpec("e", 3, optimizer="adagrad")
    table = trained(spec)
    part = table.export(0, 2)
    with pytest.raises(PSError, match="already stored"):
        table.load(part)
    other = DynamicTable(spec)
    other.apply(ids_of(int(part["ids"][1])), torch.ones(1, 3))
    with pytest.raises(PSError, match="already stored"):
        other.load(part)
    assert other.rows == 1


def test_load_checks_its_fields() -> None:
    spec = TableSpec("e", 3, optimizer="adam")
    part = trained(spec).export()
    table = DynamicTable(spec)
    with pytest.raises(PSError, match="int64 ids"):
        table.load({**part, "ids": part["ids"].int()})
    with pytest.raises(PSError, match="steps"):
        table.load({k: v for k, v in part.items() if k != "steps"})
    with pytest.raises(PSError, match="weight"):
        table.load({**part, "weight": part["weight"][:, :2]})
    assert table.rows == 0


def test_ids_out_of_a_fixed_tables_range_are_refused_with_the_id() -> None:
    table = DynamicTable(TableSpec("f", 2, num_ids=10))
    table.check_ids(ids_of(0, 9, 5))
    table.check_ids(ids_of())
    with pytest.raises(PSError, match=r"id 10 is out of range \[0, 10\)"):
        table.check_ids(ids_of(3, 10))
    with pytest.raises(PSError, match=r"id -1 is out of range"):
        table.check_ids(ids_of(-1, 4))
    with pytest.raises(PSError, match=r"id 123456789 "):
        table.check_ids(ids_of(123456789))
    DynamicTable(TableSpec("d", 2)).check_ids(ids_of(-7, 2**62))  # a dynamic table takes any id


# ---------------------------------------------------------------------------- hashing
def test_initial_rows_depend_on_seed_name_and_id_only() -> None:
    spec = TableSpec("emb", 8, init_scale=0.25, seed=3)
    ids = torch.tensor([5, -1, 0, 2**50, 17, 6], dtype=torch.int64)
    rows = initial_rows(spec, ids)
    assert rows.dtype == torch.float32 and rows.shape == (6, 8)
    assert float(rows.abs().max()) <= 0.25
    # any order, any batch: each id's row is its own
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    assert torch.equal(initial_rows(spec, ids[perm]), rows[perm])
    for i in range(len(ids)):
        assert torch.equal(initial_rows(spec, ids[i:i + 1])[0], rows[i])
    assert torch.equal(initial_rows(spec, ids), rows)  # again
    # the other settings of the spec do not matter, only seed, name, id (and the scale)
    same = TableSpec("emb", 8, init_scale=0.25, seed=3, optimizer="sgd", lr=0.5, num_ids=2**60)
    assert torch.equal(initial_rows(same, ids), rows)
    for other in (TableSpec("emb", 8, init_scale=0.25, seed=4), TableSpec("emc", 8, init_scale=0.25, seed=3)):
        assert not torch.equal(initial_rows(other, ids), rows)
    assert len({tuple(r) for r in rows.tolist()}) == 6  # distinct ids, distinct rows
    assert initial_rows(spec, ids_of()).shape == (0, 8)


def test_initial_scale_defaults() -> None:
    assert TableSpec("a", 2, num_ids=10_000).scale == pytest.approx(0.01)
    assert TableSpec("a", 2).scale == 0.01
    rows = initial_rows(TableSpec("a", 4, num_ids=16), torch.arange(1000))
    assert float(rows.abs().max()) <= 0.25 and float(rows.abs().max()) > 0.2
    assert abs(float(rows.mean())) < 0.02  # uniform around 0


def test_virtual_shards_spread_consecutive_ids_and_are_stable() -> None:
    ids = torch.arange(10_000)
    shards = virtual_shard("t", ids, 64)
    assert shards.dtype == torch.int64 and shards.shape == (10_000,)
    assert int(shards.min()) >= 0 and int(shards.max()) < 64
    counts = torch.bincount(shards, minlength=64)
    assert bool((counts > 0).all())
    assert int(counts.max()) < 3 * 10_000 // 64  # no shard holds a crowd
    assert torch.equal(virtual_shard("t", ids, 64), shards)
    assert torch.equal(virtual_shard("t", ids.flip(0), 64), shards.flip(0))
    assert torch.equal(virtual_shard("t", ids[1234:1240], 64), shards[1234:1240])
    assert not torch.equal(virtual_shard("u", ids, 64), shards)  # the table's name is hashed in
    neg = virtual_shard("t", torch.tensor([-1, -(2**63)]), 64)
    assert int(neg.min()) >= 0 and int(neg.max()) < 64


def test_hashes_are_the_same_in_another_process() -> None:
    """Nothing depends on the process (Python's string hash is salted per process)."""
    code = (
        "import json, torch\n"
        "from tidal.ps.api import TableSpec, initial_rows, virtual_shard\n"
        "ids = torch.tensor([0, 1, 2, 99, -3, 2**45])\n"
        "print(json.dumps({'shard': virtual_shard('clicks', ids, 64).tolist(),\n"
        "                  'rows': initial_rows(TableSpec('clicks', 3, seed=9), ids).tolist()}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"}, check=True)
    got = json.loads(out.stdout)
    ids = torch.tensor([0, 1, 2, 99, -3, 2**45])
    assert got["shard"] == virtual_shard("clicks", ids, 64).tolist()
    assert torch.equal(torch.tensor(got["rows"], dtype=torch.float32),
                       initial_rows(TableSpec("clicks", 3, seed=9), ids))


# ---------------------------------------------------------------------------- virtual shards
def test_export_by_shard_and_drop_shards_partition_the_rows() -> None:
    spec = TableSpec("e", 2, optimizer="adam", lr=0.1)
    table = DynamicTable(spec, capacity=4)
    ids = torch.arange(-200, 300, 3, dtype=torch.int64)
    table.apply(ids, torch.randn(ids.numel(), 2, generator=torch.Generator().manual_seed(1)))
    table.apply(ids[::2], torch.ones(ids[::2].numel(), 2))
    before = table.export()
    moved = ([1, 5, 6], 8)
    part, rest = table.export(shards=moved), table.export(shards=([0, 2, 3, 4, 7], 8))
    assert 0 < part["ids"].numel() < ids.numel() and table.export_page(shards=moved)[1] == part["ids"].numel()
    assert set(virtual_shard("e", part["ids"], 8).tolist()) <= {1, 5, 6}
    assert torch.equal(torch.sort(torch.cat([part["ids"], rest["ids"]])).values, before["ids"])
    assert table.drop_shards(*moved) == part["ids"].numel()
    assert table.drop_shards(*moved) == 0  # idempotent
    left = table.export()
    for name, value in rest.items():
        assert torch.equal(left[name], value), name
    # a dropped row reads as its initial value again, and its state starts afresh when trained
    assert torch.equal(table.read(part["ids"][:3]), initial_rows(spec, part["ids"][:3]))
    again = DynamicTable(spec)
    again.load(part)
    for name, value in part.items():
        assert torch.equal(again.export()[name], value), name
    table.apply(part["ids"][:1], torch.ones(1, 2))
    assert int(table.export(shards=moved)["steps"][0]) == 1


# ---------------------------------------------------------------------------- the id index
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def crowded(count: int, seed: int = 0) -> list[int]:
    """``count`` distinct ids packed around one random point, with gaps of 1 and 2: neighbours
    that a binary search must tell apart, and absent ids between held ones."""
    g = np.random.default_rng(seed)
    base = int(g.integers(-(2**40), 2**40))
    return sorted({base + 3 * k + int(g.integers(0, 2)) for k in range(count)})


def awkward_ids(seed: int) -> list[int]:
    """Distinct ids at the edges of int64, negative ids, ids that differ only in high bits, and
    ids packed together."""
    edges = [INT64_MIN, INT64_MIN + 1, -1, 0, 1, INT64_MAX - 1, INT64_MAX]
    high_bits = [k << 40 for k in range(-64, 64) if k] + [(k << 56) | 5 for k in range(-128, 128)]
    return [*edges, *high_bits, *crowded(24, seed)]


def check_slots(table: DynamicTable, ref: dict[int, int], probe: list[int]) -> None:
    want = [ref.get(i, -1) for i in probe]
    got = table.slots(torch.tensor(probe, dtype=torch.int64))
    assert got.dtype == np.int64 and got.tolist() == want
    assert table.rows == len(ref)
    assert sorted(table.export()["ids"].tolist()) == sorted(ref)


def test_the_index_agrees_with_a_dict_over_many_random_batches() -> None:
    """Batches of unique ids of every kind, some stored, some new: apply stores the new ones at
    the next slots in batch order, and every lookup matches a dict's (including ids absent)."""
    spec = TableSpec("x", 2, optimizer="sgd", lr=0.5)
    table = DynamicTable(spec, capacity=2)
    g = np.random.default_rng(7)
    pool = np.unique(np.concatenate([
        np.array(awkward_ids(1), dtype=np.int64),
        g.integers(INT64_MIN, INT64_MAX, 3000, dtype=np.int64, endpoint=True),
        g.integers(-50, 50, 100),
        g.integers(0, 2**20, 1000) << 20,  # low 20 bits all zero
    ]))
    ref: dict[int, int] = {}
    for _ in range(60):
        batch = g.choice(pool, int(g.integers(0, 400)), replace=False).tolist()
        for i in batch:
            if i not in ref:
                ref[i] = len(ref)
        table.apply(torch.tensor(batch, dtype=torch.int64), torch.ones(len(batch), 2))
        check_slots(table, ref, g.choice(pool, 500).tolist())
    check_slots(table, ref, pool.tolist())
    assert table.export()["ids"].tolist() == sorted(ref)


def test_ids_meeting_at_one_cell_in_one_batch_each_get_their_own_slot() -> None:
    spec = TableSpec("x", 3, optimizer="adagrad", lr=0.1)
    crowd = crowded(30)
    table = DynamicTable(spec)
    table.apply(torch.tensor(crowd[:20], dtype=torch.int64), torch.ones(20, 3))
    table.apply(torch.tensor(crowd[10:], dtype=torch.int64), torch.ones(20, 3))
    ref = {i: n for n, i in enumerate(crowd)}
    check_slots(table, ref, [*crowd, *[i + 1 for i in crowd], *crowded(10, seed=1)])
    steps = {i: 2 if 10 <= n < 20 else 1 for n, i in enumerate(crowd)}
    out = table.export()
    want_sum = torch.tensor([float(steps[i]) for i in out["ids"].tolist()])[:, None].expand(-1, 3)
    assert torch.equal(out["sum"], want_sum)


def test_the_index_stays_right_across_merges_of_its_two_levels() -> None:
    """Batches small and large: new ids go to the recent level, which merges into the main one
    past its bound; every lookup matches a dict's before and after each merge."""
    spec = TableSpec("x", 1, optimizer="sgd")
    table = DynamicTable(spec, capacity=1)
    g = np.random.default_rng(3)
    ids = np.unique(g.integers(INT64_MIN, INT64_MAX, 40_000, dtype=np.int64, endpoint=True))
    g.shuffle(ids)
    ref: dict[int, int] = {}
    start, sizes = 0, [1, 1, 5, 30, 31, 64, 200, 1000, 7, 1500, 5000, 20_000, 3]
    merged = []
    for size in sizes:
        batch = ids[start:start + size].tolist()
        start += size
        ref.update({i: len(ref) + n for n, i in enumerate(batch)})
        table.apply(torch.tensor(batch, dtype=torch.int64), torch.zeros(len(batch), 1))
        merged.append(len(table._index._main[0]))
        assert table._index.size == len(ref)
        check_slots(table, ref, ids[:start + 500].tolist())  # with 500 ids not stored yet
    assert merged[0] == 0 and 0 < merged[-1] < len(ref) and len(set(merged)) >= 3  # merged more than once


def test_reads_of_unknown_ids_give_initial_rows_and_store_nothing_in_a_full_index() -> None:
    spec = TableSpec("x", 4, optimizer="adam", lr=0.1)
    table = DynamicTable(spec)
    stored = torch.tensor(awkward_ids(2), dtype=torch.int64)
    table.apply(stored, torch.ones(stored.numel(), 4))
    before = table.export()
    held = table._index.size
    unknown = torch.tensor([*[i + 1 for i in crowded(24, seed=2)], *crowded(40, seed=5), 12345, -12345],
                           dtype=torch.int64)
    assert not set(unknown.tolist()) & set(stored.tolist())
    assert (table.slots(unknown) == -1).all()
    assert torch.equal(table.read(unknown), initial_rows(spec, unknown))
    mixed = torch.cat([unknown, stored])
    rows = table.read(mixed)
    assert torch.equal(rows[:unknown.numel()], initial_rows(spec, unknown))
    assert torch.equal(rows[unknown.numel():], table.read(stored))
    assert not torch.equal(table.read(stored), initial_rows(spec, stored))  # trained
    assert table.rows == stored.numel() and table._index.size == held
    for name, value in table.export().items():
        assert torch.equal(value, before[name]), name
    assert table.slots(torch.tensor([], dtype=torch.int64)).shape == (0,)


def test_drop_shards_then_reads_reinserts_and_exports_follow_the_index() -> None:
    """Kept rows move down to slots 0..n-1 in their old order; dropped ids are forgotten,
    read as initial values again and are stored afresh when trained."""
    spec = TableSpec("d", 2, optimizer="adam", lr=0.1)
    table = DynamicTable(spec, capacity=8)
    g = np.random.default_rng(11)
    ids = torch.from_numpy(np.unique(np.concatenate([
        np.array(awkward_ids(3), dtype=np.int64), g.integers(INT64_MIN, INT64_MAX, 3000, dtype=np.int64)])))
    ids = ids[torch.from_numpy(g.permutation(ids.numel()))]
    for part in ids.split(700):
        table.apply(part, torch.randn(part.numel(), 2, generator=torch.Generator().manual_seed(part.numel())))
    order = ids.tolist()  # slot order
    moved = ([0, 3], 4)
    part = table.export(shards=moved)
    gone = set(part["ids"].tolist())
    assert 0 < len(gone) < len(order)
    rest = table.export(shards=([1, 2], 4))
    assert table.drop_shards(*moved) == len(gone)

    kept = [i for i in order if i not in gone]
    ref = {i: n for n, i in enumerate(kept)}
    check_slots(table, ref, order)
    for name, value in table.export().items():
        assert torch.equal(value, rest[name]), name
    dropped = part["ids"][:50]
    assert torch.equal(table.read(dropped), initial_rows(spec, dropped))
    assert table.rows == len(kept)

    # trained again: new rows at the next slots, state from scratch
    again = part["ids"][10:60]
    table.apply(again, torch.ones(again.numel(), 2))
    ref.update({i: len(kept) + n for n, i in enumerate(again.tolist())})
    check_slots(table, ref, order)
    assert table.export(shards=moved)["steps"].tolist() == [1] * again.numel()
    # the rest of the moved rows come back by load, bitwise
    others = {k: v[torch.from_numpy(~np.isin(part["ids"].numpy(), again.numpy()))] for k, v in part.items()}
    table.load(others)
    ref.update({i: len(ref) + n for n, i in enumerate(others["ids"].tolist())})
    check_slots(table, ref, order)
    back = table.export(shards=moved)
    keep = ~np.isin(back["ids"].numpy(), again.numpy())
    for name, value in others.items():
        assert torch.equal(back[name][torch.from_numpy(keep)], value), name
    assert table.drop_shards(*moved) == part["ids"].numel()
    check_slots(table, {i: n for n, i in enumerate(kept)}, order)


def test_load_into_a_table_holding_rows_indexes_them_and_round_trips() -> None:
    spec = TableSpec("l", 3, optimizer="adam", lr=0.05)
    source = DynamicTable(spec)
    g = np.random.default_rng(5)
    ids = torch.from_numpy(np.unique(np.concatenate([
        np.array(awkward_ids(4), dtype=np.int64), g.integers(INT64_MIN, INT64_MAX, 5000, dtype=np.int64)])))
    for k in range(3):  # three steps for every row
        source.apply(ids, torch.randn(ids.numel(), 3, generator=torch.Generator().manual_seed(k)))
    out = source.export()
    target = DynamicTable(spec, capacity=4)
    target.apply(ids[::7], torch.ones(ids[::7].numel(), 3))  # its own rows
    held = set(ids[::7].tolist())
    want_ids = [i for i in out["ids"].tolist() if i not in held]
    pick = torch.from_numpy(~np.isin(out["ids"].numpy(), ids[::7].numpy()))
    part = {k: v[pick] for k, v in out.items()}
    for start in range(0, len(want_ids), 1000):  # pages, as a move loads them
        target.load({k: v[start:start + 1000] for k, v in part.items()})
    ref = {i: n for n, i in enumerate([*ids[::7].tolist(), *want_ids])}
    check_slots(target, ref, ids.tolist())
    assert torch.equal(target.read(part["ids"]), part["weight"])
    merged = target.export()
    for name, value in part.items():
        assert torch.equal(merged[name][pick], value), name
    with pytest.raises(PSError, match="already stored"):
        target.load({k: v[-3:] for k, v in part.items()})
    assert target.rows == ids.numel()
