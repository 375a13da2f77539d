"""Faulty data and client-side configuration errors fail fast and clearly: a bad dataset file is a
ConfigError naming the file (and the first bad row), raised where the partition is loaded, so that
it reaches the server at the handshake and the run fails in seconds; nodes that disagree on
``num-partitions`` are judged by majority."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from common.config import ConfigError, RunConfig
from common.data import DataSpec, load_client_data
from common.protocol import CONFIG_ERROR_KEY, CONFIG_ERROR_RECORD
from conftest import data_spec, federation

#: the Hugging Face features of the offline MNIST files (../shared/data/README.md): an Image column
#: of encoded bytes and a ClassLabel
FEATURES = {
    "info": {
        "features": {
            "image": {"_type": "Image"},
            "label": {"names": [str(c) for c in range(10)], "_type": "ClassLabel"},
        }
    }
}
ROWS = 60


def png(size: int = 28, seed: int = 0) -> bytes:
    """A random grayscale PNG of ``size`` x ``size`` pixels."""
    from torchvision.io import encode_png

    pixels = torch.randint(0, 256, (1, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return encode_png(pixels).numpy().tobytes()


def write_mnist(
    root, images=None, labels=None, label_type="int64", columns=("image", "label"), compression="zstd", split="train"
):
    """``root/mnist/<split>.parquet`` in the Hub's schema (zstd, as the offline files): ``ROWS`` random
    28x28 PNGs with labels ``i % 10`` unless ``images``/``labels`` say otherwise; returns its path."""
    images = images if images is not None else [png(seed=i) for i in range(ROWS)]
    labels = labels if labels is not None else [i % 10 for i in range(len(images))]
    table = pa.table(
        {
            "image": pa.array([{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(images)]),
            "label": pa.array(labels, pa.type_for_alias(label_type)),
        }
    ).select(list(columns))
    path = root / "mnist" / f"{split}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.replace_schema_metadata({"huggingface": json.dumps(FEATURES)}), path, compression=compression)
    return path


def spec(root, num_partitions: int = 1) -> DataSpec:
    """MNIST from the tiny files in ``root``, iid over ``num_partitions``, seed 0."""
    return data_spec(dataset="mnist", data_dir=str(root), partitioner="iid", num_partitions=num_partitions, seed=0)


def load_fails(root, match: str) -> str:
    """Loading partition 0 of ``root``'s MNIST fails with a ConfigError matching ``match``; its text."""
    with pytest.raises(ConfigError, match=match) as failure:
        load_client_data.__wrapped__(spec(root), 0)
    text = str(failure.value)
    assert "no file" not in text and "Hub" not in text, text  # the file exists: never blamed as missing
    return text


def test_a_tiny_file_in_the_hub_schema_loads(tmp_path):
    write_mnist(tmp_path)
    data = load_client_data.__wrapped__(spec(tmp_path), 0)
    # 6 images per class, round(0.2 * 6) = 1 of each class kept for the local test split
    assert data.train_x.shape == (50, 1, 28, 28) and data.test_x.shape == (10, 1, 28, 28)
    assert sorted(torch.cat([data.train_y, data.test_y]).tolist()) == sorted(i % 10 for i in range(ROWS))


@pytest.mark.parametrize(
    "labels, match",
    [
        ([*range(10)] * 3 + [12] + [*range(10)] * 2 + [-1] * 9, r"row 30 has label 12, outside \[0, 10\) \(10 row"),
        ([c % 10 for c in range(ROWS - 1)] + [None], r"no label in 1 row\(s\), the first row 59"),
    ],
)
def test_labels_outside_the_classes_name_the_file_and_first_row(tmp_path, labels, match):
    path = write_mnist(tmp_path, labels=labels)
    assert str(path) in load_fails(tmp_path, match)


def test_labels_that_are_not_integers_name_the_file(tmp_path):
    path = write_mnist(tmp_path, labels=[float(i % 10) for i in range(ROWS)], label_type="float64")
    assert str(path) in load_fails(tmp_path, "column 'label' .* holds double, not integer class ids")


