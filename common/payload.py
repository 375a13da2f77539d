"""Payload schemas: which named arrays a message carries, validated the same way for every method.

A method declares, per direction, a :class:`PayloadSchema`: array name -> :class:`ArraySpec`
with a dtype and a shape whose dimensions are ints or symbols. Symbols the server knows
(``"C"`` classes, ``"d"`` representation size) are bound before validation; any other
symbol (``"k"``: number of classes a client holds) is bound by its first occurrence and
must agree across the arrays of one reply.

Payload bytes are tensor bytes, numel x itemsize, summed over every array of every
ArrayRecord in a message: serialisation framing and config/metric scalars are excluded,
as the papers count them (docs/methods/fedgh.md §2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from io import BytesIO
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

from common.protocol import EVALUATE_MESSAGE, PAYLOAD, QUERY, TRAIN

#: default bound on the magnitude of a float payload entry (see :class:`ArraySpec` ``max_abs``)
MAX_ABS = 1e6
#: an uploaded row may be at most this many times as long as the round's typical row
#: (see :class:`ArraySpec` ``row_norm_factor``)
ROW_NORM_FACTOR = 100.0
#: a received global row (a prototype, a class logit) may be at most this many times as long as the
#: receiving client's own rows of the batch before the client leaves it out (``methods.blocks.prototypes.
#: trusted_rows``): over three times the largest honest spread measured (representation norms 0.45
#: for GoogLeNet against 135 for ResNet-34 in one htfe8 round, 300x), so an honest row is kept, while
#: a row of 1e5 in every entry (norm 2.2e6 at d = 500) against representations of norm ~10 is not
RECEIVED_ROW_FACTOR = 1000.0
#: a received global prototype may be at most this many times as long as the client's longest
#: representation of a fixed synthetic batch under its extractor as initialised, before the client
#: leaves it out (``methods.blocks.prototypes.initial_representation_scale``): representations grow up to
#: 28x from initialisation to training (mh-lenet, results/dp-clip-scale/cifar10.txt) and differ 300x
#: between honest architectures, 8,400x together; an anchor that training cannot move, since
#: representations that follow a walked prototype would move one taken from them
RECEIVED_PROTOTYPE_FACTOR = ROW_NORM_FACTOR**2


#: most names quoted in an error message (a hostile reply may carry thousands of arrays or metrics)
NAMES_SHOWN = 5


class PayloadError(ValueError):
    """A payload does not match its schema (missing/extra key, shape, dtype, value)."""


def names(keys: Iterable[str]) -> str:
    """At most :data:`NAMES_SHOWN` of ``keys``, quoted, then how many more ("none" for no key): an
    error message about a hostile reply stays short however many keys it carries."""
    keys = list(keys)
    if not keys:
        return "none"
    shown = ", ".join(repr(short(k, 40)) for k in keys[:NAMES_SHOWN])
    return shown + (f" and {len(keys) - NAMES_SHOWN} more" if len(keys) > NAMES_SHOWN else "")


def short(value: Any, limit: int = 60) -> str:
    """``value`` (a string, else its repr) cut to ``limit`` characters."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class ArraySpec:
    """One named array of a payload.

    Args:
        shape: dims as ints or symbol names, e.g. ``("k", "d")``.
        dtype: numpy dtype name, e.g. ``"float32"``, ``"int32"``.
        labels: values are class ids: integers in ``[0, C)``, unique.
        max_abs: largest magnitude a float entry may have. Finite values far beyond anything
            a trained model produces (a representation of 1e30, a weight delta of 3e38) would
            still poison a server step; the default :data:`MAX_ABS` is orders of magnitude above
            honest payloads, so it changes no honest result.
        row_norm_factor: for uploads of representation-like rows (prototypes, logits, entangled
            representations) that a server step averages or trains on without a bound of its
            own: rows longer than this factor times the round's typical row are scaled down to
            it (:func:`clip_outlier_rows`). None: no such bound (model weights, deltas).
    """

    shape: tuple[int | str, ...]
    dtype: str
    labels: bool = False
    max_abs: float = MAX_ABS
    row_norm_factor: float | None = None


