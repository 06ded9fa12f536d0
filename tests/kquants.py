"""Q4_K / Q5_K / Q6_K encoders for tests (gguf-py 0.19 decodes K-quants but cannot encode
them): plain min/max rounding, not llama.cpp's search, but valid blocks in the file layout
that gguf-py's dequantize (the reference) reads. Other types use gguf.quants.quantize."""

from __future__ import annotations

import gguf
import numpy as np

_Q = gguf.GGMLQuantizationType


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """uint8 [rows, row_bytes] of float32 ``w`` [rows, cols] in ggml type ``kind``."""
    qtype = _Q[kind]
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype not in (_Q.Q4_K, _Q.Q5_K, _Q.Q6_K):
        return gguf.quants.quantize(w, qtype)
    blocks = w.reshape(-1, 256)
    encode = {_Q.Q4_K: _q45_k, _Q.Q5_K: _q45_k, _Q.Q6_K: _q6_k}[qtype]
    out = np.stack([encode(b, qtype == _Q.Q5_K) for b in blocks])
    return out.reshape(w.shape[0], -1)


def _half(x: float) -> bytes:
    return np.float16(x).tobytes()


def _q45_k(x: np.ndarray, five: bool) -> np.ndarray:
    levels = 31 if five else 15
    sub = x.reshape(8, 32)
    lo = np.minimum(sub.min(axis=1), 0.0)
    scale = (sub.max(axis=1) - lo) / levels
    d = max(scale.max() / 63, 1e-8)
    dmin = max(-lo.min() / 63, 1e-8)
    d, dmin = float(np.float16(d)), float(np.float16(dmin))
    sc = np.clip(np.round(scale / d), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin), 0, 63).astype(np.uint8)
    q = np.clip(np.round((sub + (dmin * mn)[:, None]) / (d * sc)[:, None]), 0, levels)
    q = q.astype(np.uint8)
    scales = np.zeros(12, np.uint8)  # the inverse of get_scale_min_k4
    scales[0:4] = (sc[:4] & 63) | ((sc[4:] >> 4) << 6)
    scales[4:8] = (mn[:4] & 63) | ((mn[4:] >> 4) << 6)
    scales[8:12] = (sc[4:] & 15) | ((mn[4:] & 15) << 4)
    qs = np.zeros(128, np.uint8)
    for pair in range(4):
        qs[32 * pair:32 * pair + 32] = (q[2 * pair] & 15) | ((q[2 * pair + 1] & 15) << 4)
    parts = [_half(d), _half(dmin), scales.tobytes()]
    if five:
        qh = np.zeros(32, np.uint8)
        for s in range(8):
            qh |= ((q[s] >> 4) & 1) << s
        parts.append(qh.tobytes())
    parts.append(qs.tobytes())
    return np.frombuffer(b"".join(parts), np.uint8)


def _q6_k(x: np.ndarray, _five: bool) -> np.ndarray:
    groups = x.reshape(16, 16)
    amax = np.abs(groups).max(axis=1)
    scale = amax / 31
    d = float(np.float16(max(np.abs(scale).max() / 127, 1e-8)))
    sc = np.clip(np.round(scale / d), 1, 127).astype(np.int8)
    q = np.clip(np.round(groups / (d * sc.astype(np.float32))[:, None]), -32, 31)
    q = (q.astype(np.int16) + 32).astype(np.uint8).reshape(256)
    ql, qh = np.zeros(128, np.uint8), np.zeros(64, np.uint8)
    for h in range(2):  # values 128 h + 32 c + l, c = 0..3
        v = q[128 * h:128 * h + 128].reshape(4, 32)
        ql[64 * h:64 * h + 32] = (v[0] & 15) | ((v[2] & 15) << 4)
        ql[64 * h + 32:64 * h + 64] = (v[1] & 15) | ((v[3] & 15) << 4)
        qh[32 * h:32 * h + 32] = ((v[0] >> 4) | ((v[1] >> 4) << 2) | ((v[2] >> 4) << 4)
                                  | ((v[3] >> 4) << 6))
    return np.frombuffer(ql.tobytes() + qh.tobytes() + sc.tobytes() + _half(d), np.uint8)
