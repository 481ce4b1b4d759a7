"""Greedy samplers for llama.cpp's graph that copy nothing out but the token (`_argmax.c`).

With `sample_in_graph`, each output row of a sampled sequence gets its argmax inside the
forward pass and only the token id comes back (or, for a request under a grammar, the token
and the row). llama.cpp's own greedy sampler still has
every row padded into a copy and copied out (as the row's "sampled logits"), and on a CPU
its argmax takes one thread and a scalar loop; together they cost more than the walk over
logits rows they spare. These samplers take the row from llama.cpp's logits tensor itself
(no pad computed), give back no logits, and on a CPU take the argmax with two custom ggml
ops per row on every thread. Built once with the system's C compiler into the cache; where
they cannot be, the engine falls back on llama.cpp's greedy sampler.
"""

from __future__ import annotations

import ctypes
from array import array
from functools import lru_cache, partial
from importlib import resources

from .. import store
from .capture import _ggml_lib

FLAGS = ("-O3", "-march=native")
# ggml's functions srsd_argmax_setup takes, in its order
SETUP = ("ggml_init", "ggml_free", "ggml_new_tensor_2d", "ggml_pad", "ggml_view_1d",
         "ggml_custom_4d", "ggml_argmax", "ggml_get_data", "ggml_nelements")


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled sampler, set up with ggml's functions; None without a compiler."""
    src = resources.files("srsd_local.llama").joinpath("_argmax.c").read_bytes()
    lib = store.load_compiled("argmax", src, ((FLAGS, True), (("-O3",), False)))
    if lib is None:
        return None
    ggml = _ggml_lib()
    addr = [ctypes.cast(getattr(ggml, f), ctypes.c_void_p).value for f in SETUP]
    lib.srsd_argmax_setup.argtypes = [ctypes.c_void_p] * len(SETUP)
    lib.srsd_argmax_setup.restype = ctypes.c_int
    if not lib.srsd_argmax_setup(*addr):  # ggml's tensors are not laid out as expected
        return None
    lib.srsd_argmax_iface.argtypes = [ctypes.c_int]
    lib.srsd_argmax_iface.restype = ctypes.c_void_p
    lib.srsd_argmax_rows.argtypes = [ctypes.c_int]
    lib.srsd_argmax_rows.restype = ctypes.c_int64
    lib.srsd_read_sampled.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_int64, ctypes.c_void_p]
    lib.srsd_read_sampled.restype = ctypes.c_int64
    lib.srsd_fill_batch.argtypes = [ctypes.c_void_p, ctypes.c_int32] + [ctypes.c_void_p] * 5
    lib.srsd_fill_batch.restype = ctypes.c_int32
    lib.srsd_step_one.argtypes = [ctypes.c_void_p] + [ctypes.c_int32] * 5 + [ctypes.c_void_p]
    lib.srsd_step_one.restype = ctypes.c_int32
    lib.srsd_step_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.c_void_p]
    lib.srsd_step_rows.restype = ctypes.c_int32
    lib.srsd_step_run.argtypes = ([ctypes.c_void_p] + [ctypes.c_int32] * 6 +
                                  [ctypes.c_void_p] * 8)
    lib.srsd_step_run.restype = ctypes.c_int32
    return lib


def sampled_reader(L):
    """`read(ctx, rows, out) -> int`: into the int32 array at address `out`, the in-graph
    sampled token of each batch row in `rows` (an int32 array; -1 for -1) after the last
    llama_decode call, in one compiled call; how many were read. None without a build. (An
    address, not the array: numpy's `.ctypes` makes a helper object in Python code, which
    costs tens of microseconds on the caches a forward pass just flushed.)"""
    lib = library()
    if lib is None:
        return None
    fn = lib.srsd_read_sampled
    get = ctypes.cast(L.llama_get_sampled_token_ith, ctypes.c_void_p).value

    def read(ctx, rows: array, out: int) -> int:
        return fn(get, ctx, rows.buffer_info()[0], len(rows), out)

    return read


def make_sampler(L, threads: bool, keep: bool = False) -> object | None:
    """A new llama_sampler of this kind (for a sampler chain, which then owns it), or None
    when it could not be built. `threads`: the argmax as custom ops on every CPU thread (for
    logits computed on the CPU), else ggml's argmax (on the backend that computed them).
    `keep`: the row is copied out as well, as the row's sampled logits (a grammar that
    rejects the argmax needs the row)."""
    lib = library()
    if lib is None:
        return None
    kind = int(threads) | (2 if keep else 0)
    iface = ctypes.cast(lib.srsd_argmax_iface(kind), ctypes.POINTER(L.llama_sampler_i))
    smpl = L.llama_sampler_init(iface, None)
    return smpl or None


