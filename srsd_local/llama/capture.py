"""Hidden-state capture through llama.cpp's eval callback.

The scheduler asks the callback about every graph node (``ask=True``); we answer yes only for
``l_out-<L>`` (the residual stream after layer L). When such a tensor has been computed the
callback is called again (``ask=False``) and the rows are copied out with
``ggml_backend_tensor_get``, which also works when the tensor lives on a GPU. Rows of one
decode are concatenated across ubatches.

Two implementations with one interface: a callback in C (``_capture.c``, compiled with the
system's C compiler on first use and cached), and the same logic in Python, used where no
compiler is found or when ``SRSD_CAPTURE=python``. The Python one costs a Python call for
each of the ~700 graph nodes of every decode.
"""

from __future__ import annotations

import ctypes
from importlib import resources
from pathlib import Path

import numpy as np

from .. import store
from ..config import environment

_GGML_TYPE_F32 = 0
_GGML_TYPE_F16 = 1
_NE_OFFSET = 16  # struct ggml_tensor: int type; (pad); void *buffer; int64_t ne[4]; ...


def _ggml_lib():
    from llama_cpp import _ggml  # noqa: PLC0415

    lib = _ggml.libggml
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                            ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    return lib


def resolve_layer(layer: int | float, n_layer: int) -> int:
    """A layer index from an index or a depth fraction. The last layer is refused: in it
    llama.cpp keeps only the rows that produce logits."""
    if isinstance(layer, bool) or not isinstance(layer, (int, float)):
        raise ValueError(f"invalid layer {layer!r}: give an index (int) or a depth fraction")
    if isinstance(layer, float):
        if not 0.0 < layer < 1.0:
            raise ValueError(f"invalid layer fraction {layer}: accepted is a number in (0, 1)")
        idx = int(round(layer * n_layer))
        return min(max(idx, 0), n_layer - 2)
    if not 0 <= layer <= n_layer - 2:
        raise ValueError(f"invalid layer {layer}: this model has {n_layer} layers; accepted "
                         f"are 0..{n_layer - 2} (the last layer keeps only output rows)")
    return layer


class HiddenCapture:
    """Collects rows of the wanted layers during each decode (Python callback)."""

    kind = "python"

    def __init__(self, layers: list[int]) -> None:
        from llama_cpp import llama_cpp as L  # noqa: PLC0415

        self._lib = _ggml_lib()
        self.layers = list(layers)
        self._names = {f"l_out-{layer}".encode(): layer for layer in layers}
        self._parts: dict[int, list[np.ndarray]] = {layer: [] for layer in layers}
        self.enabled = True
        # keep a reference for the life of the context
        self.callback = L.ggml_backend_sched_eval_callback(self._cb)

    def _cb(self, tensor: int, ask: bool, _user: int) -> bool:
        if not self.enabled:
            return False if ask else True
        layer = self._names.get(self._lib.ggml_get_name(tensor))
        if ask:
            return layer is not None
        if layer is None:
            return True
        ttype = ctypes.c_int.from_address(tensor).value
        ne = (ctypes.c_int64 * 4).from_address(tensor + _NE_OFFSET)
        dtype = {_GGML_TYPE_F32: np.float32, _GGML_TYPE_F16: np.float16}.get(ttype)
        if dtype is None:
            raise RuntimeError(f"l_out-{layer} has unsupported ggml type {ttype}")
        out = np.empty((ne[1], ne[0]), dtype=dtype)
        self._lib.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
        self._parts[layer].append(out)
        return True

    def reset(self) -> None:
        for parts in self._parts.values():
            parts.clear()

    def rows(self, layer: int | None = None, copy: bool = True) -> np.ndarray | None:
        """float32 [n_tokens, n_embd] for the last decode (None if nothing was captured;
        arrays of their own, whatever `copy` says)."""
        parts = self._parts[self.layers[0] if layer is None else layer]
        if not parts:
            return None
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return rows.astype(np.float32, copy=False)

    @property
    def user_data(self):
        return None


