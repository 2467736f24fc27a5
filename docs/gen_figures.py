"""Draw the figures of the documentation (PNG files, matplotlib's Agg backend: no display).

Run from the repository root::

    python docs/gen_figures.py [OUTDIR]

``docs/conf.py`` calls :func:`main` at the start of every build, writing into
``docs/_generated/`` (not under version control). The blocks and the halo
widths are computed by the library itself (:class:`disttensor.Distribution`
and :func:`disttensor_nn.window.output_layout`), so the pictures cannot drift
from the code.
"""

from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from disttensor import Distribution  # noqa: E402
from disttensor_nn.window import WindowSpec, output_layout  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "_generated")

SHAPE = (10, 7)  # the worked example of the concepts page
GRID = (2, 3)
HALO_RANK = 4  # the block whose halo the second panel shows
COLORS = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462"]


def _cell(ax, r, c, **kw):
    ax.add_patch(Rectangle((c, r), 1, 1, **kw))


def _frame(ax, dist, title):
    rows, cols = dist.global_shape
    ax.set_xlim(-1.6, cols + 1.6)
    ax.set_ylim(rows + 1.6, -1.6)  # row 0 at the top, as NumPy prints arrays
    ax.set_aspect("equal")
    rb, cb = dist.boundaries
    ax.set_xticks(cb)
    ax.set_yticks(rb)
    ax.tick_params(length=0, labelsize=8)
    ax.xaxis.tick_top()
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(title, fontsize=9, pad=18)


def draw_blocks(ax, dist):
    """Every cell coloured by the rank that owns it; one label per block."""
    _frame(ax, dist, f"Distribution(shape={dist.global_shape}, grid={dist.grid_shape}):\n"
                     "blocks by numpy.array_split's rule")
    for rank in range(dist.nprocs):
        rs, cs = dist.local_slices(rank)
        for r in range(rs.start, rs.stop):
            for c in range(cs.start, cs.stop):
                _cell(ax, r, c, facecolor=COLORS[rank], edgecolor="white", lw=0.8)
        ax.add_patch(Rectangle((cs.start, rs.start), cs.stop - cs.start, rs.stop - rs.start,
                               fill=False, edgecolor="black", lw=1.6))
        coords = tuple(int(v) for v in dist.block_index(rank))
        ax.text((cs.start + cs.stop) / 2, (rs.start + rs.stop) / 2,
                f"rank {rank}\n{coords}\n{dist.local_shape(rank)[0]}x{dist.local_shape(rank)[1]}",
                ha="center", va="center", fontsize=8)
    ax.set_xlabel("columns: 7 = 3 + 2 + 2 over grid axis 1;  rows: 10 = 5 + 5 over grid axis 0",
                  fontsize=8)


def draw_halo(ax, dist, rank):
    """The block of ``rank``, its halo for a 3x3 convolution, and the owner of each halo cell."""
    spec = WindowSpec.make(2, 3, 1, 1, 1)  # kernel 3, stride 1, padding 1
    nchw = Distribution((1, 1, *dist.global_shape), dist.grid_shape, (None, None, 0, 1))
    _, widths = output_layout(spec, nchw)
    (top, bottom), (left, right) = widths[2], widths[3]
    rows, cols = dist.global_shape
    _frame(ax, dist, f"halo of rank {rank} for Conv2d(kernel 3, padding 1):\n"
                     f"widths (before, after) = {widths[2]} rows, {widths[3]} columns")
    for r in range(rows):
        for c in range(cols):
            _cell(ax, r, c, facecolor="#f2f2f2", edgecolor="white", lw=0.8)
    rs, cs = dist.local_slices(rank)
    for r in range(rs.start, rs.stop):
        for c in range(cs.start, cs.stop):
            _cell(ax, r, c, facecolor=COLORS[rank], edgecolor="white", lw=0.8)
    ax.add_patch(Rectangle((cs.start, rs.start), cs.stop - cs.start, rs.stop - rs.start,
                           fill=False, edgecolor="black", lw=1.6))
    ax.text((cs.start + cs.stop) / 2, (rs.start + rs.stop) / 2, f"rank {rank}",
            ha="center", va="center", fontsize=8)
    for r in range(rs.start - top, rs.stop + bottom):
        for c in range(cs.start - left, cs.stop + right):
            if rs.start <= r < rs.stop and cs.start <= c < cs.stop:
                continue
            if 0 <= r < rows and 0 <= c < cols:
                src = dist.owner((r, c))
                _cell(ax, r, c, facecolor=COLORS[src], edgecolor="black", lw=0.6, hatch="///")
                ax.text(c + 0.5, r + 0.5, str(src), ha="center", va="center", fontsize=7)
            else:
                _cell(ax, r, c, facecolor="white", edgecolor="black", lw=0.6, ls="--")
                ax.text(c + 0.5, r + 0.5, "0", ha="center", va="center", fontsize=7,
                        color="#777777")
    ax.add_patch(Rectangle((cs.start - left, rs.start - top),
                           cs.stop - cs.start + left + right, rs.stop - rs.start + top + bottom,
                           fill=False, edgecolor="#c00000", lw=1.6))
    ax.set_xlabel("hatched: halo cells, labelled with the rank that owns them\n"
                  "(corners travel through a neighbour: rows first, then columns);\n"
                  "dashed '0': zero padding beyond the global edge (filled locally)",
                  fontsize=8)


def main(outdir: str = DEFAULT_OUT) -> list[str]:
    """Write the figures into ``outdir``; return their paths."""
    os.makedirs(outdir, exist_ok=True)
    dist = Distribution(SHAPE, GRID)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 5.2))
    draw_blocks(a, dist)
    draw_halo(b, dist, HALO_RANK)
    fig.tight_layout()
    path = os.path.join(outdir, "blocks_2x3.png")
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return [path]


if __name__ == "__main__":
    for p in main(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT):
        print(p)
