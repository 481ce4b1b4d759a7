"""Incremental vector index: hidden states of the context -> their positions. Pure compute.

Rows are centred (the centre is estimated from the first rows added, the prompt, then kept
fixed) and unit-normalised; similarity is the inner product (cosine). Vectors are stored as
float16, in a buffer grown geometrically.

Two searches:

- ``search_next`` (what retrieval uses by default): the most similar among the positions the
  known next token follows. It reads only those rows, a few of the context's, in one
  compiled call that also stores the rows waiting to be stored (numpy without a compiler);
- ``search``: the most similar of all rows (the original SRSD search: the caller filters
  the hits). Its backend returns the same hits on the same data:

  - ``numpy``: the buffer itself;
  - ``faiss-cpu``: ``IndexScalarQuantizer`` (fp16 codes, exact inner-product search);
  - ``faiss-gpu``: ``GpuIndexFlatIP`` with float16 storage and capped scratch memory, only
    when the faiss build has GPU support *and* sees a GPU.

  A faiss index is filled from the buffer when a search needs it (not at every step).
  ``auto`` picks faiss-gpu, else faiss-cpu, else numpy.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

from .kernels import array_address, normalise_kernel, retrieve_kernel, stage_kernel

_GPU_TEMP_MEMORY = 64 << 20  # faiss reserves up to 1.5 GiB of scratch by default


def _faiss():
    try:
        import faiss  # noqa: PLC0415

        return faiss
    except ImportError:
        return None


def gpu_available() -> bool:
    faiss = _faiss()
    if faiss is None or not hasattr(faiss, "StandardGpuResources"):
        return False
    try:
        return faiss.get_num_gpus() > 0
    except Exception:  # a GPU build on a machine without a driver
        return False


def choose_backend(requested: str = "auto") -> str:
    accepted = ("auto", "faiss-gpu", "faiss-cpu", "numpy")
    if requested not in accepted:
        raise ValueError(f"unknown index backend {requested!r}: accepted are {', '.join(accepted)}")
    if requested == "faiss-gpu" and not gpu_available():
        raise ValueError("index backend 'faiss-gpu' needs faiss built with GPU support and a "
                         "visible GPU; use 'faiss-cpu', 'numpy' or 'auto'")
    if requested == "faiss-cpu" and _faiss() is None:
        raise ValueError("index backend 'faiss-cpu' needs the faiss-cpu package; "
                         "use 'numpy' or 'auto'")
    if requested != "auto":
        return requested
    if gpu_available():
        return "faiss-gpu"
    return "faiss-cpu" if _faiss() is not None else "numpy"


@dataclass(frozen=True)
class Hits:
    positions: np.ndarray  # int64 [k], best first
    scores: np.ndarray  # float32 [k]


@dataclass(frozen=True)
class NextHits:
    """`VectorIndex.search_next`'s hits, best first, as Python lists."""

    positions: list[int]
    scores: list[float]
    agree: list[int]  # tokens up to the root the context before each hit agrees with
    # per hit, the context's tokens after the root it found (at most the `depth` asked for;
    # None where none were asked for)
    follow: list[list[int]] | None = None


MAX_PENDING = 64  # rows kept unstored at most (a prompt's chunk is stored at once)