@dataclass(frozen=True)
class PayloadSchema:
    """Named arrays of one message direction; an empty schema means "no payload at all".

    Args:
        arrays: name -> spec.
        optional: the whole payload may also be absent (e.g. no global prototypes in round 1).
        check: extra consistency test ``check(arrays, bound_dims)`` raising PayloadError.
    """

    arrays: Mapping[str, ArraySpec] = field(default_factory=dict)
    optional: bool = False
    check: Callable[[Mapping[str, np.ndarray], Mapping[str, int]], None] | None = None

    def validate(self, arrays: Mapping[str, np.ndarray], dims: Mapping[str, int]) -> dict[str, int]:
        """Check ``arrays`` against the schema.

        Args:
            arrays: name -> ndarray, as received.
            dims: values of the symbols the receiver knows (e.g. ``{"C": 10, "d": 500}``).

        Returns:
            The bound values of all symbols (known and free).

        Raises:
            PayloadError: on missing or extra keys, wrong dtype or shape, non-finite floats or
                floats above the spec's magnitude bound, or label arrays with out-of-range or
                repeated class ids.
        """
        if self.optional and not arrays:
            return dict(dims)
        self.check_names(arrays)
        bound = dict(dims)
        for name, spec in self.arrays.items():
            a = arrays[name]
            if a.dtype != np.dtype(spec.dtype):
                raise PayloadError(f"'{name}' has dtype {a.dtype}, expected {spec.dtype}")
            if a.ndim != len(spec.shape):
                raise PayloadError(f"'{name}' has shape {a.shape}, expected {spec.shape}")
            for axis, (dim, size) in enumerate(zip(spec.shape, a.shape)):
                want = bound.setdefault(dim, size) if isinstance(dim, str) else dim
                if size != want:
                    raise PayloadError(f"'{name}' has shape {a.shape}: axis {axis} is {size}, expected {dim}={want}")
            if a.dtype.kind == "f" and a.size:
                if not np.isfinite(a).all():
                    raise PayloadError(f"'{name}' has non-finite values")
                if np.abs(a).max() > spec.max_abs:
                    raise PayloadError(
                        f"'{name}' has entries of magnitude {np.abs(a).max():.3g}, above the bound {spec.max_abs:.3g}"
                    )
            if spec.labels:
                num_classes = bound["C"]
                if a.size and (a.min() < 0 or a.max() >= num_classes):
                    raise PayloadError(f"'{name}' has class ids outside [0, {num_classes})")
                if len(np.unique(a)) != a.size:
                    raise PayloadError(f"'{name}' has repeated class ids")
        if self.check is not None:
            self.check(arrays, bound)
        return bound

    def check_names(self, names_given: Iterable[str]) -> None:
        """Raises PayloadError unless ``names_given`` are exactly the schema's array names (or none,
        for an optional payload); cheap, so it runs before any array is decoded.
        """
        given = list(names_given)
        if self.optional and not given:
            return
        present = set(given)
        missing = [k for k in self.arrays if k not in present]
        extra = [k for k in given if k not in self.arrays]
        if missing or extra or len(given) != len(self.arrays):
            raise PayloadError(
                f"payload keys: {len(given)} arrays, missing {names(missing)}, unexpected {names(extra)}; "
                f"expected {names(self.arrays)}"
            )

    def nbytes(self, dims: Mapping[str, int]) -> int:
        """Tensor bytes of a payload of this schema with its symbols at ``dims`` (numel x itemsize,
        as the rows' ``bytes_up`` and ``bytes_down`` count them).

        Raises:
            KeyError: a symbol of the schema that ``dims`` lacks.
        """
        return sum(
            math.prod(dims[d] if isinstance(d, str) else d for d in spec.shape) * np.dtype(spec.dtype).itemsize
            for spec in self.arrays.values()
        )

    def to_record(self, arrays: Mapping[str, np.ndarray]) -> RecordDict:
        """Records for a message carrying ``arrays`` (none when the schema is empty).

        Raises:
            PayloadError: if ``arrays`` does not have exactly the schema's keys and dtypes
                (senders are checked too: a method cannot leak an undeclared array).
        """
        if set(arrays) != set(self.arrays) and not (self.optional and not arrays):
            raise PayloadError(f"sending keys {sorted(arrays)}, schema declares {sorted(self.arrays)}")
        for name, a in arrays.items():
            if a.dtype != np.dtype(self.arrays[name].dtype):
                raise PayloadError(f"sending '{name}' as {a.dtype}, schema declares {self.arrays[name].dtype}")
        if not arrays:
            return RecordDict()
        return RecordDict({PAYLOAD: array_record(arrays)})


