"""Hidden-state capture through llama.cpp's eval callback (DESIGN section 3).

The scheduler asks the callback about every graph node (``ask=True``); we answer yes only for
``l_out-<L>`` (the residual stream after layer L). When such a tensor has been computed the
callback is called again (``ask=False``) and the rows are copied out with
``ggml_backend_tensor_get``, which also works when the tensor lives on a GPU. Rows of one
decode are concatenated across ubatches.
"""

from __future__ import annotations

import ctypes

import numpy as np

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
    """Collects rows of the wanted layers during each decode."""

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

    def rows(self, layer: int | None = None) -> np.ndarray | None:
        """float32 [n_tokens, n_embd] for the last decode (None if nothing was captured)."""
        parts = self._parts[self.layers[0] if layer is None else layer]
        if not parts:
            return None
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return rows.astype(np.float32, copy=False)
