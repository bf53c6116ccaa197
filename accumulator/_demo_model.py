"""The demo's model and data: a softmax classifier of scikit-learn's bundled 8x8 digits,
with a dense part (``W``, ``b``) and a sparse one (``emb``, a table of (pixel, intensity)
rows), its loss and gradients in numpy (no Redis here; tested on their own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

N_PIXELS = 64
N_LEVELS = 17  # the digits data set's pixel intensities are 0..16
N_CLASSES = 10
TEST_FRACTION = 0.2


class DemoError(Exception):
    """A failure the demo explains in one line (exit code 2)."""


@dataclass(frozen=True)
class Split:
    """Features of a set of images: scaled pixels, (pixel, intensity) row ids, labels."""

    x: np.ndarray  # (n, 64) float64 in [0, 1]
    rows: np.ndarray  # (n, 64) int64 rows of emb
    y: np.ndarray  # (n,) int64

    def __len__(self) -> int:
        return len(self.y)

    def take(self, index: np.ndarray) -> Split:
        return Split(self.x[index], self.rows[index], self.y[index])


def digits_loader() -> Any:
    """scikit-learn's ``load_digits``; a DemoError (exit code 2) without scikit-learn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DemoError(
            "the demo needs scikit-learn: pip install 'redis-accumulator[demo]'"
        ) from exc
    return load_digits


def load_data(seed: int) -> tuple[Split, Split]:
    """(train, test): a seeded shuffle of the 1797 digits, 20% held out. Every process
    computes the same split from the seed."""
    digits = digits_loader()()
    pixels = np.asarray(digits.data, dtype=np.int64)
    data = Split(
        x=pixels / 16.0,
        rows=np.arange(N_PIXELS, dtype=np.int64) * N_LEVELS + pixels,
        y=np.asarray(digits.target, dtype=np.int64),
    )
    order = np.random.default_rng(seed).permutation(len(data))
    n_test = int(round(len(data) * TEST_FRACTION))
    return data.take(order[n_test:]), data.take(order[:n_test])


def init_params() -> dict[str, np.ndarray]:
    # A convex problem: zeros are a fine start and make runs reproducible.
    return {
        "W": np.zeros((N_PIXELS, N_CLASSES), np.float32),
        "b": np.zeros(N_CLASSES, np.float32),
        "emb": np.zeros((N_PIXELS * N_LEVELS, N_CLASSES), np.float32),
    }


def _logits(params: dict[str, np.ndarray], data: Split) -> np.ndarray:
    logits: np.ndarray = data.x @ params["W"] + params["b"] + params["emb"][data.rows].sum(axis=1)
    return logits


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    out: np.ndarray = e / e.sum(axis=1, keepdims=True)
    return out


def loss_and_grads(params: dict[str, np.ndarray], batch: Split) -> tuple[float, dict[str, Any]]:
    """Mean cross-entropy and its gradients; emb's as (rows, values) of the rows used."""
    prob = _softmax(_logits(params, batch).astype(np.float64))
    n = len(batch)
    loss = float(-np.log(prob[np.arange(n), batch.y] + 1e-12).mean())
    d = prob
    d[np.arange(n), batch.y] -= 1.0
    d /= n
    rows, inverse = np.unique(batch.rows.ravel(), return_inverse=True)
    g_emb = np.zeros((len(rows), N_CLASSES))
    # every (image, pixel) adds that image's logit gradient to the row it looked up
    np.add.at(g_emb, inverse.ravel(), np.repeat(d, batch.rows.shape[1], axis=0))
    return loss, {"W": batch.x.T @ d, "b": d.sum(axis=0), "emb": (rows, g_emb)}


def evaluate(params: dict[str, np.ndarray], data: Split) -> tuple[float, float]:
    """(mean cross-entropy, accuracy)."""
    logits = _logits(params, data).astype(np.float64)
    prob = _softmax(logits)
    loss = float(-np.log(prob[np.arange(len(data)), data.y] + 1e-12).mean())
    return loss, float((logits.argmax(axis=1) == data.y).mean())