class DrawState(ctypes.Structure):
    """`_argmax.c`'s `struct draw_state`: a draw sampler's uniform draw for the next pass,
    its 1 / temperature, rows it drew, and its scratch."""

    _fields_ = [("u", ctypes.c_double), ("inv_t", ctypes.c_float), ("rows", ctypes.c_int32),
                ("sums", ctypes.c_void_p), ("n_sums", ctypes.c_int64)]


_DRAW: list[tuple[int, int]] = []  # the host's draw functions, once given (provide_draw)


def provide_draw(blocks: int, pick: int) -> None:
    """The host's compiled draw (spec/_kernels.c's `srsd_temperature_blocks` and
    `srsd_temperature_pick`, as addresses), which draw samplers make in the graph: given by
    the engine (this layer does not import the samplers' code). Once; a no-op without a
    build."""
    lib = library()
    if lib is None or _DRAW:
        return
    lib.srsd_draw_setup.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.srsd_draw_setup.restype = None
    lib.srsd_draw_iface.argtypes = []
    lib.srsd_draw_iface.restype = ctypes.c_void_p
    lib.srsd_draw_setup(blocks, pick)
    _DRAW.append((blocks, pick))


def draws_available() -> bool:
    """Whether draw samplers can be built here (a build, and the host's draw given)."""
    return bool(_DRAW)