#: message type -> (server->client schema, client->server schema)
Schemas = dict[str, tuple[PayloadSchema, PayloadSchema]]
#: no arrays at all
NO_PAYLOAD = PayloadSchema()
#: the schemas every method has: the handshake's query and the evaluation carry no arrays unless a method says so
BASE_SCHEMAS: Schemas = {QUERY: (NO_PAYLOAD, NO_PAYLOAD), EVALUATE_MESSAGE: (NO_PAYLOAD, NO_PAYLOAD)}
#: the schemas of a method that exchanges no arrays at all (Local, and the bare base classes)
NO_PAYLOAD_SCHEMAS: Schemas = {**BASE_SCHEMAS, TRAIN: (NO_PAYLOAD, NO_PAYLOAD)}


def clip_outlier_rows(schema: PayloadSchema, uploads: list[dict[str, np.ndarray]]) -> int:
    """Bound the rows of one outlying upload by the round's other uploads, in place (docs/deployment.md:
    what a faulty or hostile client cannot do).

    For every array of ``schema`` with a ``row_norm_factor`` f: each upload votes once with
    the median L2 norm of its rows (last axis), and the reference r is the second-largest
    vote, so a single client cannot raise it. A row longer than f * r is scaled to length
    f * r: its direction is kept, its weight in the server step bounded by f times that of
    the largest other upload. With fewer than 3 uploads nothing tells the outlier apart, so
    only the schema's ``max_abs`` applies.

    Why not the median: representation norms of heterogeneous extractors differ by orders of
    magnitude in honest runs (median row norm 0.45 for GoogLeNet, 135 for ResNet-34 in one
    htfe8 round), while a row stays within 21x of the second-largest vote in every honest run
    measured (FedGH, FedProto, FD, FedTGP, FedRE on hetero-cnn5, htcnn8, htfe8, htfe9, fedre10,
    3-10 clients), so f = :data:`ROW_NORM_FACTOR` = 100 changes no honest result there. Two
    colluding outliers are not bounded by this.

    Args:
        schema: the schema the uploads were validated against.
        uploads: name -> ndarray per valid upload; arrays are replaced, not written into.

    Returns:
        The number of rows scaled down.
    """
    clipped = 0
    for name, spec in schema.arrays.items():
        present = [u for u in uploads if name in u and u[name].size]
        if spec.row_norm_factor is None or len(present) < 3:
            continue
        norms = [np.linalg.norm(u[name].astype(np.float64).reshape(-1, u[name].shape[-1]), axis=1) for u in present]
        bound = spec.row_norm_factor * sorted((float(np.median(n)) for n in norms), reverse=True)[1]
        if bound <= 0:  # the other uploads' rows are all zero: no scale to compare with
            continue
        for upload, n in zip(present, norms):
            over = n > bound
            if over.any():
                rows = upload[name].reshape(-1, upload[name].shape[-1]).astype(np.float64)
                rows[over] *= (bound / n[over])[:, None]
                upload[name] = rows.reshape(upload[name].shape).astype(upload[name].dtype)
                clipped += int(over.sum())
    return clipped