@pytest.mark.parametrize(
    "bad, match",
    [
        (b"\x89PNG but not an image", r"row 17 cannot be decoded"),
        (b"", r"row 17 cannot be decoded"),
        (png(size=32), r"row 17 is 32x32 pixels, dataset 'mnist' has 28x28"),
    ],
)
def test_an_undecodable_or_wrong_size_image_names_the_file_and_row(tmp_path, bad, match):
    images = [png(seed=i) for i in range(ROWS)]
    images[17] = bad
    path = write_mnist(tmp_path, images=images)
    text = load_fails(tmp_path, match)
    assert str(path) in text and "1 of 60 images" in text


def test_a_bad_image_of_the_test_split_in_a_train_and_test_pool_names_the_test_file(tmp_path):
    write_mnist(tmp_path)
    images = [png(seed=i) for i in range(20)]
    images[3] = png(size=14)
    path = write_mnist(tmp_path, images=images, split="test")
    pooled = dataclasses.replace(spec(tmp_path), data_pool="train+test")
    with pytest.raises(ConfigError, match=rf"^dataset file {re.escape(str(path))}: the image in row 3 is 14x14"):
        load_client_data.__wrapped__(pooled, 0)


def flip_footer(data: bytes) -> bytes:
    """Flip every bit of the footer's first byte (the parquet footer ends with its 4-byte length and 'PAR1')."""
    start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    return data[:start] + bytes([data[start] ^ 0xFF]) + data[start + 1 :]


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda data: b"", r"is empty \(0 bytes\), not a parquet file"),
        (lambda data: data[: len(data) // 2], r"is truncated: \d+ bytes that do not end with parquet's footer"),
        (lambda data: b"image,label\n0,1\n" * 10, r"is not a parquet file"),
        (flip_footer, r"is corrupt: its parquet footer cannot be read \(OSError: Couldn't deserialize thrift"),
    ],
    ids=["empty", "truncated", "csv", "bit-flipped-footer"],
)
def test_a_damaged_parquet_file_is_named_with_what_is_wrong(tmp_path, damage, match):
    path = write_mnist(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    assert str(path) in load_fails(tmp_path, match)


def test_a_bit_flipped_image_is_named_not_a_crash(tmp_path):
    """One flipped bit inside a stored PNG: torchvision's decoder would end the process; the
    PNG's chunk CRCs name the row instead (an uncompressed file, so the image's bytes are found)."""
    path = write_mnist(tmp_path, compression="none")
    data = path.read_bytes()
    at = data.index(png(seed=17)[40:56]) + 8
    path.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :])
    text = load_fails(tmp_path, r"row 17 cannot be decoded \(a damaged PNG: a chunk's CRC-32 does not match")
    assert str(path) in text and "1 of 60 images" in text


def test_a_file_without_the_label_column_names_the_file_and_column(tmp_path):
    path = write_mnist(tmp_path, columns=("image",))
    assert str(path) in load_fails(tmp_path, r"has no column 'label' \(the class ids\); its columns: 'image'")


def test_a_pool_too_small_for_the_partitions_names_the_key(tmp_path):
    write_mnist(tmp_path, images=[png(seed=i) for i in range(7)])
    # flwr-datasets' iid partitioner raised an IndexError for partition 3 of 7 examples in 4 partitions
    with pytest.raises(ConfigError, match=r"7 examples .* too few for 4 partitions .*'num-clients' .* at most 3"):
        load_client_data.__wrapped__(spec(tmp_path, num_partitions=4), 3)


def test_a_partitioner_that_cannot_split_names_its_keys(tmp_path):
    write_mnist(tmp_path)
    # two Dirichlet partitions of at least 40 of 60 examples: flwr-datasets gives up with a ValueError
    impossible = dataclasses.replace(spec(tmp_path, 2), partitioner="dirichlet", dirichlet_min_size=40)
    with pytest.raises(ConfigError, match=r"'dirichlet' partitioner cannot split .*'num-clients', 'dirichlet-alpha'"):
        load_client_data.__wrapped__(impossible, 0)


def test_num_clients_beyond_the_dataset_fails_in_the_run_config(run_config):
    # 60,000 MNIST training images hold at most 30,000 clients of one train and one test example each
    RunConfig.from_dict(run_config(dataset="mnist", **{"num-clients": 30_000}))
    with pytest.raises(ConfigError, match=r"'num-clients' = 30001 .* 0 to 30000 for dataset 'mnist'"):
        RunConfig.from_dict(run_config(dataset="mnist", **{"num-clients": 30_001}))
    with pytest.raises(ConfigError, match=r"'num-clients' = 40000 .* 0 to 35000"):
        RunConfig.from_dict(run_config(dataset="mnist", **{"num-clients": 40_000, "data-pool": "train+test"}))


