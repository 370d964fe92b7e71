"""`qwen-vit-jax encode ... --vllm-store STORE`: the encode loop's rows also go into vLLM's
encoder-cache store (store.py's `StoreWriter`, the service's writer too).

`StoreSink` stands where the encode loop's sink stands (data/sinks.py's interface: add, fetch,
checkpoint, finish, abandon, to_finish, kept, done, seen): every row is written into the store as
it is added (whole, atomically: nothing to finish), then handed to the -o file's sink when there is
one. For a deepstack tower (Qwen3-VL) the loop encodes through `with_deepstack(enc)`, whose rows
carry the deepstack features after the tokens (vLLM's layout): the store gets them whole, the -o
file its usual [tokens, out_dim] columns.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qwen_vit_jax.errors import BadInput
from qwen_vit_jax.vllm.ids import sha256_id
from qwen_vit_jax.vllm.store import StoreWriter, read_store


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A row this run added: the -o sink's own reference (None without -o), its store entry."""

    inner: object
    ident: str
    grid: np.ndarray
    timestamps: np.ndarray


class StoreSink:
    """Rows -> the store (and `inner`, the -o file's sink, when given).

    writer: the StoreWriter. out_dim: the tower's token width (what `inner` holds). records: the
    run's inputs (sources.Records) by key, when the identifier needs an item's bytes again (vLLM's
    own image identifiers): re-read, and checked against the sha256 the loop computed.
    """

    def __init__(self, writer: StoreWriter, inner=None, *, out_dim: int, records=None):
        self.writer, self.inner, self.out_dim = writer, inner, out_dim
        self.records: dict[str, list] = {}
        for r in records or ():
            self.records.setdefault(r.key, []).append(r)
        self.written = 0
        self._reader = None

    # what the -o file holds (nothing without one); its rows lack deepstack features, so a deepstack
    # tower encodes a resumed file's duplicates again instead of copying them
    done = property(lambda self: self.inner.done if self.inner is not None else [])
    seen = property(lambda self: self.inner.seen if self.inner is not None and not self.writer.needs_deepstack else {})

    def add(self, key: str, row, digest: str | None) -> _Ref:
        grid, emb, ts = row
        kind, data = self._source(key, digest)
        ident = self.writer.put(kind, data, digest, emb, None, grid, ts)
        self.written += 1
        inner = self.inner.add(key, (grid, emb[:, : self.out_dim], ts), digest) if self.inner is not None else None
        return _Ref(inner, ident, np.asarray(grid), np.asarray(ts))

    def fetch(self, ref):
        if isinstance(ref, _Ref):  # this run's row, whole (deepstack included), from the store
            emb, _ = read_store(self.writer.store, ref.ident)
            return ref.grid, emb.astype(np.float32), ref.timestamps
        return self.inner.fetch(ref)  # a row of the file being resumed (`seen`)

    def checkpoint(self) -> None:
        if self.inner is not None:
            self.inner.checkpoint()

    def finish(self) -> None:
        if self.inner is not None:
            self.inner.finish()

    def abandon(self) -> None:
        if self.inner is not None:
            self.inner.abandon()

    def to_finish(self, total: int) -> int | None:
        return self.inner.to_finish(total) if self.inner is not None else None

    def kept(self) -> str:
        held = f"{self.writer.store} holds the {self.written:,} item(s) written so far"
        return f"{self.inner.kept()}; {held}" if self.inner is not None else held

    def _source(self, key: str, digest: str | None) -> tuple[str, bytes | None]:
        """(kind, the item's bytes when the identifier needs them)."""
        records = self.records.get(key, [])
        kind = "video" if records and records[0].is_video else "image"
        if self.writer.ids.rule == "sha256" or kind == "video":
            return kind, None
        for r in records:  # several with --allow-duplicate-keys: the one with these bytes
            data = self._read(r)
            if digest is None or sha256_id(data) == digest:
                return kind, data
        raise BadInput(f"{key}: its bytes changed while it was encoded; vLLM's identifier of it cannot be computed")

    def _read(self, record) -> bytes:
        if self._reader is None:
            from qwen_vit_jax.data.sources import RecordReader

            self._reader = RecordReader()
        data = self._reader.read(record)
        if isinstance(data, str):  # a file record: its path
            with open(data, "rb") as f:
                return f.read()
        if not isinstance(data, (bytes, bytearray)):
            raise BadInput(f"{record.key}: a decoded image has no bytes; vLLM's identifier hashes an image's bytes")
        return bytes(data)


class with_deepstack:  # noqa: N801 (a wrapper named for what it adds)
    """An encoder whose `encode` rows carry the deepstack features after the tokens (vLLM's layout,
    store.vllm_layout): what the encode loop runs for the store of a deepstack tower. Everything
    else is the wrapped encoder's."""

    def __init__(self, enc):
        self.encoder = enc

    def encode(self, pixel_values, grid_thw, **kw):
        from qwen_vit_jax.vllm.store import vllm_layout

        return vllm_layout(*self.encoder.encode(pixel_values, grid_thw, return_deepstack=True, **kw))

    def __getattr__(self, name):
        return getattr(self.encoder, name)