class VectorIndex:
    """Hidden-state rows -> context positions, bounded by `capacity` (the context size)."""

    def __init__(self, dim: int, capacity: int, backend: str = "auto") -> None:
        if dim <= 0 or capacity <= 0:
            raise ValueError(f"index needs dim > 0 and capacity > 0, got {dim}, {capacity}")
        self.dim = dim
        self.capacity = capacity
        self.backend = choose_backend(backend)
        self.center: np.ndarray | None = None
        self._pos = np.zeros(min(capacity, 1024), dtype=np.int64)
        self._row_of = np.full(len(self._pos), -1, dtype=np.int32)  # position -> row
        self._n = 0
        # rows added but not stored yet (raw float32, copied here one after the other): one
        # row per decode step is stored in a batch when a search needs them, not one faiss
        # call per step, and normalised in one call, not one per row
        self._stage = np.empty((MAX_PENDING, dim), dtype=np.float32)
        self._staged = 0
        self._stored = 0
        self._buf = np.zeros((len(self._pos), dim), dtype=np.float16)
        self._scratch: np.ndarray | None = None  # the compiled kernel's rows of a step
        self._query = np.empty(dim, np.float32)  # search_next's normalised query
        self._attach()

    # what refers to this index's own buffers by address, or to compiled code: made anew for
    # a copy (copy.deepcopy, pickle), which gets buffers of its own
    _ATTACHED = ("_stage_at", "_stage_rows", "_kernel", "_retrieve", "_stage_path", "_address",
                 "_next_out",
                 "_faiss_index", "_faiss_n", "_gpu_res", "_result_arrays")

    def _attach(self) -> None:
        # a plain step's row is written into the stage by the compiled step itself
        # (`stage_address`, `add_staged`): the stage's address and its rows as views, taken
        # once
        self._stage_at = int(self._stage.ctypes.data)
        self._stage_rows = list(self._stage)
        self._kernel = normalise_kernel()  # None: numpy normalises
        self._retrieve = retrieve_kernel()  # None: search_next in numpy
        self._stage_path = stage_kernel()  # None: add_path through add
        self._address = array_address()  # an array's data address, cheaply where it can
        self._next_out: tuple | None = None  # see _next_addresses
        self._faiss_index = None  # made, and filled from the buffer, when `search` needs it
        self._faiss_n = 0  # rows of the buffer in it
        self._gpu_res = None
        self._result_arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in self._ATTACHED:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._attach()

    # -- construction helpers -------------------------------------------------------------
    def _new_faiss_index(self):
        faiss = _faiss()
        if self.backend == "faiss-gpu":
            if self._gpu_res is None:
                self._gpu_res = faiss.StandardGpuResources()
                self._gpu_res.setTempMemory(_GPU_TEMP_MEMORY)
            cfg = faiss.GpuIndexFlatConfig()
            cfg.useFloat16 = True
            return faiss.GpuIndexFlatIP(self._gpu_res, self.dim, cfg)
        # one query over a few thousand rows gains nothing from threads, and faiss's OpenMP
        # workers keep spinning after a search, taking the cores llama.cpp decodes on
        faiss.omp_set_num_threads(1)
        return faiss.IndexScalarQuantizer(self.dim, faiss.ScalarQuantizer.QT_fp16,
                                          faiss.METRIC_INNER_PRODUCT)

    def __len__(self) -> int:
        return self._n

    def _normalise(self, rows: np.ndarray) -> np.ndarray:
        """Centred, unit-length float32 rows rounded through float16 (what is stored), in
        a new array."""
        x = np.asarray(rows, dtype=np.float32).reshape(-1, self.dim)
        self._centre_on(x)
        x = x - self.center
        x /= np.maximum(np.sqrt(np.einsum("ij,ij->i", x, x)), np.float32(1e-6))[:, None]
        return x.astype(np.float16).astype(np.float32)

    def _normalise_parts(self, parts: list[np.ndarray]) -> np.ndarray:
        """`_normalise` of the rows of several blocks one after the other: by the compiled
        kernel where there is one, into a reused array for a decode step's few rows."""
        dim = self.dim
        if self._kernel is None:
            return self._normalise(np.concatenate([np.reshape(p, (-1, dim)) for p in parts])
                                   if len(parts) > 1 else parts[0])
        if self.center is None:
            self._centre_on(np.reshape(parts[0], (-1, dim)))
        n = sum(p.size for p in parts) // dim
        if n <= MAX_PENDING + 1:
            if self._scratch is None:
                self._scratch = np.empty((MAX_PENDING + 1, dim), np.float32)
            out = self._scratch[:n]
        else:
            out = np.empty((n, dim), np.float32)
        self._kernel(parts, self.center, out)
        return out

    def _centre_on(self, x: np.ndarray) -> None:
        """The centre is the mean of the first rows ever added (zero for a single row), as
        contiguous float32 (what the compiled kernel reads)."""
        if self.center is None:
            self.center = (np.ascontiguousarray(x.mean(axis=0), dtype=np.float32)
                           if len(x) > 1 else np.zeros(self.dim, np.float32))
            self._next_out = None

    def _flush(self, query: np.ndarray | None = None) -> np.ndarray | None:
        """Store the pending rows; with a `query` (a raw row), normalise it along with them
        (one pass for both) and return it normalised ([1, dim])."""
        staged = self._stage[: self._staged]
        if not self._staged and query is None:
            return None
        x = self._normalise_parts([staged] if query is None else [staged, query])
        q = None
        if query is not None:
            x, q = x[:-1], x[-1:]
        if not len(x):
            return q
        self._staged = 0
        self._store(x)
        return q

    def _store(self, x: np.ndarray) -> None:
        """Store normalised rows after those stored already."""
        self._buf[self._stored: self._stored + len(x)] = x
        self._stored += len(x)

    def _faiss_synced(self):
        """The faiss index, with every stored row in it."""
        if self._faiss_index is None:
            self._faiss_index, self._faiss_n = self._new_faiss_index(), 0
        if self._faiss_n < self._stored:
            x = np.ascontiguousarray(self._buf[self._faiss_n: self._stored], dtype=np.float32)
            if self.backend == "faiss-cpu":  # the SWIG call itself (see search)
                self._faiss_index.add_c(len(x), _faiss().swig_ptr(x))
            else:
                self._faiss_index.add(x)
            self._faiss_n = self._stored
        return self._faiss_index

    def _grow(self, need: int) -> None:
        if need <= len(self._pos):
            return
        size = min(max(need, 2 * len(self._pos)), self.capacity)
        pos = np.zeros(size, dtype=np.int64)
        pos[: self._n] = self._pos[: self._n]
        self._pos = pos
        buf = np.zeros((size, self.dim), dtype=np.float16)
        buf[: self._stored] = self._buf[: self._stored]
        self._buf = buf
        self._next_out = None

    def _cover(self, position: int) -> None:
        """Make the position -> row map reach `position` (new entries: no row)."""
        if position >= len(self._row_of):
            row_of = np.full(max(position + 1, 2 * len(self._row_of)), -1, np.int32)
            row_of[: len(self._row_of)] = self._row_of
            self._row_of = row_of
            self._next_out = None

    # -- API --------------------------------------------------------------------------------
    def add(self, rows: np.ndarray, positions: np.ndarray | list[int] | int
            ) -> np.ndarray | None:
        """Index new rows (only the new ones) for the given context positions (an int:
        consecutive positions from there). A decode step's few rows are copied to the
        rows waiting to be stored (the caller may reuse its array), and stored when a
        search needs them; a block of more (a prompt's chunk) is stored at once. The
        decode loop calls this on every step: as few numpy calls as it takes. Returns the
        last row's copy among the waiting rows (a view, as `add_staged`'s), or None where
        the rows were stored at once."""
        x = np.asarray(rows)
        if x.ndim != 2:
            x = x.reshape(-1, self.dim) if x.size % self.dim == 0 else x.reshape(1, -1)
        if x.shape[1] != self.dim:
            raise ValueError(f"index.add got rows of {x.shape[1]} values: accepted are rows "
                             f"of {self.dim}")
        k = len(x)
        if isinstance(positions, (int, np.integer)):
            start = int(positions)
        else:
            positions = np.asarray(positions, dtype=np.int64).reshape(-1)
            if k != len(positions):
                raise ValueError(f"index.add got {k} rows for {len(positions)} positions")
            start = None
        if self._n + k > self.capacity:
            raise ValueError(f"index is full: {self._n} + {k} rows > capacity "
                             f"{self.capacity} (the context size)")
        if self.center is None:
            self._centre_on(x)
        if self._n + k > len(self._pos):
            self._grow(self._n + k)
        n = self._n
        if start is None:
            self._pos[n: n + k] = positions
            if k:
                self._cover(int(positions.max()))
                self._row_of[positions] = np.arange(n, n + k, dtype=np.int32)
        elif k == 1:
            self._pos[n] = start
            if start >= len(self._row_of):
                self._cover(start)
            self._row_of[start] = n
        else:
            self._pos[n: n + k] = range(start, start + k)
            self._cover(start + k - 1)
            self._row_of[start: start + k] = range(n, n + k)
        self._n += k
        if self._staged + k > MAX_PENDING:
            self._flush()
        if k >= MAX_PENDING:
            self._store(self._normalise_parts([np.ascontiguousarray(x, dtype=np.float32)]))
            return None
        if not k:
            return None
        self._stage[self._staged: self._staged + k] = x
        self._staged += k
        return self._stage_rows[self._staged - 1]

    def add_path(self, rows: np.ndarray, path: list[int], start: int) -> np.ndarray:
        """`add` of rows[path] (a decode's rows, the nodes of an accepted path of a tree)
        for positions start, start + 1, ...; returns the last one's copy among the waiting
        rows (a view, as `add`'s). In one compiled call where there is a build and `rows`
        are contiguous float32 rows of this index (a tree pass's, a view of the capture's
        buffer), else through `add`."""
        k, fn = len(path), self._stage_path
        if self._staged + k > MAX_PENDING:
            self._flush()
        n = self._n
        if (fn is None or self.center is None or not 0 < k <= MAX_PENDING or
                n + k > len(self._pos) or start + k > len(self._row_of) or
                rows.dtype != np.float32 or rows.ndim != 2 or rows.shape[1] != self.dim or
                not rows.flags.c_contiguous or max(path) >= len(rows) or min(path) < 0):
            x = rows[:k] if path[-1] == k - 1 else rows[path]
            last = self.add(x, start)
            return x[-1].copy() if last is None else last
        if n + k > self.capacity:
            raise ValueError(f"index is full: {n} + {k} rows > capacity {self.capacity} "
                             "(the context size)")
        at, staged = array("i", path), self._staged
        address = self._address
        fn(address(rows), at.buffer_info()[0], k, self.dim, self._stage_at, staged,
           address(self._pos), n, address(self._row_of), start)
        self._n = n + k
        self._staged = staged + k
        return self._stage_rows[staged + k - 1]

    def stage_address(self, rows: int = 1) -> int:
        """The address of the float32 rows (`dim` values each, one after the other)
        `add_staged` indexes next: the caller's decode steps write up to `rows` rows there
        (1 to MAX_PENDING; the pending rows are stored first when there is no room)."""
        if not 1 <= rows <= MAX_PENDING:
            raise ValueError(f"{rows} rows to stage: accepted are 1 to {MAX_PENDING}")
        if self._staged + rows > MAX_PENDING:
            self._flush()
        return self._stage_at + 4 * self.dim * self._staged

    def add_staged(self, position: int, rows: int = 1) -> np.ndarray:
        """`add` of the `rows` rows written at `stage_address()` for context positions
        `position`, `position` + 1, ..., without a copy; returns a view of the last one
        (valid until the pending rows are stored and its place is taken by a later row)."""
        n, j = self._n, self._staged
        if n + rows > self.capacity:
            raise ValueError(f"index is full: {n} + {rows} rows > capacity {self.capacity} "
                             "(the context size)")
        if rows < 1 or j + rows > MAX_PENDING:
            raise ValueError(f"{rows} staged rows after {j}: accepted are 1 to "
                             f"{MAX_PENDING - j}")
        if self.center is None:  # (as row by row: the first row alone)
            self._centre_on(self._stage_rows[j][None])
        if n + rows > len(self._pos):
            self._grow(n + rows)
        last = position + rows - 1
        if last >= len(self._row_of):
            self._cover(last)
        if rows == 1:
            self._pos[n] = position
            self._row_of[position] = n
        else:
            self._pos[n: n + rows] = range(position, position + rows)
            self._row_of[position: position + rows] = range(n, n + rows)
        self._n = n + rows
        self._staged = j + rows
        return self._stage_rows[j + rows - 1]

    def search(self, query: np.ndarray, k: int) -> Hits:
        """The k most similar indexed positions to `query` (a raw hidden row), best first."""
        if np.size(query) != self.dim:
            raise ValueError(f"query has {np.size(query)} values: accepted is one row of "
                             f"{self.dim}")
        k = min(k, self._n)
        if k <= 0:
            return Hits(np.zeros(0, np.int64), np.zeros(0, np.float32))
        q = self._flush(query)  # the rows added since the last search, and the query
        if self.backend == "numpy":
            scores = self._buf[: self._n].astype(np.float32) @ q[0]
            top = np.argpartition(-scores, k - 1)[:k] if k < self._n else np.arange(self._n)
            top = top[np.lexsort((top, -scores[top]))]
            return Hits(self._pos[top], scores[top].astype(np.float32))
        index = self._faiss_synced()
        if self.backend == "faiss-cpu":  # the SWIG call itself: the Python wrapper
            d, i = self._results(k)  # converts and allocates on every call
            faiss = _faiss()
            index.search_c(1, faiss.swig_ptr(q), k, faiss.swig_ptr(d), faiss.swig_ptr(i),
                           None)
        else:
            d, i = index.search(q, k)
        ok = i[0] >= 0
        return Hits(self._pos[i[0][ok]], d[0][ok].astype(np.float32))

    def search_next(self, query: np.ndarray, tokens: np.ndarray, root: int, k: int,
                    min_score: float, max_agree: int, depth: int = 0) -> NextHits:
        """Among the positions j of `tokens` (the context: position n is the known next
        token `root`) that `root` follows (tokens[j + 1] == root, with a token after it,
        j + 2 < n) and that have a row here, the at most k most similar to `query` (a raw
        hidden row) with a similarity of at least `min_score`, best first (ties: the
        earlier position); with each, how many tokens up to the root the context before
        it agrees with the context's end (1 + matching tokens, at most `max_agree`) and,
        with `depth`, the (at most `depth`) tokens that follow the root there. Only those
        rows are read; the rows waiting to be stored are stored first."""
        if query.size != self.dim:
            raise ValueError(f"query has {query.size} values: accepted is one row of "
                             f"{self.dim}")
        n = len(tokens)
        if self._n == 0 or n < 3 or k <= 0:
            return NextHits([], [], [], [] if depth else None)
        if self._retrieve is None:
            return self._search_next_numpy(query, tokens, root, k, min_score, max_agree,
                                           depth)
        if n > len(self._row_of):
            self._cover(n)
        toks = tokens if (tokens.dtype == np.int32 and tokens.flags.c_contiguous) else \
            np.ascontiguousarray(tokens, dtype=np.int32)
        q = query if (query.dtype == np.float32 and query.flags.c_contiguous) else \
            np.ascontiguousarray(query, dtype=np.float32)
        out = self._next_out
        if out is None or len(out[0]) < k or out[6] < depth:
            out = self._next_addresses(max(k, 0 if out is None else len(out[0])),
                                       max(depth, 0 if out is None else out[6]))
        staged, address = self._staged, self._address
        got = self._retrieve(out[3][0], staged, address(q), self.dim, out[3][1],
                             out[4][0], self._stored, out[3][2], address(toks), n,
                             int(root), out[4][1], k, min_score, max_agree, *out[3][3:6],
                             out[6], out[3][6])
        self._stored += staged
        self._staged = 0
        positions = out[0][:got].tolist()
        follow = None
        if depth:
            t, w = out[5], out[6]
            follow = [t[h * w: h * w + min(depth, n - j - 2)].tolist()
                      for h, j in enumerate(positions)]
        return NextHits(positions, out[1][:got].tolist(), out[2][:got].tolist(), follow)

    def _next_addresses(self, k: int, depth: int) -> tuple:
        """search_next's arrays of k hits, and the addresses the kernel is given (taken
        once: reading an array's address costs more than the kernel's work on a few rows):
        (positions, scores, agree, (stage, centre, query, positions, scores, agree,
        tokens), (buffer, position map), tokens, depth); forgotten (None) where the buffer,
        the map or the centre is replaced."""
        # (`array`s: their slices' `tolist` is one cheap call each, numpy's slicing and
        # `tolist` two slower ones, on the caches a forward pass flushed)
        pos, scores, agree = array("q", bytes(8 * k)), array("f", bytes(4 * k)), \
            array("q", bytes(8 * k))
        follow = array("i", bytes(4 * k * max(depth, 1)))
        fixed = (self._stage.ctypes.data, self.center.ctypes.data, self._query.ctypes.data,
                 pos.buffer_info()[0], scores.buffer_info()[0], agree.buffer_info()[0],
                 follow.buffer_info()[0])
        self._next_out = (pos, scores, agree, fixed,
                          (self._buf.ctypes.data, self._row_of.ctypes.data), follow, depth)
        return self._next_out

    def _search_next_numpy(self, query: np.ndarray, tokens: np.ndarray, root: int, k: int,
                           min_score: float, max_agree: int, depth: int = 0) -> NextHits:
        """`search_next` without the compiled kernel."""
        q = self._flush(query)[0]
        n = len(tokens)
        cand = np.flatnonzero(tokens[1: n - 1] == root)
        cand = cand[cand < len(self._row_of)]
        rows = self._row_of[cand]
        ok = (rows >= 0) & (rows < self._stored)
        cand, rows = cand[ok], rows[ok]
        scores = self._buf[rows].astype(np.float32) @ q
        ok = scores >= min_score
        cand, scores = cand[ok], scores[ok]
        top = np.lexsort((cand, -scores))[:k]
        positions, agree = cand[top].tolist(), []
        for j in positions:
            a = 1  # the root itself; then the tokens before it
            while a < max_agree and j - a + 1 >= 0 and tokens[j - a + 1] == tokens[n - a]:
                a += 1
            agree.append(a)
        follow = [tokens[j + 2: j + 2 + depth].tolist() for j in positions] if depth else None
        return NextHits(positions, scores[top].tolist(), agree, follow)

    def _results(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Arrays a search of k hits writes into (reused: its hits are copied out)."""
        got = self._result_arrays.get(k)
        if got is None:
            got = self._result_arrays[k] = (np.empty((1, k), np.float32),
                                            np.empty((1, k), np.int64))
        return got

    def truncate(self, n: int) -> None:
        """Forget every position >= n (the context was trimmed)."""
        keep = int(np.count_nonzero(self._pos[: self._n] < n))
        if keep == self._n:
            return
        if not np.all(self._pos[:keep] < n):
            raise ValueError("index positions are not in increasing order; cannot truncate")
        self._flush()
        self._row_of[self._pos[keep: self._n]] = -1
        if self._faiss_n > keep:
            if self.backend == "faiss-cpu":
                faiss = _faiss()
                self._faiss_index.remove_ids(faiss.IDSelectorRange(keep, self._faiss_n))
                self._faiss_n = keep
            else:  # GPU flat indexes cannot remove: refilled from the buffer when needed
                self._faiss_index, self._faiss_n = None, 0
        self._n = self._stored = keep

    def clear(self) -> None:
        self.truncate(0)
        self.center = None
        self._next_out = None

    def copy_from(self, other: VectorIndex, n: int) -> None:
        """Become the first `n` rows of `other` (positions < n), stored rows and centre
        included: another request's context shares that prefix."""
        if other.dim != self.dim:
            raise ValueError(f"index dims differ: {other.dim} vs {self.dim}")
        other._flush()
        other_keep = int(np.count_nonzero(other._pos[: other._n] < n))
        self.clear()
        self.center = None if other.center is None else other.center.copy()
        self._next_out = None
        if other_keep == 0:
            return
        self._grow(other_keep)
        pos = other._pos[:other_keep]
        self._pos[:other_keep] = pos
        self._buf[:other_keep] = other._buf[:other_keep]
        self._cover(int(pos.max()))
        self._row_of[pos] = np.arange(other_keep, dtype=np.int32)
        self._n = self._stored = other_keep

    def memory_bytes(self, n: int | None = None) -> int:
        """Bytes held for `n` vectors (default: the capacity): fp16 vectors, int64 positions
        and the int32 map back (a faiss index, when `search` is used, holds another copy of
        the vectors)."""
        n = self.capacity if n is None else n
        return n * (self.dim * 2 + 12)