def failed_run(rc: dict, window=None):
    """Run ``rc`` over the fake grid as the ServerApp does, or with a simulation's message ``window``
    (``server_app.app.run`` gives one to a simulation's grid only); (its error, wall seconds, its
    summary.json, None with a window)."""
    from server_app.app import run

    strategy, grid = federation(rc)
    start = time.monotonic()
    with pytest.raises(Exception) as failure:
        if window is None:
            run(grid, RunConfig.from_dict(rc), "faults")
        else:
            strategy.start(grid, window=window)
    seconds = time.monotonic() - start
    summaries = list(Path(rc["output-dir"]).glob("*/summary.json")) if window is None else []
    return failure.value, seconds, json.loads(summaries[0].read_text()) if summaries else None


def bad_label(root):
    write_mnist(root, labels=[*range(10)] * 3 + [12] + [*range(10)] * 2 + [0] * 9)


def bad_image(root):
    write_mnist(root, images=[png(seed=i) for i in range(ROWS - 1)] + [png(size=32)])


DIRICHLET_40 = {"partitioner": "dirichlet", "dirichlet-min-size": 40}


@pytest.mark.parametrize(
    "build, kw, simulated, match",
    [
        (bad_label, {"num-clients": 4}, False, r"row 30 has label 12"),
        (bad_image, {"num-clients": 1}, False, r"row 59 is 32x32 pixels"),
        (write_mnist, {"num-clients": 2, **DIRICHLET_40}, False, r"'dirichlet' partitioner .*'dirichlet-alpha'"),
        # one bad image fails only the node holding it: in a simulation that is the run's error
        (bad_image, {"num-clients": 4}, True, r"row 59 is 32x32 pixels"),
    ],
    ids=["label", "image", "partitioner", "image-simulated"],
)
def test_a_client_data_error_fails_the_run_at_the_handshake_in_seconds(
    tmp_path, run_config, build, kw, simulated, match
):
    """Before, the query passed and every client failed every round of a 'completed' run (a bad
    label or image), or the partitioner's ValueError left the server waiting connect-timeout."""
    build(tmp_path)
    every_row = {"partitioner": "iid", "max-examples-per-client": 0}  # the bad row is some client's
    rc = run_config(dataset="mnist", **{"data-dir": str(tmp_path), "connect-timeout": 60.0, **every_row, **kw})
    error, seconds, summary = failed_run(rc, window=(lambda: 16) if simulated else None)
    assert isinstance(error, ConfigError) and re.search(match, str(error)), error
    lead = "fail on a simulated node" if simulated else "no node that answered the handshake can serve the run"
    assert lead in str(error), error
    # one text for the nodes that share it, each named with its partition
    assert len(re.findall(match, str(error))) == 1 and "[node 1000 (partition-id 0)" in str(error)
    assert seconds < 20, seconds  # connect-timeout is 60 s
    if not simulated:
        assert summary["status"] == "failed" and re.search(match, summary["error"])
        assert summary["rounds_completed"] == 0


HOSTILE = 1002


def claims_an_error(node: int, reply: Message) -> Message:
    """A hostile node's query reply: a well-formed config-error claim instead of its sizes, long and
    with newlines."""
    if node == HOSTILE and reply.metadata.message_type == "query":
        text = "dataset file /x is corrupt\n" * 500
        reply.content = RecordDict({CONFIG_ERROR_RECORD: ConfigRecord({CONFIG_ERROR_KEY: text})})
    return reply


def test_one_node_claiming_an_error_is_excluded_in_a_deployment_and_fails_a_simulation(run_config):
    rc = run_config(**{"num-clients": 3, "connect-timeout": 1.0, "num-server-rounds": 1})
    strategy, grid = federation(rc, tamper=claims_an_error)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as failure:  # a deployment: the run waits for partition 2's node
        strategy.start(grid)
    assert time.monotonic() - start >= 1.0 and not isinstance(failure.value, ConfigError)
    text = str(failure.value)
    assert "only 2 of num-clients=3" in text and "error: dataset file /x is corrupt dataset file" in text
    assert text.endswith(f"... [node {HOSTILE}]")
    assert "\n" not in text and len(text) < 1500  # the claim is cut and made printable
    assert HOSTILE not in strategy.federation.roster.clients and len(strategy.federation.roster.clients) == 2
    # a simulation shares one config and data folder: one node's error is the run's, at once
    strategy, grid = federation(rc, tamper=claims_an_error)
    with pytest.raises(
        ConfigError, match=rf"fail on a simulated node: 1 node\(s\) .*: dataset file /x .*\[node {HOSTILE}\]"
    ):
        strategy.start(grid, window=lambda: 16)


