"""One server's embedding table (tidal.ps.table.DynamicTable) and the hashing it rests on
(tidal.ps.api): rows exist only once trained, the optimizers are torch's, export and load
round-trip bitwise, and a row's initial value and virtual shard follow from (table, id) alone."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

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
    assert 0 < part["ids"].numel() < ids.numel() and table.count(moved) == part["ids"].numel()
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