def array_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord holding ``arrays`` by name, in the given order."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


#: dtype kinds a payload may carry: bool, signed and unsigned integers, floats
PAYLOAD_DTYPE_KINDS = "biuf"


def decode_array(name: str, array: Array) -> np.ndarray:
    """One received array, decoded only after its bytes were checked (nothing from the sender
    is trusted: a wrong ``Array.numpy()`` call could allocate what an npy header claims).

    Checked before decoding: Flower's numpy serialisation (``stype``), a readable npy header
    (format 1.0 or 2.0), a plain numeric dtype (:data:`PAYLOAD_DTYPE_KINDS`, no structured or
    object dtypes), the header's shape x itemsize equal to the bytes that follow it (so a
    declared shape cannot make the receiver allocate more than it received), and the Array's
    ``dtype``/``shape`` fields equal to the header's (byte counts are read from those fields).

    Raises:
        PayloadError: naming ``name`` and what is wrong.
    """
    if array.stype != "numpy.ndarray":
        raise PayloadError(f"'{name}' is serialised as {array.stype!r}, expected 'numpy.ndarray'")
    buffer = BytesIO(array.data)
    try:
        version = np.lib.format.read_magic(buffer)
        readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        if version not in readers:
            raise ValueError(f"npy format {version}")
        shape, fortran_order, dtype = readers[version](buffer)
    except (ValueError, TypeError, OSError, EOFError, SyntaxError) as exc:
        raise PayloadError(f"'{name}' is not a readable npy array: {exc}") from exc
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in PAYLOAD_DTYPE_KINDS:
        raise PayloadError(f"'{name}' has dtype {dtype}, not a plain numeric one")
    declared = math.prod(shape) * dtype.itemsize
    if declared != len(array.data) - buffer.tell():
        raise PayloadError(
            f"'{name}' declares shape {shape} ({declared} bytes) but carries {len(array.data) - buffer.tell()} bytes"
        )
    if tuple(array.shape) != tuple(shape) or array.dtype != str(dtype):
        raise PayloadError(f"'{name}' is labelled {array.dtype} {tuple(array.shape)} but holds {dtype} {shape}")
    return (
        np.frombuffer(array.data, dtype=dtype, offset=buffer.tell())
        .reshape(shape, order="F" if fortran_order else "C")
        .copy()
    )


def read_payload(content: RecordDict, schema: PayloadSchema) -> dict[str, np.ndarray]:
    """The payload arrays of a message (empty when it carries none), each through :func:`decode_array`.

    The array names are checked against ``schema`` first (:meth:`PayloadSchema.check_names`), so
    a message with unexpected arrays is refused before any of them is decoded; the decoded arrays
    still need ``schema.validate``.

    Raises:
        PayloadError: if the message carries an ArrayRecord other than the payload one, array
            names other than the schema's, or an array that fails :func:`decode_array`.
    """
    records = list(content.array_records)
    if [r for r in records if r != PAYLOAD]:
        raise PayloadError(f"unexpected array records {names(r for r in records if r != PAYLOAD)}")
    record = content.array_records[PAYLOAD] if PAYLOAD in records else {}
    schema.check_names(record.keys())
    return {k: decode_array(k, v) for k, v in record.items()}


def tensor_bytes(content: RecordDict) -> int:
    """Payload bytes of a message: sum of numel x itemsize over all its arrays."""
    return sum(
        int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
        for record in content.array_records.values()
        for a in record.values()
    )


@dataclass
class ClientReply:
    """A validated reply: who sent it, its payload arrays, its scalar metrics, from a client on a GPU
    the device's name, and from a simulation's actor the id of its Ray node."""

    node_id: int
    partition_id: int
    arrays: dict[str, np.ndarray]
    metrics: dict[str, Any]
    device: str | None = None
    ray_node: str | None = None
