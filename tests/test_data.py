"""Partitions come from flwr-datasets, splits keep class proportions, everything is seeded."""

import numpy as np
import pytest
import torch

from common.config import ConfigError
from common.data import augment, class_counts, load_client_data, normalize, stratified_split
from common.datasets import DATASETS
from conftest import data_spec as spec


def test_pathological_gives_k_classes_and_matching_test_split():
    for pid in range(3):
        d = load_client_data(spec(), pid)
        train, test = class_counts(d.train_y, 10), class_counts(d.test_y, 10)
        assert (train > 0).sum() == 2 and ((test > 0) == (train > 0)).all()
        # same class proportions in both splits (per-class rounding only)
        total = train + test
        assert (abs(test - 0.2 * total) <= 0.5).all()
        assert d.train_x.dtype == torch.uint8 and d.train_x.shape[1:] == (3, 32, 32)


def test_same_spec_same_split_in_every_process():
    load_client_data.cache_clear()
    a = load_client_data(spec(max_examples_per_client=300), 4)
    load_client_data.cache_clear()
    b = load_client_data(spec(max_examples_per_client=300), 4)
    assert torch.equal(a.train_y, b.train_y) and torch.equal(a.test_x, b.test_x)
    c = load_client_data(spec(max_examples_per_client=300, seed=8), 4)
    assert not torch.equal(a.train_y, c.train_y) or not torch.equal(a.train_x, c.train_x)


def test_dirichlet_and_iid_and_mnist():
    d = load_client_data(spec(partitioner="dirichlet", dirichlet_alpha=0.1, num_partitions=20), 0)
    assert len(d.train_y) > 0 and (class_counts(d.train_y, 10) > 0).sum() < 10  # skewed
    d = load_client_data(spec(partitioner="iid", max_examples_per_client=500), 1)
    assert (class_counts(d.train_y, 10) > 0).sum() == 10
    assert abs(len(d.train_y) + len(d.test_y) - 500) <= 10  # the cap rounds per class
    m = load_client_data(spec(dataset="mnist", max_examples_per_client=200), 0)
    assert m.train_x.shape[1:] == (1, 28, 28)


@pytest.mark.parametrize("dataset", ["cifar10", "mnist"])
def test_a_partition_holds_the_rows_datasets_select_gives_in_its_order(dataset):
    """The partition is read with one indexed query (``Dataset.__getitem__`` with a list of rows) rather
    than ``Dataset.select`` (which builds and fingerprints a dataset first): the same images and labels,
    in the order of the train and test indices."""
    from common.data import decode_images, partition_split

    part_spec = spec(dataset=dataset, max_examples_per_client=60)
    for pid in (0, 3):
        load_client_data.cache_clear()
        data = load_client_data(part_spec, pid)
        part, labels, train_idx, test_idx = partition_split(part_spec, pid)
        label = DATASETS[dataset].label_column
        assert labels.tolist() == list(part.select(range(len(part)))[label])
        train = decode_images(part.select(train_idx.tolist())[:], part_spec)
        test = decode_images(part.select(test_idx.tolist())[:], part_spec)
        assert torch.equal(data.train_x, train) and torch.equal(data.test_x, test)
        assert torch.equal(data.train_y, labels[train_idx]) and torch.equal(data.test_y, labels[test_idx])


def test_stratified_split_keeps_singletons_in_train():
    labels = torch.tensor([0] * 10 + [1] * 5 + [2])
    first, second = stratified_split(labels, 0.2, torch.Generator().manual_seed(0))
    assert class_counts(labels[second], 3).tolist() == [2, 1, 0]
    assert sorted(torch.cat([first, second]).tolist()) == list(range(16))


def test_partition_id_out_of_range_and_missing_dataset(tmp_path):
    with pytest.raises(ConfigError, match="partition-id 10"):
        load_client_data(spec(), 10)
    with pytest.raises(ConfigError, match="data-dir"):
        load_client_data(spec(dataset="cifar100", data_dir=str(tmp_path)), 0)


def test_augment_draws_per_image_and_keeps_shape():
    info = DATASETS["cifar10"]
    x = normalize(torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8), info)
    same = x[:1].expand(64, -1, -1, -1).contiguous()
    out = augment(same, info, torch.Generator().manual_seed(0))
    assert out.shape == same.shape
    distinct = {tuple(o.flatten()[:50].tolist()) for o in out}
    assert len(distinct) > 10  # different flips/crops/erasures per image, not one for the batch
    assert torch.equal(augment(same, info, torch.Generator().manual_seed(0)), out)  # seeded
    erased_or_padded = (out == 0).flatten(1).any(1).float().mean()
    assert erased_or_padded > 0.3


def test_dirichlet_min_size_and_self_balancing():
    from common.data import partition_split

    def sizes(**kw):
        sp = spec(partitioner="dirichlet", dirichlet_alpha=0.1, seed=0, **kw)
        return [len(partition_split(sp, p)[1]) for p in range(10)]

    plain, balanced = sizes(), sizes(dirichlet_min_size=40, dirichlet_self_balancing=True)
    assert sum(plain) == sum(balanced) == 50_000
    assert min(balanced) >= 40
    # PFLlib's rule: a client above the average (5,000) gets no further class, so sizes spread less
    assert max(balanced) < max(plain) and np.std(balanced) < np.std(plain)


