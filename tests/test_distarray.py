"""MPI tests of DistArray scatter/gather, creation functions and counter-based random numbers.

Run at world sizes 1 to 4 (``python -m disttensor.testing.launch``). The
reference is always NumPy on the global array, which every rank builds the
same way, and block layouts are recomputed independently from
``numpy.array_split`` and row-major grid coordinates. Local checks are
collected in a :class:`Check` and turned into one collective assertion, so a
failure on one rank fails the test on every rank and never leaves ranks
waiting in a collective.
"""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from mpi4py import MPI

import disttensor as dt
from disttensor import DistArray, Distribution, ProcessGrid
from disttensor.testing import assert_allclose, assert_equal, collective_assert
from disttensor.testing.strategies import dist_arrays, distributions, process_grids

parallel = pytest.mark.parallel([1, 2, 3, 4])

DTYPES = [np.float32, np.float64, np.int32, np.complex128, np.bool_]

# ------------------------------------------------------------------ helpers


class Check:
    """Collects local failures; :meth:`done` raises the same AssertionError on every rank."""

    def __init__(self, comm=None):
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.errors = []

    def __call__(self, ok, msg):
        if not ok:
            self.errors.append(str(msg))

    def equal(self, got, want, what):
        """Exact equality of values, shape and dtype."""
        if got is None or not hasattr(got, "shape"):
            self.errors.append(f"{what}: got {got!r}, expected an array")
            return
        got = np.asarray(got)
        ok = got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want)
        if not ok:
            self.errors.append(
                f"{what}: got {got.dtype}{got.shape} {got.ravel()[:8]}, "
                f"expected {want.dtype}{want.shape} {want.ravel()[:8]}"
            )

    def done(self):
        n = len(self.errors)
        collective_assert(not n, f"{n} failures, first ones:\n" + "\n".join(self.errors[:6]),
                          self.comm)


def factorizations(n, k):
    """All ordered k-tuples of positive ints whose product is n."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return [t for t in itertools.product(divisors, repeat=k) if math.prod(t) == n]


def grid_shapes(n, max_ndim=3):
    return [s for k in range(1, max_ndim + 1) for s in factorizations(n, k)]


def axes_assignments(ndim, gndim):
    """Every way to give each grid axis to one array dimension or to none (replicas).

    A dimension that gets several grid axes is tried with them in increasing
    and in decreasing order (the block index is row-major in the listed order).
    """
    seen = set()
    for targets in itertools.product(range(-1, ndim), repeat=gndim):
        per_dim = [tuple(a for a, t in enumerate(targets) if t == d) for d in range(ndim)]
        for flip in (False, True):
            axes = tuple(
                None if not e else e[0] if len(e) == 1 else (e[::-1] if flip else e)
                for e in per_dim
            )
            if axes not in seen:
                seen.add(axes)
                yield axes


def as_tuple(entry):
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, int) else tuple(entry)


def ref_slices(shape, gshape, axes, splits, rank):
    """Reference block of ``rank``: numpy.array_split along each dim, row-major grid coords."""
    coords = np.unravel_index(rank, gshape)
    if axes is None:  # Distribution's default: dimension i split by grid axis i
        axes = [i if i < len(gshape) else None for i in range(len(shape))]
    out = []
    for d, n in enumerate(shape):
        e = as_tuple(axes[d])
        p = math.prod(gshape[a] for a in e)
        cuts = None if splits is None else splits[d]
        sizes = [len(x) for x in np.array_split(np.arange(n), p if cuts is None else cuts)]
        bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        i = int(np.ravel_multi_index([coords[a] for a in e], [gshape[a] for a in e])) if e else 0
        out.append(slice(int(bounds[i]), int(bounds[i + 1])))
    return tuple(out)


def layout(shape, gshape, axes, splits):
    """Which global box every rank holds, by the reference (hashable)."""
    return shape, tuple(
        tuple((s.start, s.stop) for s in ref_slices(shape, gshape, axes, splits, r))
        for r in range(math.prod(gshape))
    )


def check_layout(dist, axes, splits, chk):
    """Pure check of every rank's block against the reference (no communication)."""
    for r in range(dist.nprocs):
        want = ref_slices(dist.global_shape, dist.grid_shape, axes, splits, r)
        got = dist.local_slices(r)
        chk(got == want, f"{dist}: local_slices({r}) {got} != reference {want}")