class _CState(ctypes.Structure):
    _fields_ = [("get_name", ctypes.c_void_p), ("nbytes", ctypes.c_void_p),
                ("tensor_get", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("enabled", ctypes.c_int32), ("type", ctypes.c_int32),
                ("buf", ctypes.c_void_p), ("cap", ctypes.c_size_t), ("used", ctypes.c_size_t),
                ("ne0", ctypes.c_int64), ("rows", ctypes.c_int64), ("overflow", ctypes.c_int32)]


def compiled_callback_library() -> Path | None:
    """Path of the compiled C callback (built once into the cache), or None."""
    src = resources.files("srsd_local.llama").joinpath("_capture.c").read_bytes()
    return store.compiled_library("capture", src)


class CompiledCapture:
    """The same capture with the callback in C: one layer, rows into a preallocated buffer."""

    kind = "c"

    def __init__(self, layer: int, max_rows: int, n_embd: int, lib_path: Path) -> None:
        from llama_cpp import llama_cpp as L  # noqa: PLC0415

        ggml = _ggml_lib()
        self._lib = ctypes.CDLL(str(lib_path))
        self.layers = [layer]
        self._buf = np.zeros(max_rows * n_embd, dtype=np.float32)
        self._n_embd = n_embd
        self._rows32 = self._buf.reshape(max_rows, n_embd)  # the usual case: float32 rows
        st = self._state = _CState()
        st.get_name = ctypes.cast(ggml.ggml_get_name, ctypes.c_void_p).value
        st.nbytes = ctypes.cast(ggml.ggml_nbytes, ctypes.c_void_p).value
        st.tensor_get = ctypes.cast(ggml.ggml_backend_tensor_get, ctypes.c_void_p).value
        st.name = f"l_out-{layer}".encode()
        st.enabled = 1
        st.buf = self._buf.ctypes.data
        st.cap = self._buf.nbytes
        fn = ctypes.cast(self._lib.srsd_capture_cb, ctypes.c_void_p).value
        self.callback = L.ggml_backend_sched_eval_callback(fn)
        self.user_data = ctypes.cast(ctypes.pointer(st), ctypes.c_void_p)

    @property
    def state(self) -> _CState:
        """The C callback's state (a compiled plain step switches and empties it)."""
        return self._state

    @property
    def enabled(self) -> bool:
        return bool(self._state.enabled)

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._state.enabled = int(bool(value))

    def reset(self) -> None:
        self._state.used = 0
        self._state.rows = 0
        self._state.overflow = 0

    def rows(self, layer: int | None = None, copy: bool = True) -> np.ndarray | None:
        """float32 [n_tokens, n_embd] for the last decode (None if nothing was captured): a
        new array, or without `copy` (float32 rows only) a view of the buffer the next
        decode overwrites."""
        st = self._state
        if st.overflow:
            raise RuntimeError("hidden-state capture buffer overflow")
        rows = st.rows
        if rows == 0:
            return None
        if st.type == _GGML_TYPE_F32 and st.ne0 == self._n_embd:  # one copy, no reshaping
            return self._rows32[:rows].copy() if copy else self._rows32[:rows]
        if st.type == _GGML_TYPE_F16:
            raw = self._buf.view(np.float16)[: st.rows * st.ne0]
        elif st.type == _GGML_TYPE_F32:
            raw = self._buf[: st.rows * st.ne0]
        else:
            raise RuntimeError(f"l_out-{self.layers[0]} has unsupported ggml type {st.type}")
        return raw.reshape(st.rows, st.ne0).astype(np.float32, copy=True)


def make_capture(layer: int, max_rows: int, n_embd: int) -> HiddenCapture | CompiledCapture:
    """The C capture where a compiler is available (and not disabled), else Python."""
    if environment().capture != "python":
        try:
            lib = compiled_callback_library()
        except OSError:  # an unwritable cache
            lib = None
        if lib is not None:
            return CompiledCapture(layer, max_rows, n_embd, lib)
    return HiddenCapture([layer])
