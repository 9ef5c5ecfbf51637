"""The score steps' and the row's parameters' gradients (bias, ALiBi's slopes, score_mod's
parameters, the sinks), summed block by block: ScoreGrads.

An engine differentiates the score steps on blocks (scores.backward); each block's dS_3
(the gradient of step 3's output) gives its part of

    dbias           dS_3 summed to the bias's shape (over the axes it broadcast along)
    dalibi_slopes   -sum dS_3 |i + N_k - N_q - j| over each slope's rows
    dscore_mod_params   by complex step through score_mod (score_mods.py)

and the softmax row's (softmax_row.py) sink column of dS gives its part of

    dsinks          the column summed over each head's rows

and ScoreGrads adds those parts over a region of the scores, then the regions in a fixed
order (total), so that the bits do not depend on how the blocks were cut or where they ran.
"""
import numpy as np

from ._layout import block_ranges, gathered_cols, index_ranges, is_gathered, unbroadcast
from .scores import WHOLE, alibi_row_gradient, head_gradient, slopes_sum


def _within(parts, region):
    """The slices `parts` of the scores' axes, relative to the start of the slices `region`."""
    return tuple(slice(p.start - r.start, p.stop - r.start, p.step) for p, r in zip(parts, region))


def _bounds(indices, shape):
    """The smallest slices (of step 1) of each axis of `shape` that hold every index of the list."""
    ranges = [index_ranges(index, shape) for index in indices]
    return tuple(slice(min(r[a].start for r in ranges), max(r[a].stop for r in ranges)) for a in range(len(shape)))


def sums_over_keys(options, n_k):
    """Whether a parameter's gradient is a NumPy sum over a row's N_k keys (ALiBi's slopes, a bias
    broadcast along the keys, score_mod_params): a block of keys left out would group its sum
    otherwise, and change its bits."""
    o = options
    bias_over_keys = o.bias is not None and n_k > 1 and (np.ndim(o.bias) == 0 or np.shape(o.bias)[-1] == 1)
    return o.alibi_slopes is not None or o.score_mod_params is not None or bias_over_keys


class ScoreGrads:
    """The gradients of the score steps' parameters (bias, ALiBi slopes), summed block by
    block over a region of the scores: an index, as a block's, or the list of the blocks to
    come (every block added lies in it).

    Each task of an engine sums its own region's blocks in its own ScoreGrads; `total` adds
    the regions in a fixed order, so the bits do not depend on where or in which order the
    tasks ran.
        bias      dbias: each block's dS_3 summed to the bias's part it broadcast to
        ALiBi     each row's -sum_j dS_3 |i + N_k - N_q - j| (alibi_row_gradient)
        sinks     each head's sum of its sink column's dS over the block's rows (add_sink)
    """

    def __init__(self, options, score_shape, dtype, region=WHOLE):
        o, self.options, self.score_shape = options, options, tuple(score_shape)
        self.region = _bounds(region if isinstance(region, list) else [region], score_shape)
        self.dbias = self.rows = self.sinks = None
        if o.bias is not None:                      # the bias's part the region reads
            self.bias_shape = (1,) * (len(score_shape) - o.bias.ndim) + o.bias.shape
            self.bias_at = self._bias_part(self.region)
            self.dbias = np.zeros([s.stop - s.start for s in self.bias_at], dtype)
        if o.alibi_slopes is not None:              # its rows [..., H, N_q]
            self.rows = np.zeros([s.stop - s.start for s in self.region[:-1]], dtype)
        if o.sinks is not None:                     # its heads [..., H]
            self.sinks = np.zeros([s.stop - s.start for s in self.region[:-2]], dtype)
        self.mod = None if o.score_mod_params is None else \
            {name: np.zeros(x.shape, np.result_type(dtype, x.real.dtype)) for name, x in o.score_mod_params.items()}

    def _bias_part(self, ranges):
        """The slices of the bias (padded to the scores' axes) that scores at `ranges` read."""
        return tuple(slice(0, 1) if n == 1 else part for part, n in zip(ranges, self.bias_shape))

    def add(self, ds, index, rounded=None):
        """Add the block S[index]'s parameter gradients; ds [..., heads, rows, cols]: dS_3 there
        (a gathered block's [..., heads, rows, K], scattered back to its columns). rounded: what
        rounds ALiBi's products (alibi_row_gradient), or None."""
        ranges = block_ranges(index, self.score_shape)
        if self.dbias is not None:
            part = self.dbias[_within(self._bias_part(ranges), self.bias_at)]
            if not is_gathered(index):
                part += unbroadcast(ds, part.shape)
            else:                                   # each entry to its column (0 where the bias broadcasts)
                at = [np.zeros((1,) * ds.ndim, np.intp) if n == 1 else
                      np.arange(n).reshape((1,) * a + (n,) + (1,) * (ds.ndim - a - 1))
                      for a, n in enumerate(part.shape[:-1])]
                cols = gathered_cols(index, ds.ndim)
                where = (*at, cols if part.shape[-1] > 1 else 0 * cols)
                np.add.at(part, tuple(np.broadcast_to(i, ds.shape) for i in where), ds)
        if self.rows is not None:
            self.rows[_within(ranges[:-1], self.region[:-1])] += alibi_row_gradient(
                ds, self.options, self.score_shape, index, rounded)

    def add_sink(self, dsink, index):
        """Add the block S[index]'s sink gradient, dsink [..., heads]: its sink column of dS summed
        over the block's rows."""
        self.sinks[_within(block_ranges(index, self.score_shape)[:-2], self.region[:-2])] += dsink

    def add_mod(self, grads):
        """Add a block's score_mod_params gradients {name: gradient}."""
        for name, g in grads.items():
            self.mod[name] += g

    def __getstate__(self):
        """A region's sums, as a task on a cluster sends them back: without the options (and
        their bias), which only `add` needs."""
        return {**self.__dict__, "options": None}

    @staticmethod
    def total(parts, options, score_shape, dtype):
        """{"dbias": ..., "dalibi_slopes": ..., "dscore_mod_params": ..., "dsinks": ...} (each None
        without its option) from the regions' ScoreGrads `parts`, added in their order."""
        o = options
        whole = ScoreGrads(o, score_shape, dtype)
        for part in parts:
            if whole.dbias is not None:
                whole.dbias[part.bias_at] += part.dbias
            if whole.rows is not None:
                whole.rows[part.region[:-1]] += part.rows
            if whole.sinks is not None:
                whole.sinks[part.region[:-2]] += part.sinks
            if whole.mod is not None:
                whole.add_mod(part.mod)
        return {"dbias": None if o.bias is None else whole.dbias.reshape(o.bias.shape),
                "dalibi_slopes": None if o.alibi_slopes is None else slopes_sum(whole.rows, o.alibi_slopes,
                                                                                o.cu_seqlens_q),
                "dscore_mod_params": whole.mod,
                "dsinks": None if o.sinks is None else head_gradient(whole.sinks, o.sinks)}