def test_a_node_claiming_an_error_beside_a_full_federation_changes_nothing(run_config):
    rc = run_config(**{"num-clients": 2, "connect-timeout": 5.0, "num-server-rounds": 1})
    strategy, grid = federation(rc, tamper=claims_an_error)
    grid.add_node(HOSTILE, 0)  # a third node, claiming partition 0 is broken
    strategy.start(grid)
    assert [r["num_clients"] for r in strategy.rows] == [2] and HOSTILE not in strategy.federation.roster.clients


def grid_with_sizes(rc: dict, sizes: list[int]):
    """A FakeGrid of ``len(sizes)`` nodes whose node config ``num-partitions`` are ``sizes``."""
    from client_app.app import app as client_app
    from fakegrid import FakeGrid

    grid = FakeGrid(client_app, rc, len(sizes))
    for node, n in zip(sorted(grid.contexts), sizes):
        grid.contexts[node].node_config["num-partitions"] = n
    return grid


@pytest.mark.parametrize(
    "sizes, match",
    [
        # the first node to answer is the odd one: before, the two honest nodes were blamed
        (
            [4, 3, 3],
            r"^node 1000 \(partition-id 0\) has node config 'num-partitions' = 4, other nodes have 3 "
            r"\(the majority: 2 of 3 nodes\)",
        ),
        ([4, 4, 5, 5], r"no value has a majority: node 1000 .*= 4, node 1001 .*= 4; node 1002 .*= 5, node 1003 .*= 5"),
    ],
    ids=["minority", "tie"],
)
def test_nodes_that_disagree_on_num_partitions_blame_the_minority(run_config, sizes, match):
    rc = run_config(**{"num-clients": 0, "connect-timeout": 60.0})
    with pytest.raises(ConfigError, match=match):
        federation(rc)[0].start(grid_with_sizes(rc, sizes))


@pytest.mark.slow  # spawned processes that import torch and the data stack: about a minute on 2 cores
def test_partitions_are_cached_by_processes_that_exit_and_a_bad_one_is_left_to_the_handshake(tmp_path):
    """``cache_partitions`` (tools.run's step before Ray starts) decodes every partition the cache
    lacks in processes of its own (this process loads none of them); a partition whose data are bad
    gets no file (its client meets the error at the handshake) and its error names the file and row;
    a client process then reads its partition from the cache without importing what decoding needs."""
    import pickle
    import subprocess
    import sys

    from common.data import _cache_file, cache_partitions

    bad_image(tmp_path)  # the pool's last row: 4 iid partitions of 15, one of them holds it
    cache = str(tmp_path / "cache")
    loads = load_client_data.cache_info().misses  # partitions loaded in this process
    decoded, cached, errors = cache_partitions(spec(tmp_path, 4), cache, workers=2)
    assert load_client_data.cache_info().misses == loads
    assert (decoded, cached, len(errors)) == (3, 0, 1)
    assert "mnist/train.parquet" in errors[0] and "row 59 is 32x32 pixels" in errors[0]
    files = [_cache_file(spec(tmp_path, 4), i, cache)[0].is_file() for i in range(4)]
    assert files.count(False) == 1
    code = (
        "import pickle, sys\nsys.path.insert(0, sys.argv[1])\nfrom common.data import load_client_data\n"
        "data = load_client_data(pickle.loads(bytes.fromhex(sys.argv[2])), int(sys.argv[3]), sys.argv[4])\n"
        "print(len(data.train_y) + len(data.test_y), [m for m in ('datasets', 'torchvision') if m in sys.modules])"
    )
    root = str(Path(__file__).resolve().parents[1])
    args = [root, pickle.dumps(spec(tmp_path, 4)).hex(), str(files.index(True)), cache]
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert out.stdout.strip() == "15 []", out.stderr
