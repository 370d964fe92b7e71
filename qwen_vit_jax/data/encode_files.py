"""The loop of `qwen-vit-jax encode`: inputs prepared by the worker pipeline (pipeline.py) in input
order, packed into calls by patch budget, encoded, and written to an embeddings file (sinks.py) with
progress (a callback), periodic saves, resuming and skipping unreadable inputs. The CLI
(tools/encode.py) parses its flags, calls `encode_files` and shows its `Update`s.

Content-hash dedupe: every item carries the sha256 of its bytes. An input whose bytes this run has
met before is not encoded: its row copies the first one's (the same bytes, preprocessing, checkpoint
and dtype give the same embedding). With a cache (cache.py's `ContentCache`, keyed by the bytes and
the item's kind and settings) an input some earlier run encoded is read back, and every input this
run encodes is added to it. Which inputs share a call is runtime/batching.py's `Grouping`, and its
`Packer` makes the calls.

A long video goes through in pieces, frame groups of at most the patch budget decoded by a worker as
they are encoded (pipeline.py): a run holds a few groups of frames, never a video, and its progress
counts the frames of the video being read. The rows a format holds until the end (.safetensors and
.npz: every row; .parquet: a row group) are the only memory that grows with the run, each held once:
a video's row is filled as its groups are encoded, and written from where it is held (sinks.py;
pyarrow's parquet writer alone takes several times a row group's bytes while writing it).

Nothing here is half-written: OUT is only ever replaced whole, with the inputs finished so far,
whether the run ends, is interrupted (Ctrl-C, SIGTERM) or loses a worker process. A full disk or a
crash drops what is being written (the parquet part in progress) and keeps what was saved before
(OUT, the completed parts): a full disk is an EncodeError saying what it needed and how to go on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import numpy as np

from qwen_vit_jax.data.inputs import EncodeError
from qwen_vit_jax.data.pipeline import Item, PieceError, WorkerError, load
from qwen_vit_jax.data.sinks import SAVE_EVERY_S, open_sink
from qwen_vit_jax.data.stream import count
from qwen_vit_jax.errors import Internal
from qwen_vit_jax.files import DiskFull, disk_full
from qwen_vit_jax.preprocess.config import PreprocessConfig, Preprocessing, preprocessing_from
from qwen_vit_jax.runtime.batching import Grouping, Packer


@dataclasses.dataclass(frozen=True)
class Update:
    """What `encode_files` tells its `progress` callback: `done` of `total` inputs are done (encoded,
    copied, or read from the cache; an input that failed is never shown as done, and leaves `total`
    when skipped); `frames`, while a video is read: (frames handed to the device, frames sampled);
    `note`, when not None, is a line to show (a video read at every frame or capped at max_frames,
    an input slow to prepare, a skipped input); `finished` on the last update (after it, only notes
    of skipped inputs)."""

    done: int
    total: int
    note: str | None = None
    finished: bool = False
    frames: tuple[int, int] | None = None


@dataclasses.dataclass
class Summary:
    """What a run of `encode_files` did."""

    names: list[str]  # the inputs this run added, in order
    tokens: int
    failed: list[tuple[str, str]]  # (key, reason) of the inputs skipped (keep_going)
    seconds: float
    seconds_waiting: float  # of those, spent waiting for the workers (the device idle)
    encoded: int = 0  # inputs the tower ran on
    reused: int = 0  # inputs whose bytes appeared earlier in this run
    cached: int = 0  # inputs read from the cache


def readable(items: Iterator[Item], failed: list, keep_going: bool) -> Iterator[Item]:
    """The readable items. An unreadable one is recorded in `failed` as (name, reason) and skipped
    with `keep_going`, else ends the items there."""
    for item in items:
        if item.error is None:
            yield item
            continue
        failed.append((item.name, item.error))
        if not keep_going:
            return


@dataclasses.dataclass(eq=False)
class _Row:
    """An input on its way to the sink: `how` its row is made ("encode": from its pieces' tokens,
    `take`n into `tokens`; "copy" of an earlier input of this run, `what` its _Row; "row" of a row
    written before, `what` the sink's reference; "cached": `what` the cache's row). `open` while its
    pieces are read; `void` when it failed after some were."""

    item: Item
    how: str
    what: object = None
    tokens: np.ndarray | None = None  # [n, D]: the row, filled piece by piece
    filled: int = 0  # its tokens so far
    taken: int = 0  # its pieces whose tokens came back
    pieces: int = 0
    open: bool = False
    void: bool = False
    row: tuple | None = None  # (grid [3], tokens [n, D], timestamps [t]) once known

    @property
    def ready(self) -> bool:
        return not self.open and self.taken == self.pieces

    def take(self, tokens: np.ndarray, n: int) -> None:
        """A piece's tokens [k, D], in order, of a row of `n` tokens. A row of one piece (an image) is
        its tokens as they are; a row in pieces (a long video's frame groups) is written into one
        array as they come: joined at the end, the row would be held twice."""
        if self.tokens is None:
            self.tokens = tokens if len(tokens) == n else np.empty((n, *tokens.shape[1:]), tokens.dtype)
        if self.tokens is not tokens:
            self.tokens[self.filled : self.filled + len(tokens)] = tokens
        self.filled += len(tokens)
        self.taken += 1


class _Rows:
    """Items in input order until their rows are known: encoded piece by piece (a video's frame
    groups as they are read, `Packer` putting consecutive pieces into calls), copied from an
    earlier input with the same bytes (of this run, or a row of the file being resumed), or read
    from the cache; written to the sink in input order as soon as they are whole.

    Calls end only where the next piece does not join them (`Grouping.joins`: the patch budget,
    another pixel form) or the inputs end, never at a save: a run resumed after an interrupt packs
    the rest as a clean run does, and every row gets the bits it would have had. `cache`: a
    data.cache.ContentCache, its entries keyed by each item's kind under `preprocessing`."""

    def __init__(self, enc, sink, cache, budget: int, preprocessing: Preprocessing):
        self.enc, self.sink, self.cache = enc, sink, cache
        self.packer = Packer(enc.encode, Grouping(budget), enc.cfg.merge_unit)
        self.keys = {k: cache.key(k, preprocessing) for k in ("image", "video")} if cache else {}
        self.pending: list[_Row] = []
        # sha256 -> ("copy", the _Row of this run being encoded) | ("row", its row in the sink)
        self.first: dict[str, tuple[str, object]] = {d: ("row", ref) for d, ref in sink.seen.items()}
        self.names: list[str] = []
        self.void: list[tuple[str, str]] = []  # (name, reason) of inputs that failed after some pieces
        self.tokens = self.encoded = self.reused = self.cached = 0

    def add(self, item: Item, frames: Callable[[int], None] = lambda done: None) -> None:
        """Take an item: its pieces go to the packer as they are read (`frames(done)` after each one
        of a video streamed in frame groups); PieceError when a streamed video fails (its row is
        void, the run goes on)."""
        src = self.first.get(item.digest) if item.digest else None
        hit = None
        if src is None and self.cache is not None and item.digest:
            hit = self.cache.get(self.keys[item.kind], item.digest)
        if src is not None or hit is not None:
            if hasattr(item.pieces, "close"):
                item.pieces.close()  # a streamed video's pieces are never read
            self.reused += src is not None
            self.cached += hit is not None
            self.pending.append(_Row(item, *src) if src is not None else _Row(item, "cached", hit))
            self.write()
            return
        row = _Row(item, "encode", open=True)
        self.pending.append(row)
        if item.digest:
            self.first[item.digest] = ("copy", row)
        try:
            T = item.config.temporal_patch_size
            streamed = item.is_video and not isinstance(item.pieces, tuple)  # decoded as it is read
            if streamed:
                frames(0)  # its frames' clock starts
            for patches, grid, piece in item.patch_pieces():
                row.pieces += 1
                self.encoded_parts(self.packer.add(row, patches, grid))
                if streamed:
                    frames(min(piece.first_frame + int(grid[0, 0]) * T, item.frames))
        except BaseException:  # a video failed halfway, an interrupt, a dead worker: never written
            row.void = True
            raise
        finally:
            row.open = False
        self.write()

    def encoded_parts(self, done: list) -> None:
        for row, tokens in done:
            row.take(tokens, int(np.prod(row.item.grid[0])) // self.packer.merge_unit)

    def flush(self) -> None:
        """Encode what waits in the packer, then write every pending row."""
        self.encoded_parts(self.packer.flush())
        self.write()

    def write(self) -> None:
        """Write the pending rows that are whole, in input order (up to the first that is not)."""
        while self.pending and self._whole(self.pending[0]):
            r = self.pending.pop(0)
            if r.void:
                continue
            item = r.item
            if r.how == "encode":
                if r.filled != len(r.tokens):  # the pieces' rows are the grid's: never, unless a bug
                    raise Internal(f"{item.name}: {r.filled} tokens encoded of the {len(r.tokens)} its grid makes")
                r.row, r.tokens = (item.grid[0], r.tokens, item.timestamps), None
                self.encoded += 1
                if self.cache is not None and item.digest:
                    self.cache.put(self.keys[item.kind], item.digest, *r.row)
            elif r.how == "cached":
                r.row = r.what
            else:  # a copy: of an item of this run ("copy"), or of a row already written ("row")
                grid, tokens, _ = r.what.row if r.how == "copy" else self.sink.fetch(r.what)
                r.row = (grid, tokens, item.timestamps)
            ref = self.sink.add(item.name, r.row, item.digest)
            if r.how == "encode" and item.digest:
                self.first[item.digest] = ("row", ref)
            self.names.append(item.name)
            self.tokens += len(r.row[1])

    def _whole(self, r: _Row) -> bool:
        """Whether a pending row can be written (or dropped) now."""
        if r.how == "copy":
            if r.what.void:  # the same bytes failed: so does this one
                r.void = True
                self.void.append((r.item.name, "the same bytes as an input that failed"))
                return True
            return r.what.row is not None
        return r.ready


def encode_files(
    enc,
    inputs: list,
    target,
    meta: dict,
    *,
    preprocessing: Preprocessing | None = None,
    batch_patches: int | None = None,
    keep_going: bool = False,
    resume: bool = False,
    save_empty: bool = False,
    workers: int = 0,
    fast_decode: bool = False,
    cache=None,
    sink=None,
    progress: Callable[[Update], None] | None = None,
    save_every: float = SAVE_EVERY_S,
    image_cfg: PreprocessConfig | None = None,
    video_cfg: PreprocessConfig | None = None,
) -> Summary:
    """Encode `inputs` (paths or sources.Records; consecutive inputs packed into calls of at most
    `batch_patches` patches, default enc.max_batch_patches) and write them after what `target` holds
    when resuming.

    Saves every `save_every` seconds (0: after every input), on Ctrl-C / SIGTERM (then
    KeyboardInterrupt, saying what was written), when a worker process dies and before reporting an
    unreadable input (without keep_going): an EncodeError then says how to continue. A full disk is
    an EncodeError naming OUT, the space needed and free, and what was saved before it. With
    keep_going unreadable inputs are skipped, each named in a note. When nothing could be encoded,
    nothing is written unless `save_empty` (a process of a
    sharded run writes its shard all the same: the set must be complete). `sink` (from
    sinks.open_sink) when the caller opened it to list what is done. `preprocessing`: the settings
    (default enc.preprocessing; `image_cfg=` / `video_cfg=` still work, deprecated). `progress`:
    called with an `Update` as inputs are done and for every note; nothing is printed here.

    A video goes through in pieces (frame groups of at most `batch_patches` patches, decoded as they
    are encoded): its memory follows a piece, and `progress` hears of its frames as they go.

    Returns:
      Summary: keys added, their token count, the skipped inputs, wall seconds, seconds waited, and
      how many inputs were encoded, copied from an identical one, or read from the cache.
    """
    prep = preprocessing_from(
        preprocessing if preprocessing is not None or image_cfg or video_cfg else enc.preprocessing,
        enc.cfg.variant,
        {"image_cfg": image_cfg, "video_cfg": video_cfg},
        "encode_files",
    )
    tell = progress if progress is not None else (lambda update: None)
    failed: list[tuple[str, str]] = []
    sink = sink if sink is not None else open_sink(target, meta, enc.cfg.out_dim, resume)
    rows = _Rows(enc, sink, cache, batch_patches or enc.max_batch_patches, prep)

    def written() -> str:
        return f"{count(len(rows.names), 'new input')} written to {target}; the same command with resume=True continues"

    def full(e: Exception) -> EncodeError:  # after sink.abandon(): nothing half-written is left
        if isinstance(e, DiskFull):
            need = sink.to_finish(total)  # more useful than the one write that failed
            what = str(e if need is None else DiskFull(e.path, need, e.what, "finishing the run"))
        else:
            what = f"no space left on device{' for the cache' * bool(cache)} ({e})"
        return EncodeError(f"{what}; {sink.kept()}; free space, then the same command with resume=True continues")

    def save() -> None:  # OUT with what is done; a full disk keeps what was saved before
        try:
            sink.finish()
        except DiskFull as e:
            sink.abandon()
            raise full(e) from None

    t0 = last_save = time.perf_counter()
    total = len(inputs)
    budget = batch_patches or enc.max_batch_patches
    loader = load(inputs, preprocessing=prep, workers=workers, fast_decode=fast_decode, piece_patches=budget)
    every_frame = not (prep.video.do_sample_frames and (prep.video.fps or prep.video.num_frames))

    def left() -> int:  # inputs still counted: a failed one leaves the count
        return total - len(failed)

    tell(Update(0, total))
    try:
        for item in readable(iter(loader), failed, keep_going):
            if item.is_video and every_frame:  # HF's Qwen2-VL processor does the same; long clips cost a lot
                note = (
                    f"note: videos use every frame up to max_frames={prep.video.max_frames} (the checkpoint's "
                    "video config samples none, as HF's "
                    "Qwen2VLVideoProcessor); fps=2 is what Qwen's own tools use"
                )
                tell(Update(len(rows.names), left(), note))
                every_frame = False
            if item.note:
                streamed = item.is_video and int(np.prod(item.grid)) > budget
                when = "" if streamed else f", prepared in {item.seconds:.1f} s"
                tell(Update(len(rows.names), left(), f"{item.note}{when}"))
            if item.capped:
                tell(Update(len(rows.names), left(), f"note: {item.name}: {item.capped} (max_frames=N raises it)"))

            def frames(done: int, item=item) -> None:
                tell(Update(len(rows.names), left(), frames=(done, item.frames)))

            try:
                rows.add(item, frames)
            except PieceError as e:
                failed.append((item.name, e.item.error))
                if not keep_going:
                    break
            failed += [v for v in rows.void if v not in failed]
            tell(Update(len(rows.names), left()))  # a failed input is never shown as done
            if time.perf_counter() - last_save >= save_every:  # a crash then costs at most this
                sink.checkpoint()  # what is written so far; the call being filled goes on
                last_save = time.perf_counter()
        rows.flush()
        failed += [v for v in rows.void if v not in failed]
        tell(Update(len(rows.names), total - (len(failed) if keep_going else 0)))  # skipped: out of the count
    except KeyboardInterrupt:
        loader.close()  # the workers go first: nothing keeps running while the output is saved
        if rows.names:
            save()
            raise KeyboardInterrupt(written()) from None
        sink.abandon()
        raise KeyboardInterrupt("nothing written") from None
    except WorkerError as e:
        loader.close()
        if rows.names:
            save()
        else:
            sink.abandon()
        raise EncodeError(f"{e}; " + (written() if rows.names else "nothing written")) from None
    except Exception as e:  # a full disk, or a crash: drop what is half-written, keep what was saved
        loader.close()
        sink.abandon()
        if disk_full(e):
            raise full(e) from None
        raise
    finally:
        loader.close()
        tell(Update(len(rows.names), total - len(failed), finished=True))
    seconds = time.perf_counter() - t0
    result = Summary(
        rows.names, rows.tokens, failed, seconds, loader.seconds_waiting, rows.encoded, rows.reused, rows.cached
    )
    if failed and not keep_going:  # the inputs before it are encoded: keep them
        (path, reason), held = failed[0], ""
        if rows.names:
            save()
            held = f"; the {count(len(rows.names), 'input')} before it written to {target}, resume=True continues"
        else:
            sink.abandon()
        raise EncodeError(
            f"cannot read {path}: {reason}{held or '; nothing written'} (keep_going=True skips unreadable inputs)",
            limit="keep_going",
        )
    for path, reason in failed:
        tell(Update(len(rows.names), total - len(failed), f"warning: skipped {path}: {reason}", finished=True))
    if not rows.names and inputs and not save_empty:
        sink.abandon()
        raise EncodeError(f"none of the {len(inputs)} inputs could be read; nothing written")
    save()
    return result