def test_partition_cache_hit_equals_a_fresh_decode_and_changed_keys_miss(tmp_path):
    from common.data import partition_key

    s = spec(max_examples_per_client=120)
    fresh = load_client_data.__wrapped__(s, 1)
    written = load_client_data.__wrapped__(s, 1, str(tmp_path))
    files = list(tmp_path.glob("partition-1-*.pt"))
    assert len(files) == 1 and partition_key(s, 1) in files[0].name
    hit = load_client_data.__wrapped__(s, 1, str(tmp_path))
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(hit, name), getattr(fresh, name)), name
        assert torch.equal(getattr(written, name), getattr(fresh, name)), name
    assert hit.info == fresh.info
    # anything that changes the partition changes the key: another partition, seed, cap or partitioner
    keys = {
        partition_key(s, 1),
        partition_key(s, 2),
        partition_key(spec(max_examples_per_client=120, seed=1), 1),
        partition_key(spec(max_examples_per_client=100), 1),
        partition_key(spec(max_examples_per_client=120, partitioner="iid"), 1),
    }
    assert len(keys) == 5
    load_client_data.__wrapped__(s, 2, str(tmp_path))
    assert len(list(tmp_path.glob("partition-*.pt"))) == 2


@pytest.mark.parametrize("damage", ["truncate", "garbage", "other-partition"])
def test_partition_cache_ignores_a_torn_or_foreign_file_and_rewrites_it(tmp_path, damage):
    s = spec(max_examples_per_client=120)
    fresh = load_client_data.__wrapped__(s, 1, str(tmp_path))
    path = next(tmp_path.glob("partition-1-*.pt"))
    if damage == "truncate":  # a write cut short (by a crash without the atomic rename)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 1000)
    else:  # another partition's file under this name
        load_client_data.__wrapped__(s, 2, str(tmp_path))
        path.write_bytes(next(tmp_path.glob("partition-2-*.pt")).read_bytes())
    again = load_client_data.__wrapped__(s, 1, str(tmp_path))
    assert torch.equal(again.train_x, fresh.train_x) and torch.equal(again.test_y, fresh.test_y)
    saved = torch.load(path, weights_only=True)  # rewritten whole
    assert torch.equal(saved["train_x"], fresh.train_x)


@pytest.mark.parametrize("dataset, pool", [("fashion-mnist", 70_000), ("cifar10", 60_000)])
def test_train_and_test_pool_partitions_every_official_image(dataset, pool):
    """``data-pool = "train+test"`` partitions the official train and test splits together (PFLlib's
    generators); every client's local test split comes from that pool. Checked on the labels of all
    partitions (nothing decoded): they add up to the pool; and one client's test split holds images
    of the official test split (the Fashion-MNIST files number them 60000-69999)."""
    from common.data import load_pool, partition_split

    partitioned = spec(dataset=dataset, data_pool="train+test", partitioner="iid", num_partitions=5)
    assert len(load_pool(partitioned)) == pool == DATASETS[dataset].train_size + DATASETS[dataset].test_size
    sizes = 0
    for pid in range(5):
        part, labels, train_idx, test_idx = partition_split(partitioned, pid)
        sizes += len(train_idx) + len(test_idx)
    assert sizes == pool
    if dataset == "fashion-mnist":
        paths = part.select(test_idx[:500].tolist())[DATASETS[dataset].image_column]
        from_test = sum(int(im["path"].split(".")[0]) >= 60_000 for im in paths)
        assert 30 < from_test < 120  # about 1 in 7 of the pool comes from the test split


def test_partition_seed_holds_the_partition_while_seed_varies_training(run_config):
    """Two runs with the same ``partition-seed`` and different ``seed``: identical partitions, different
    training (model initialisation and batch order)."""
    from conftest import client_runtime

    a = client_runtime(run_config(seed=1, **{"partition-seed": 0}), 2)
    b = client_runtime(run_config(seed=2, **{"partition-seed": 0}), 2)
    c = client_runtime(run_config(seed=1, **{"partition-seed": 3}), 2)
    assert torch.equal(a.data.train_x, b.data.train_x) and torch.equal(a.data.test_y, b.data.test_y)
    assert not torch.equal(a.data.train_y, c.data.train_y) or not torch.equal(a.data.train_x, c.data.train_x)
    first = [p for p in a.model.parameters()][0]
    assert not torch.equal(first, [p for p in b.model.parameters()][0])
    assert not torch.equal(torch.randperm(100, generator=a.generator(1)), torch.randperm(100, generator=b.generator(1)))


def test_stratified_split_of_no_labels_is_two_empty_parts():
    first, second = stratified_split(torch.zeros(0, dtype=torch.int64), 0.2, torch.Generator().manual_seed(0))
    assert first.dtype == second.dtype == torch.int64 and len(first) == len(second) == 0


@pytest.mark.parametrize(
    "kw",
    [
        {"partitioner": "pathological"},
        {"partitioner": "dirichlet", "dirichlet_alpha": 0.3, "num_partitions": 20},
        {"partitioner": "iid", "max_examples_per_client": 500},
    ],
    ids=["pathological", "dirichlet", "iid"],
)
def test_the_labels_only_pool_gives_every_partition_the_same_labels_and_split(kw):
    """What the pre-flight check, the class prior and the label figures read (``labels_only``) is what
    the client's own partition gives: the same labels, in the same order, and the same train/test
    indices, for every partitioner; the labels-only partition holds the label column alone."""
    from common.data import partition_split

    part_spec = spec(**kw)
    label = DATASETS[part_spec.dataset].label_column
    for pid in range(part_spec.num_partitions):
        full, labels, train_idx, test_idx = partition_split(part_spec, pid)
        only, labels_o, train_o, test_o = partition_split(part_spec, pid, labels_only=True)
        assert len(labels) > 0 and torch.equal(labels, labels_o)
        assert torch.equal(train_idx, train_o) and torch.equal(test_idx, test_o)
        assert only.column_names == [label] and label in full.column_names and len(full.column_names) > 1