def make_draw_sampler(L, temperature: float, n_vocab: int
                      ) -> tuple[object, DrawState, object] | None:
    """(sampler, state, scratch): a new llama_sampler that draws a row's token at
    `temperature` in llama.cpp's graph on the CPU's threads with the uniform draw
    `state.u` set before each pass (the host's compiled draw, so the host's token for that
    row and u), for a sampler chain; state and scratch must outlive it. None where it
    cannot be built."""
    lib = library()
    if lib is None or not _DRAW:
        return None
    scratch = (ctypes.c_double * (2 * (n_vocab // 512 + 1)))()
    state = DrawState(u=0.0, inv_t=1.0 / max(temperature, 1e-6), rows=0,
                      sums=ctypes.addressof(scratch), n_sums=len(scratch))
    iface = ctypes.cast(lib.srsd_draw_iface(), ctypes.POINTER(L.llama_sampler_i))
    smpl = L.llama_sampler_init(iface, ctypes.addressof(state))
    return (smpl, state, scratch) if smpl else None


def rows_sampled(direct: bool = False) -> int:
    """Rows whose argmax this sampler took in a graph, ever, in this process (`direct`: of
    those, the rows read from llama.cpp's logits tensor rather than its padded copy)."""
    lib = library()
    return 0 if lib is None else int(lib.srsd_argmax_rows(int(direct)))


def batch_filler(batch):
    """`fill(m, tokens, positions, flags, nseq, seq) -> int`: rows 0..m-1 of the llama_batch
    `batch` in one compiled call, from int32 arrays (`array("i")`; `flags` an `array("b")` or
    None for every row; `seq` every row's `nseq[i]` sequence ids one after the other); the
    number of output rows. None without a build."""
    lib = library()
    if lib is None or not _batch_layout_matches(type(batch)):
        return None
    fn, at = lib.srsd_fill_batch, ctypes.addressof(batch)

    def fill(m: int, tokens: array, positions: array, flags: array | None, nseq: array,
             seq: array) -> int:
        return fn(at, m, tokens.buffer_info()[0], positions.buffer_info()[0],
                  None if flags is None else flags.buffer_info()[0], nseq.buffer_info()[0],
                  seq.buffer_info()[0])

    return fill


def _batch_layout_matches(kind: type) -> bool:
    """Whether llama-cpp-python's llama_batch is laid out as `_argmax.c`'s `struct batch`
    (an int32 count, then six pointers, each at its natural alignment)."""
    ptr = ctypes.sizeof(ctypes.c_void_p)
    names = ("token", "embd", "pos", "n_seq_id", "seq_id", "logits")
    return kind.n_tokens.offset == 0 and all(
        getattr(kind, name).offset == ptr * (k + 1) for k, name in enumerate(names))


class StepState(ctypes.Structure):
    """`_argmax.c`'s `struct step`: what a compiled plain step needs, and what it found."""

    _fields_ = [("ctx", ctypes.c_void_p), ("batch", ctypes.c_void_p),
                ("decode", ctypes.c_void_p), ("sync", ctypes.c_void_p),
                ("sampled", ctypes.c_void_p), ("cap_enabled", ctypes.c_void_p),
                ("cap_used", ctypes.c_void_p), ("cap_rows", ctypes.c_void_p),
                ("cap_overflow", ctypes.c_void_p), ("cap_type", ctypes.c_void_p),
                ("cap_ne0", ctypes.c_void_p), ("cap_buf", ctypes.c_void_p),
                ("n_embd", ctypes.c_int64), ("seconds", ctypes.c_double),
                ("token", ctypes.c_int32), ("staged", ctypes.c_int32),
                ("read_seconds", ctypes.c_double), ("verdict", ctypes.c_int32)]


def plain_stepper(L, ctx, batch, capture_state=None, n_embd: int = 0):
    """`(step, state)`: `step(token, pos, seq, capture, want_sampled, stage) -> rc` (a partial
    of the C function itself: no Python frame between) decodes one token
    of sequence `seq` at position `pos` (its logits row wanted) with the llama_batch `batch`
    of context `ctx`, in one compiled call: the batch written, the compiled capture (its
    ctypes state struct `capture_state`, or None) switched on or off (`capture`) and emptied,
    llama_decode and llama_synchronize timed (`state.seconds`), and with `want_sampled` the
    token llama.cpp's graph sampled for the row (`state.token`, else -1); with `stage` (an
    address, or None) a captured row of `n_embd` float32 values is copied there as well
    (`state.staged`). llama_decode's return code comes back. None without a build or where
    the batch is not laid out as the C code assumes."""
    lib = library()
    if lib is None or not _batch_layout_matches(type(batch)):
        return None
    st = StepState()
    st.ctx = ctx
    st.batch = ctypes.addressof(batch)
    st.decode = ctypes.cast(L.llama_decode, ctypes.c_void_p).value
    st.sync = ctypes.cast(L.llama_synchronize, ctypes.c_void_p).value
    st.sampled = ctypes.cast(L.llama_get_sampled_token_ith, ctypes.c_void_p).value
    if capture_state is not None:
        base, kind = ctypes.addressof(capture_state), type(capture_state)
        st.cap_enabled = base + kind.enabled.offset
        st.cap_used = base + kind.used.offset
        st.cap_rows = base + kind.rows.offset
        st.cap_overflow = base + kind.overflow.offset
        st.cap_type = base + kind.type.offset
        st.cap_ne0 = base + kind.ne0.offset
        st.cap_buf = base + kind.buf.offset
        st.n_embd = n_embd
    return partial(lib.srsd_step_one, ctypes.addressof(st)), st


def rows_stepper(state: StepState):
    """`step(rows, n_rows, out) -> rc` for the state of a `plain_stepper` (a partial of the
    C function itself): a pass of the batch's rows as filled, in one compiled call: the
    compiled capture emptied, llama_decode and llama_synchronize timed (`state.seconds`),
    then into the int32 array at address `out` the in-graph sampled token of each batch row
    in the int32 array at address `rows` (-1 for -1), how many were read in `state.token`,
    the time that took in `state.read_seconds`. llama_decode's return code comes back."""
    return partial(library().srsd_step_rows, ctypes.addressof(state))


def run_stepper(L, state: StepState):
    """`(run, eog)`: `run(token, pos, seq, capture, capture_from, n, stage, out, eog, vocab,
    draw_u, u, check, check_data) -> rc` for the state of a `plain_stepper` (a partial of the C
    function itself): up to n plain steps of sequence `seq` in one compiled call, each decoding
    the token the step before took in the graph (the sequence must have an in-graph sampler),
    `token` first at `pos`; into the int32 array at address `out` each step's token. With
    `draw_u` (the address of a draw sampler's `DrawState.u`, or None) step i's uniform draw is
    set to the i-th double at address `u` before its pass. Steps from `capture_from` on have
    their hidden row captured (with `capture`), the others not. It stops after an end-of-
    generation token (llama.cpp's `llama_vocab_is_eog` of `vocab`), after a step whose captured
    row could not be staged, or at a failed llama_decode (its return code comes back).
    `state.token`: steps done, `state.staged`: how many captured rows went to `stage` (an
    address for rows of n_embd float32 values one after the other, or None), `state.seconds`:
    their llama_decode and llama_synchronize. With `check` (the address of a C function
    `int32_t check(void *check_data, int32_t token)`, or None), each step's token is checked: 1
    taken, 2 taken and the run stops, 0 rejected (not taken) and the run stops;
    `state.verdict`: the last verdict (1 without a check)."""
    eog = ctypes.cast(L.llama_vocab_is_eog, ctypes.c_void_p).value
    return partial(library().srsd_step_run, ctypes.addressof(state)), eog