def sample(shape, dtype=np.float64, seed=0):
    """A deterministic global array (identical on every rank)."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(-(2**20), 2**20, shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def unique_values(shape):
    """Global array whose every element differs (a misplaced block cannot go unnoticed)."""
    return np.arange(math.prod(shape), dtype=np.float64).reshape(shape) + 0.5


def roundtrip(a, dist, chk, root, spec=None):
    """Scatter ``a`` and gather it back in every way; ``spec`` = (axes, splits) for layout."""
    comm = dist.grid.comm
    rank = comm.Get_rank()
    sl = dist.local_slices()
    if spec is not None:
        want = ref_slices(a.shape, dist.grid_shape, spec[0], spec[1], rank)
        chk(sl == want, f"{dist}: local_slices {sl} != reference {want}")
    x = DistArray.from_global(a, dist)
    chk.equal(x.local, a[sl], f"from_global(no root) local, {dist}")
    chk(x.shape == a.shape and x.local_shape == a[sl].shape and x.dtype == a.dtype,
        f"{dist}: shape {x.shape} local_shape {x.local_shape} dtype {x.dtype}")
    chk(not np.shares_memory(x.local, a), f"{dist}: from_global must copy")
    chk.equal(x.to_global(), a, f"to_global(), {dist}")
    y = x.to_global(root=root)
    if rank == root:
        chk.equal(y, a, f"to_global(root={root}) on root, {dist}")
    else:
        chk(y is None, f"to_global(root={root}) on rank {rank} gave {type(y)}, {dist}")
    z = DistArray.from_global(a if rank == root else None, dist, root=root)
    chk.equal(z.local, a[sl], f"from_global(root={root}) local, {dist}")
    chk(z.dist == dist, f"from_global(root={root}) has dist {z.dist}, expected {dist}")


ND_SHAPES = {1: (7,), 2: (5, 4), 3: (5, 3, 4), 4: (3, 4, 2, 3), 5: (3, 2, 3, 2, 2)}


# ------------------------------------------------------------------ scatter / gather


@parallel
@pytest.mark.parametrize("ndim", [1, 2, 3, 4, 5])
def test_roundtrip_every_split_pattern(ndim):
    comm = MPI.COMM_WORLD
    shape = ND_SHAPES[ndim]
    a = unique_values(shape)
    chk = Check()
    seen = set()
    # 3-axis grids only for small arrays: the number of patterns grows as (ndim + 1) ** 3.
    # Grids with more axes come first, so that their layouts are the ones communicated.
    max_gndim = 3 if ndim <= 3 else 2
    for gshape in sorted(grid_shapes(comm.size, max_gndim), key=len, reverse=True):
        grid = ProcessGrid(gshape)
        for axes in axes_assignments(ndim, len(gshape)):
            dist = Distribution(shape, grid, axes)
            check_layout(dist, axes, None, chk)
            # moving data: once per distinct layout (collectives are slow on oversubscribed cores)
            key = layout(shape, gshape, axes, None)
            if key not in seen:
                roundtrip(a, dist, chk, root=len(seen) % comm.size)
                seen.add(key)
    chk(len(seen) > 1 or comm.size == 1, "no cases")
    chk.done()


@parallel
def test_roundtrip_default_axes_and_create():
    comm = MPI.COMM_WORLD
    chk = Check()
    for gshape in grid_shapes(comm.size):
        for ndim in (1, 2, 3):
            shape = ND_SHAPES[ndim]
            grid = ProcessGrid(gshape)
            default = [i if i < len(gshape) else None for i in range(ndim)]
            roundtrip(unique_values(shape), Distribution(shape, grid), chk, root=comm.size - 1,
                      spec=(default, None))
    for ndim in (1, 2, 3):
        grid = ProcessGrid.create(ndim)
        chk(math.prod(grid.shape) == comm.size and grid.ndim == ndim, f"create: {grid}")
        roundtrip(unique_values(ND_SHAPES[ndim]), Distribution(ND_SHAPES[ndim], grid), chk, 0)
    chk.done()


def _cut_patterns(n, p):
    """All non-decreasing cut tuples for small n and p, else a selection incl. empty blocks."""
    if math.comb(n + p - 1, p - 1) <= 60:
        return [list(c) for c in itertools.combinations_with_replacement(range(n + 1), p - 1)]
    rng = np.random.default_rng(n * 100 + p)
    pats = [[0] * (p - 1), [n] * (p - 1), [n // 2] * (p - 1)]
    pats += [sorted(rng.integers(0, n + 1, p - 1).tolist()) for _ in range(8)]
    return pats


@parallel
def test_roundtrip_uneven_and_empty_blocks():
    comm = MPI.COMM_WORLD
    P = comm.size
    chk = Check()
    seen = set()

    def run(shape, grid, axes, splits):
        dist = Distribution(shape, grid, axes, splits)
        check_layout(dist, axes, splits, chk)
        key = layout(shape, grid.shape, axes, splits)
        if key not in seen:
            roundtrip(unique_values(shape), dist, chk, len(seen) % P)
            seen.add(key)

    grid1 = ProcessGrid((P,))
    # 1-D: every cut pattern of a short array, then a few of a longer one
    for n in (0, 1, 3, 10):
        for cuts in _cut_patterns(n, P):
            run((n,), grid1, [0], [cuts])
    # 2-D: explicit splits on both dims, with replicas and permuted axes
    for gshape in grid_shapes(P, 2):
        grid = ProcessGrid(gshape)
        for axes in axes_assignments(2, len(gshape)):
            shape = (5, 3)
            nb = [math.prod(gshape[a] for a in as_tuple(e)) for e in axes]
            pats = [_cut_patterns(n, p) for n, p in zip(shape, nb)]
            for k in range(2):
                splits = [
                    None if p == 1 and k == 0 else pat[(k * 7 + d) % len(pat)]
                    for d, (p, pat) in enumerate(zip(nb, pats))
                ]
                run(shape, grid, axes, splits)
    # 3-D with an empty block in every split dim
    grid = ProcessGrid(max(factorizations(P, 2), key=min))
    run((4, 6, 3), grid, (1, None, 0), [[0] * (grid.shape[1] - 1), None, [3] * (grid.shape[0] - 1)])
    # zero-size global arrays
    for shape in [(0,), (0, 3), (3, 0), (2, 0, 3)]:
        for gshape in [(P,), factorizations(P, 2)[-1]]:
            run(shape, ProcessGrid(gshape), None, None)
    chk(len(seen) > 5, f"only {len(seen)} layouts")
    chk.done()


@parallel
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_roundtrip_dtypes(dtype):
    comm = MPI.COMM_WORLD
    P = comm.size
    shape = (6, 5, 3)
    a = sample(shape, dtype, seed=3)
    chk = Check()
    dists = []
    for gshape in grid_shapes(P, 2):
        grid = ProcessGrid(gshape)
        multi = (None, None, tuple(range(len(gshape))))
        dists += [
            (Distribution(shape, grid), None),
            (Distribution(shape, grid, (None, 0, None)), ((None, 0, None), None)),
            (Distribution(shape, grid, multi), (multi, None)),
        ]
    cuts = [6] * (P - 1)
    dists.append((Distribution(shape, ProcessGrid((P,)), splits=[cuts, None, None]),
                  ([0, None, None], [cuts, None, None])))
    for i, (dist, spec) in enumerate(dists):
        roundtrip(a, dist, chk, root=i % P, spec=spec)
    chk.done()
    x = DistArray.from_global(a, dists[0][0])
    assert_equal(x, a)  # the library's own collective assertion agrees


@parallel
def test_from_global_accepts_any_memory_layout():
    comm = MPI.COMM_WORLD
    P = comm.size
    base = unique_values((8, 6))
    inputs = {
        "fortran": base.T,  # F-contiguous
        "strided": base[::2, ::-1],  # neither C- nor F-contiguous, negative stride
        "list": base[:3].tolist(),
        "int-list": [[1, 2, 3], [4, 5, 6]],
    }
    chk = Check()
    for name, arr in inputs.items():
        want = np.array(arr)
        dist = Distribution(want.shape, ProcessGrid((1, P)), (1, 0))
        x = DistArray.from_global(arr, dist)
        chk.equal(x.to_global(), want, f"{name} without root")
        root = P - 1
        y = DistArray.from_global(arr if comm.rank == root else None, dist, root=root)
        chk.equal(y.local, want[dist.local_slices()], f"{name} with root")
        chk.equal(y.to_global(), want, f"{name} with root, gathered")
    chk.done()


@parallel
def test_zero_dim_array_without_root():
    comm = MPI.COMM_WORLD
    a = np.array(2.5)
    dist = Distribution((), ProcessGrid((comm.size,)))
    x = DistArray.from_global(a, dist)
    chk = Check()
    chk.equal(x.local, a, "0-d local")
    chk.equal(x.to_global(), a, "0-d to_global")
    y = x.to_global(root=comm.size - 1)
    if comm.rank == comm.size - 1:
        chk.equal(y, a, "0-d to_global(root)")
    else:
        chk(y is None, "0-d to_global(root) on non-root")
    chk.done()


@parallel
def test_zero_dim_array_from_root():
    comm = MPI.COMM_WORLD
    dist = Distribution((), ProcessGrid((comm.size,)))
    chk = Check()
    # several values, so that memory freed by an earlier test cannot hold the right one
    for i, value in enumerate([3.5, 7.25, -1.0, np.int64(11), np.complex64(2 - 1j)]):
        root = i % comm.size
        a = np.asarray(value)
        x = DistArray.from_global(a if comm.rank == root else None, dist, root=root)
        chk.equal(x.local, a, f"0-d from_global(root={root})")
    chk.done()


@parallel
@settings(max_examples=20)
@given(dist=distributions(grid=process_grids(), max_dims=4, max_side=6), data=st.data())
def test_hypothesis_roundtrip(dist, data):
    dtype = data.draw(st.sampled_from([np.float64, np.int32, np.complex128]))
    a = data.draw(hnp.arrays(dtype, dist.global_shape))
    if np.dtype(dtype).kind in "fc":
        a = np.nan_to_num(a)  # NaN != NaN would defeat the exact comparison
    root = data.draw(st.integers(0, dist.nprocs - 1))
    chk = Check()
    axes = dist.axes
    splits = [list(b[1:-1]) for b in dist.boundaries]
    # the layout must follow the (normalised) spec: array_split of the cuts, row-major coords
    roundtrip(a, dist, chk, root, spec=(axes, splits))
    chk(dist.nreplicas * math.prod(dist.nblocks) == dist.nprocs, f"{dist}: replicas")
    chk.done()


@parallel
@settings(max_examples=15)
@given(x=dist_arrays(dtype=np.int32))
def test_dist_arrays_strategy_blocks_are_consistent(x):
    comm = x.comm
    g = x.to_global()
    chk = Check()
    chk.equal(x.local, g[x.dist.local_slices()], "local vs gathered global")
    g0 = comm.bcast(g if comm.rank == 0 else None, root=0)
    chk.equal(g, g0, "every rank gathers the same global array")
    y = x.to_global(root=comm.size - 1)
    if comm.rank == comm.size - 1:
        chk.equal(y, g, "to_global(root)")
    chk.done()


# ------------------------------------------------------------------ creation


def _layouts(P):
    """(dist keyword arguments, reference axes or None) for the creation functions."""
    out = [({}, None)]  # default grid: 1-D over COMM_WORLD, first dim split
    for gshape in grid_shapes(P, 2):
        grid = ProcessGrid(gshape)
        out.append(({"grid": grid}, "default"))
        out.append(({"grid": grid, "axes": (None, tuple(range(len(gshape))))},
                    (None, tuple(range(len(gshape))))))
    return out


@parallel
def test_constant_creation():
    comm = MPI.COMM_WORLD
    P = comm.size
    shape = (7, 5)
    chk = Check()
    for kw, axes in _layouts(P):
        for dtype in DTYPES:
            cases = [
                (dt.zeros(shape, dtype, **kw), np.zeros(shape, dtype)),
                (dt.ones(shape, dtype, **kw), np.ones(shape, dtype)),
                (dt.full(shape, 3, dtype, **kw), np.full(shape, 3, dtype)),
            ]
            for x, want in cases:
                chk.equal(x.local, want[x.dist.local_slices()], f"constant local {dtype} {kw}")
                if dtype is np.int32:  # gathering: once per layout is enough
                    chk.equal(x.to_global(), want, f"constant {dtype} {kw}")
            e = dt.empty(shape, dtype, **kw)
            chk(e.shape == shape and e.dtype == np.dtype(dtype), f"empty {e}")
        x = dt.zeros(shape, **kw)
        gshape = x.dist.grid_shape
        if axes is None:  # default grid: first dim over all of COMM_WORLD
            want = ref_slices(shape, (P,), (0, None), None, comm.rank)
        elif axes == "default":
            want = ref_slices(shape, gshape, (0, 1 if len(gshape) > 1 else None), None, comm.rank)
        else:
            want = ref_slices(shape, gshape, axes, None, comm.rank)
        chk(x.dist.local_slices() == want, f"layout {kw}: {x.dist.local_slices()} != {want}")
    # dtype inference of full() follows numpy.full
    for value in (7, 2.5, True, 1 + 2j, np.float32(1.5)):
        x = dt.full((4, 3), value)
        chk.equal(x.to_global(), np.full((4, 3), value), f"full({value!r})")
    # dist= and shape= given together, splits= through creation keywords
    dist = Distribution((9,), ProcessGrid((P,)), splits=[[9] * (P - 1)])
    chk.equal(dt.ones((9,), dist=dist).to_global(), np.ones(9), "ones(dist=)")
    chk.equal(dt.ones(dist).to_global(), np.ones(9), "ones(Distribution)")
    y = dt.full((9,), -1, np.int32, grid=ProcessGrid((P,)), splits=[[0] * (P - 1)])
    chk(y.local_shape == ((9,) if comm.rank == P - 1 else (0,)), f"splits=: {y.local_shape}")
    chk.equal(y.to_global(), np.full(9, -1, np.int32), "full(splits=)")
    chk.done()


ARANGE_CASES = [
    ((10,), {}),
    ((3, 17), {}),
    ((3, 17, 4), {}),
    ((10, 0, -3), {}),
    ((0, 1, 0.1), {}),
    ((2.5, 9), {}),
    ((-4.0, 4.0, 0.5), {}),
    ((5, 5), {}),
    ((1,), {}),
    ((2,), {}),
    ((0, 10), {"dtype": np.float32}),
    ((0, 12, 2), {"dtype": np.int32}),
]


@parallel
def test_arange_matches_numpy():
    comm = MPI.COMM_WORLD
    P = comm.size
    chk = Check()
    grids = [{}, {"grid": ProcessGrid((P,))}, {"grid": ProcessGrid((1, P))}]
    for args, kw in ARANGE_CASES:
        want = np.arange(*args, **kw)
        for gkw in grids:
            x = dt.arange(*args, **kw, **gkw)
            g = x.to_global()
            ok = g.shape == want.shape and g.dtype == want.dtype and np.allclose(g, want)
            chk(ok, f"arange{args} {kw} {gkw}: {g.dtype}{g.shape} {g[:6]} vs "
                f"{want.dtype}{want.shape} {want[:6]}")
            want_sl = ref_slices(want.shape, x.dist.grid_shape, (0,), None, comm.rank)
            chk(x.dist.local_slices() == want_sl, f"arange{args} layout {gkw}")
            chk(x.local.shape == want[want_sl].shape, f"arange{args} local shape")
    # uneven explicit splits
    cuts = [min(k, 3) for k in range(P - 1)]
    x = dt.arange(11, grid=ProcessGrid((P,)), splits=[cuts])
    chk.equal(x.to_global(), np.arange(11), "arange(splits=)")
    chk.done()
    assert_allclose(dt.arange(-1.0, 1.0, 0.125), np.arange(-1.0, 1.0, 0.125), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="step"):
        dt.arange(0, 10, 0)


@parallel
def test_asarray():
    comm = MPI.COMM_WORLD
    P = comm.size
    a = unique_values((6, 4))
    chk = Check()
    x = dt.asarray(a)
    chk.equal(x.to_global(), a, "asarray(a)")
    chk(x.dist.local_slices() == ref_slices(a.shape, (P,), (0, None), None, comm.rank),
        "asarray default layout")
    grid = ProcessGrid((1, P))
    dist = Distribution(a.shape, grid, (None, 1))
    y = dt.asarray(a, dist)
    chk.equal(y.local, a[ref_slices(a.shape, (1, P), (None, 1), None, comm.rank)], "asarray dist")
    chk(dt.asarray(y) is y and dt.asarray(y, dist) is y, "asarray of a DistArray copies")
    z = dt.asarray(y, Distribution(a.shape, grid, ((1, 0), None)))
    chk.equal(z.to_global(), a, "asarray(DistArray, other dist)")
    chk(z.dist.axes == ((1, 0), None), f"asarray redistributed to {z.dist}")
    for root in range(P):
        w = dt.asarray(a if comm.rank == root else None, root=root)
        chk.equal(w.to_global(), a, f"asarray(root={root})")
        v = dt.asarray(a if comm.rank == root else None, root=root, grid=grid, axes=(1, None))
        chk(v.dist.axes == (1, None) and v.dist.grid_shape == (1, P), f"asarray(grid=) {v}")
        chk.equal(v.to_global(), a, f"asarray(root={root}, grid=)")
    chk.done()


@parallel
def test_astype_and_copy():
    comm = MPI.COMM_WORLD
    a = sample((5, 6), np.float64, seed=1) * 10
    dist = Distribution(a.shape, ProcessGrid((comm.size, 1)), ((0, 1), None))
    x = DistArray.from_global(a, dist)
    chk = Check()
    for dtype in DTYPES:
        y = x.astype(dtype)
        chk.equal(y.to_global(), a.astype(dtype), f"astype({np.dtype(dtype).name})")
        chk(y.dist == x.dist, "astype keeps the distribution")
    chk(x.astype(np.float64, copy=False) is x, "astype(same, copy=False) returns self")
    y = x.astype(np.float64)
    chk(y is not x and not np.shares_memory(y.local, x.local), "astype() copies")
    c = x.copy()
    chk(c.dist == x.dist and not np.shares_memory(c.local, x.local), "copy shares memory")
    c.local[...] = -1
    chk.equal(x.to_global(), a, "modifying a copy changes the original")
    chk.equal(c.to_global(), np.full_like(a, -1), "copy")
    chk.done()


@parallel
def test_make_distribution_conflicts_raise_everywhere():
    P = MPI.COMM_WORLD.size
    dist = Distribution((6,), ProcessGrid((P,)))
    with pytest.raises(ValueError, match="does not match"):
        dt.zeros((7,), dist=dist)
    with pytest.raises(ValueError, match="not both"):
        dt.zeros((6,), dist=dist, grid=ProcessGrid((P,)))
    with pytest.raises(ValueError, match="not both"):
        dt.ones(dist, axes=(None,))


# ------------------------------------------------------------------ random


def _rng_layouts(shape, P):
    out = []
    for gshape in grid_shapes(P, 2):
        grid = ProcessGrid(gshape)
        out += [Distribution(shape, grid, axes) for axes in
                itertools.islice(axes_assignments(len(shape), len(gshape)), 0, None, 3)]
    out.append(Distribution(shape, ProcessGrid((P,)), splits=[[1] * (P - 1), None, None]))
    return out


def _draws(rng, **kw):
    shape = kw.pop("shape", None)
    args = () if shape is None else (shape,)
    return [
        rng.random(*args, **kw),
        rng.standard_normal(*args, **kw),
        rng.integers(-5, 1000, *args, **kw),
        rng.uniform(-2.0, 3.0, *args, **kw),
        rng.normal(1.0, 0.5, *args, **kw),
        rng.random(*args, np.float32, **kw),
        rng.integers(7, None, *args, np.int8, **kw),
    ]


@parallel
def test_random_is_independent_of_distribution_and_world_size():
    comm = MPI.COMM_WORLD
    shape = (11, 6, 3)
    # reference: the same generator computed by this rank alone (a 1-process grid on COMM_SELF)
    solo = ProcessGrid((1,), MPI.COMM_SELF)
    want = [x.local.copy() for x in _draws(dt.random.default_rng(1234), shape=shape, grid=solo)]
    chk = Check()
    chk(all(w.shape == shape for w in want), "solo shapes")
    # every rank computed the reference alone: they must agree bit for bit
    ref0 = comm.bcast(want if comm.rank == 0 else None, root=0)
    for w, r in zip(want, ref0):
        chk.equal(w, r, "single-rank reference differs between ranks")
    for dist in _rng_layouts(shape, comm.size):
        got = _draws(dt.random.default_rng(1234), shape=dist)
        for i, (x, w) in enumerate(zip(got, want)):
            sl = ref_slices(shape, dist.grid_shape, dist.axes, [list(b[1:-1]) for b in
                                                                dist.boundaries], comm.rank)
            chk.equal(x.local, w[sl], f"draw {i} local, {dist}")
        chk.equal(got[0].to_global(), want[0], f"gathered draw, {dist}")
    # default grid and keyword layout
    got = _draws(dt.random.default_rng(1234), shape=shape)
    for i, (x, w) in enumerate(zip(got, want)):
        chk.equal(x.to_global(), w, f"draw {i}, default grid")
    chk.done()


@parallel
def test_random_streams_differ():
    shape = (40, 25)
    chk = Check()
    r1 = dt.random.default_rng(5)
    a, b = r1.random(shape).to_global(), r1.random(shape).to_global()
    c = dt.random.default_rng(6).random(shape).to_global()
    d = dt.random.default_rng(5).random(shape).to_global()
    chk.equal(d, a, "same seed, same first array")
    for x, y, what in [(a, b, "successive draws"), (a, c, "seeds 5 and 6")]:
        chk(np.count_nonzero(x == y) < 5, f"{what} coincide")
        corr = np.corrcoef(x.ravel(), y.ravel())[0, 1]
        chk(abs(corr) < 0.1, f"{what} correlate: {corr}")
    # neighbouring elements are uncorrelated
    corr = np.corrcoef(a.ravel()[:-1], a.ravel()[1:])[0, 1]
    chk(abs(corr) < 0.1, f"lag-1 correlation {corr}")
    chk.done()


@parallel
def test_random_ranges_and_statistics():
    P = MPI.COMM_WORLD.size
    shape = (200, 100)
    n = math.prod(shape)
    kw = {"grid": ProcessGrid((1, P)), "axes": (None, 1)}
    rng = dt.random.default_rng(2024)
    chk = Check()

    u = rng.random(shape, **kw).to_global()
    chk(u.dtype == np.float64 and u.min() >= 0 and u.max() < 1, "random range")
    chk(abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005, f"random mean {u.mean()}")
    hist = np.bincount((u * 10).astype(int).ravel(), minlength=10)
    chk(np.all(np.abs(hist - n / 10) < 6 * math.sqrt(n / 10)), f"random histogram {hist}")

    f = rng.random(shape, np.float32, **kw).to_global()
    chk(f.dtype == np.float32 and f.min() >= 0 and f.max() < 1, "float32 random range")

    v = rng.uniform(-2.0, 3.0, shape, **kw).to_global()
    chk(v.min() >= -2.0 and v.max() < 3.0 and abs(v.mean() - 0.5) < 0.05, "uniform range")

    z = rng.standard_normal(shape, **kw).to_global()
    chk(z.dtype == np.float64 and np.all(np.isfinite(z)), "standard_normal finite")
    chk(abs(z.mean()) < 0.04 and abs(z.std() - 1) < 0.03, f"normal {z.mean()} {z.std()}")
    frac = np.mean(np.abs(z) < 1)  # 68.27 % within one sigma
    chk(abs(frac - 0.6827) < 0.02, f"normal |z| < 1 fraction {frac}")
    z32 = rng.standard_normal(shape, np.float32, **kw).to_global()
    chk(z32.dtype == np.float32 and abs(z32.std() - 1) < 0.03, "float32 standard_normal")
    w = rng.normal(5.0, 2.0, shape, **kw).to_global()
    chk(abs(w.mean() - 5) < 0.1 and abs(w.std() - 2) < 0.06, f"normal(5, 2) {w.mean()}")

    k = rng.integers(-3, 4, shape, **kw).to_global()
    chk(k.dtype == np.int64 and k.min() == -3 and k.max() == 3, f"integers range {k.min()}")
    counts = np.bincount((k + 3).ravel(), minlength=7)
    chk(np.all(np.abs(counts - n / 7) < 6 * math.sqrt(n / 7)), f"integers counts {counts}")
    k5 = rng.integers(5, shape=shape, **kw).to_global()
    chk(k5.min() == 0 and k5.max() == 4, "integers(5) is [0, 5)")
    k8 = rng.integers(-100, 100, shape, np.int8, **kw).to_global()
    chk(k8.dtype == np.int8 and k8.min() >= -100 and k8.max() < 100, "int8 integers")
    big = rng.integers(0, 2**32, shape, **kw).to_global()
    chk(big.min() >= 0 and big.max() < 2**32 and big.max() > 2**31, "integers(0, 2**32)")
    neg = rng.integers(-(2**40), -(2**40) + 10, shape, **kw).to_global()
    chk(neg.min() == -(2**40) and neg.max() == -(2**40) + 9, "integers far from 0")
    chk.done()

    for low, high in [(3, 3), (5, 2), (0, 2**32 + 1), (0, 0)]:
        with pytest.raises(ValueError, match="integers"):
            rng.integers(low, high, (4,))


# ------------------------------------------------------------------ bad input


@parallel
def test_from_global_shape_mismatch_without_root():
    P = MPI.COMM_WORLD.size
    dist = Distribution((6, 4), ProcessGrid((P,)))
    for bad in (np.zeros((6, 5)), np.zeros((4, 6)), np.zeros(24), np.zeros((6, 4, 1))):
        with pytest.raises(ValueError, match="does not match"):
            DistArray.from_global(bad, dist)


@parallel
def test_from_global_shape_mismatch_with_root_raises_on_every_rank():
    comm = MPI.COMM_WORLD
    P = comm.size
    a = unique_values((6, 4))
    dist = Distribution(a.shape, ProcessGrid((P,)))
    for root in range(P):
        for bad in (np.zeros((6, 5)), np.zeros(24), np.array(1.0)):
            # only the root holds the (wrong) array; the others must learn it and raise too
            with pytest.raises(ValueError, match="does not match"):
                DistArray.from_global(bad if comm.rank == root else None, dist, root=root)
            # non-root ranks holding a correct array change nothing: the root's is used
            with pytest.raises(ValueError, match="does not match"):
                DistArray.from_global(bad if comm.rank == root else a, dist, root=root)
        # and the converse works: the root's array is right, the others' arguments are ignored
        x = DistArray.from_global(a if comm.rank == root else np.zeros(3), dist, root=root)
        assert_equal(x, a)


@parallel
def test_from_global_bad_root():
    P = MPI.COMM_WORLD.size
    a = unique_values((4,))
    dist = Distribution(a.shape, ProcessGrid((P,)))
    for root in (-1, P, P + 3, 0.0, "0"):
        with pytest.raises(ValueError, match="root"):
            DistArray.from_global(a, dist, root=root)
    x = DistArray.from_global(a, dist)
    for root in (-1, P):
        with pytest.raises(ValueError, match="root"):
            x.to_global(root=root)
    assert_equal(x, a)  # still usable: nothing half-communicated


@parallel
def test_process_grid_size_mismatch():
    comm = MPI.COMM_WORLD
    P = comm.size
    for shape in [(P + 1,), (P, 2), (2 * P,), (1, 1, P + 1)]:
        with pytest.raises(ValueError, match=f"communicator has {P}"):
            ProcessGrid(shape)
    with pytest.raises(ValueError, match=">= 1"):
        ProcessGrid((0,))
    with pytest.raises(ValueError, match=">= 1"):
        ProcessGrid((P, -1))
    with pytest.raises(TypeError, match="grid shape"):
        ProcessGrid((float(P),))
    g = ProcessGrid(P)
    chk = Check()
    chk(g.shape == (P,) and g.size == P and g.rank == comm.rank, f"ProcessGrid({P}): {g}")
    chk(g.coords == np.unravel_index(comm.rank, g.shape), "coords")
    chk.done()


@parallel
def test_distribution_bad_axes_on_a_process_grid():
    P = MPI.COMM_WORLD.size
    grid = ProcessGrid((P, 1))
    for axes, match in [
        ((0,), "axes has 1 entries"),
        ((0, 0), "at most one dimension"),
        ((0, 2), "grid axis 2 does not exist"),
        (((0, 1), 1), "at most one dimension"),
    ]:
        with pytest.raises(ValueError, match=match):
            Distribution((4, 4), grid, axes)
    with pytest.raises(ValueError, match="cut indices"):
        Distribution((4, 4), grid, (0, None), splits=[[1] * P, None])


@parallel
def test_from_local():
    comm = MPI.COMM_WORLD
    P = comm.size
    a = unique_values((7, 3))
    chk = Check()
    for gshape in grid_shapes(P, 2):
        for axes in axes_assignments(2, len(gshape)):
            dist = Distribution(a.shape, ProcessGrid(gshape), axes)
            block = a[ref_slices(a.shape, gshape, axes, None, comm.rank)]
            x = DistArray.from_local(block, dist)
            chk(not np.shares_memory(x.local, block), "from_local must copy")
            chk.equal(x.to_global(), a, f"from_local {dist}")
    chk.done()
    # every rank passes a block of the wrong shape: every rank raises (no communication)
    dist = Distribution(a.shape, ProcessGrid((P,)))
    wrong = np.zeros(tuple(n + 1 for n in dist.local_shape()))
    with pytest.raises(ValueError, match="local block has shape"):
        DistArray.from_local(wrong, dist)


@parallel
def test_arrays_need_a_process_grid():
    P = MPI.COMM_WORLD.size
    pure = Distribution((4,), (P,))
    with pytest.raises(ValueError, match="ProcessGrid"):
        DistArray.from_global(np.zeros(4), pure)
    with pytest.raises(ValueError, match="ProcessGrid"):
        dt.zeros(pure)
    with pytest.raises(TypeError, match="Distribution"):
        DistArray.from_global(np.zeros(4), (4,))


@parallel
def test_redistribute_to_another_shape_raises():
    P = MPI.COMM_WORLD.size
    grid = ProcessGrid((P,))
    x = dt.zeros((4, 3), grid=grid)
    with pytest.raises(ValueError, match="global shapes"):
        x.redistribute(Distribution((3, 4), grid))
    assert_equal(x, np.zeros((4, 3)))


@parallel
def test_non_native_byte_order_is_converted():
    comm = MPI.COMM_WORLD
    grid = ProcessGrid((comm.size,))
    a = np.arange(7.0).astype(">f8")
    empty_first = Distribution((7,), grid, splits=[[0] * (comm.size - 1)])
    for dist in (Distribution((7,), grid), empty_first):
        x = DistArray.from_global(a, dist)
        g = x.to_global()
        y = DistArray.from_global(a if comm.rank == 0 else None, dist, root=0).to_global(root=0)
        collective_assert(x.dtype.isnative and np.array_equal(g, a)
                          and (comm.rank != 0 or np.array_equal(y, a)), "byte-swapped input")
