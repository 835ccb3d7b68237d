"""Exact MAC/FLOP counts for the linear-algebra rules (rules/linalg.toml), worked out by hand.

LAPACK ops are counted at LAWN 41's operation counts ("Operation counts for LAPACK"; the same
polynomials as LAPACK++'s include/lapack/flops.hh and MAGMA's testing/flops.h): per matrix, a
number of multiplications (mul) and of additions (add). fxflops reports MACs = add and
FLOPs = mul + add, times the batch. Iterative methods (eigh, svd, eig) use Golub & Van Loan's
approximate flop counts; there MACs = half the batch's count, rounded down, and FLOPs = 2 x MACs.

Every expected number below is the published polynomial evaluated by hand in the comment next to
it, never copied from fxflops' output; `test_hand_arithmetic_matches_the_published_polynomials`
re-evaluates the same polynomials, written as published with exact fractions, to catch slips in
that arithmetic. Notation: n for an n x n matrix, (m, n) for m x n, b the batch size, r the number
of right-hand sides (RHS) over the whole batch.
"""

from __future__ import annotations

import collections
import math
import warnings
from fractions import Fraction as Fr

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fxflops
from tests.oracle import TRSM_COUNTS
from fxflops.api import UnknownOpsWarning
from tests.test_rules_exact import Fn, _estimate

METHODS = ("eager", "export", "trace")

# --- the published polynomials, as printed (exact fractions): (multiplications, additions) -------


def getrf(m, n):
    # LAWN 41 gives m >= n; m < n is its transpose (as LAPACK++ writes it)
    big, k = Fr(max(m, n)), Fr(min(m, n))
    return (big * k**2 / 2 - k**3 / 6 + big * k / 2 - k**2 / 2 + 2 * k / 3,
            big * k**2 / 2 - k**3 / 6 - big * k / 2 + k / 6)


def getri(n):
    n = Fr(n)
    return 2 * n**3 / 3 + n**2 / 2 + 5 * n / 6, 2 * n**3 / 3 - 3 * n**2 / 2 + 5 * n / 6


def getrs(n, r):
    return r * n * n, r * n * (n - 1)


def potrf(n):
    n = Fr(n)
    return n**3 / 6 + n**2 / 2 + n / 3, n**3 / 6 - n / 6


def potri(n):
    n = Fr(n)
    return n**3 / 3 + n**2 + 2 * n / 3, n**3 / 3 - n**2 / 2 + n / 6


def potrs(n, r):  # sytrs is the same
    return r * n * (n + 1), r * n * (n - 1)


def sytrf(n):
    n = Fr(n)
    return n**3 / 6 + n**2 / 2 + 10 * n / 3, n**3 / 6 - n / 6


def geqrf(m, n):
    m, n = Fr(m), Fr(n)
    if m > n:
        return m * n**2 - n**3 / 3 + m * n + n**2 / 2 + 23 * n / 6, m * n**2 - n**3 / 3 + n**2 / 2 + 5 * n / 6
    return (n * m**2 - m**3 / 3 + 2 * n * m - m**2 / 2 + 23 * m / 6,
            n * m**2 - m**3 / 3 + n * m - m**2 / 2 + 5 * m / 6)


def gelqf(m, n):  # only the m <= n case is used (lstsq of a wide matrix)
    m, n = Fr(m), Fr(n)
    return n * m**2 - m**3 / 3 + 2 * n * m - m**2 / 2 + 29 * m / 6, n * m**2 - m**3 / 3 + m**2 / 2 + 5 * m / 6


def orgqr(m, n, k):
    m, n, k = Fr(m), Fr(n), Fr(k)
    return (2 * m * n * k - (m + n) * k**2 + 2 * k**3 / 3 + 2 * n * k - k**2 - 5 * k / 3,
            2 * m * n * k - (m + n) * k**2 + 2 * k**3 / 3 + n * k - m * k + k / 3)


def ormqr(left, m, n, k):
    m, n, k = Fr(m), Fr(n), Fr(k)
    if left:
        return 2 * n * m * k - n * k**2 + 2 * n * k, 2 * n * m * k - n * k**2 + n * k
    return 2 * n * m * k - m * k**2 + m * k + n * k - k**2 / 2 + k / 2, 2 * n * m * k - m * k**2 + m * k


def trsm(n, r):  # left side: r RHS, n x n triangle
    return Fr(r * n * (n + 1), 2), Fr(r * n * (n - 1), 2)


def lapack(*parts, batch=1):
    """(MACs, FLOPs) of the summed (mul, add) counts: MACs = add, FLOPs = mul + add."""
    mul, add = sum(p[0] for p in parts), sum(p[1] for p in parts)
    assert mul.denominator == add.denominator == 1, "LAWN 41 counts whole operations"
    return batch * int(add), batch * int(mul + add)


def gvl(flops_per_matrix, batch=1):
    """(MACs, FLOPs) of an approximate count: MACs = half the batch's count rounded down, FLOPs = 2 MACs."""
    macs = math.floor(Fr(batch) * Fr(flops_per_matrix) / 2)
    return macs, 2 * macs


def svd_gvl(m, n, vectors):
    """Golub & Van Loan's table, the cheaper of Golub-Reinsch and R-SVD (big = max, k = min)."""
    big, k = Fr(max(m, n)), Fr(min(m, n))
    if vectors == "none":
        return min(4 * big * k**2 - 4 * k**3 / 3, 2 * big * k**2 + 2 * k**3)
    if vectors == "reduced":
        return min(14 * big * k**2 + 8 * k**3, 6 * big * k**2 + 20 * k**3)
    return min(4 * big**2 * k + 8 * big * k**2 + 9 * k**3, 4 * big**2 * k + 22 * k**3)


# --- inputs -------------------------------------------------------------------------------------


def _gen():
    return torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=_gen())


def spd(*batch, n):
    """A well-conditioned symmetric positive definite (..., n, n): X X^T + n I."""
    x = torch.randn(*batch, n, n, generator=_gen())
    return x @ x.mT + n * torch.eye(n)


def upper(*batch, n):
    return torch.triu(spd(*batch, n=n))


def case(id, model, inputs, macs, flops, rule, lawn, methods=METHODS):
    """model/inputs: factories. lawn: the same (MACs, FLOPs) from the published polynomials."""
    return pytest.param(model, inputs, macs, flops, rule, lawn, methods, id=id)


# ------------------------------------------------------------------------------------------------
# Triangular solves (trsm): per RHS n(n+1)/2 multiplications/divisions, n(n-1)/2 additions, so
# MACs = r n(n-1)/2 and FLOPs = r n^2 = numel(out) * n; a unit diagonal saves the n divisions.
# Counted in both presets (FlopCounterMode has no formula; the oracle below gives it one).
# ------------------------------------------------------------------------------------------------

TRSM_CASES = [
    # A (2,4,4), B (2,4,3): r = 2*3 = 6 columns, 4*3/2 = 6 MACs each; FLOPs 2*36 + 24 = 96 = 24 * 4
    case("solve_triangular", lambda: Fn(lambda a, b: torch.linalg.solve_triangular(a, b, upper=True), 2),
         lambda: (upper(2, n=4), rand(2, 4, 3)), 6 * 6, 2 * 6 * 6 + 2 * 4 * 3, "triangular_solve",
         lapack(trsm(4, 2 * 3))),
    # left=False: X A = B with A (2,3,3), X (2,4,3): one RHS per row, r = 2*4 = 8, 3*2/2 = 3 MACs each
    case("solve_triangular_right",
         lambda: Fn(lambda a, b: torch.linalg.solve_triangular(a, b, upper=True, left=False), 2),
         lambda: (upper(2, n=3), rand(2, 4, 3)), 8 * 3, 2 * 8 * 3 + 2 * 4 * 3, "triangular_solve",
         lapack(trsm(3, 2 * 4))),
    # unit diagonal, A (2,3,3), B (2,3,5): r = 10, 3 MACs each, and no divisions: mul = add = r n(n-1)/2
    case("solve_triangular_unit",
         lambda: Fn(lambda a, b: torch.linalg.solve_triangular(a, b, upper=True, unitriangular=True), 2),
         lambda: (upper(2, n=3), rand(2, 3, 5)), 10 * 3, 2 * 10 * 3, "triangular_solve",
         lapack((trsm(3, 10)[1], trsm(3, 10)[1]))),
    # B broadcast over A's batch: A (3,5,5), B (1,5,2) -> X (3,5,2): r = 6, 5*4/2 = 10 MACs each;
    # FLOPs 2*60 + 30 = 150 = 30 * 5
    case("solve_triangular_broadcast",
         lambda: Fn(lambda a, b: torch.linalg.solve_triangular(a, b, upper=True), 2),
         lambda: (upper(3, n=5), rand(1, 5, 2)), 6 * 10, 2 * 6 * 10 + 3 * 5 * 2, "triangular_solve",
         lapack(trsm(5, 3 * 2))),
    # the deprecated torch.triangular_solve(B, A): A (2,4,4), B (2,4,3) as in the first case
    case("triangular_solve_deprecated", lambda: Fn(lambda b, a: torch.triangular_solve(b, a).solution, 2),
         lambda: (rand(2, 4, 3), upper(2, n=4)), 6 * 6, 2 * 6 * 6 + 2 * 4 * 3, "triangular_solve",
         lapack(trsm(4, 2 * 3))),
]

# ------------------------------------------------------------------------------------------------
# Factorizations and solves at LAWN 41's exact counts. Torch preset: 0, like FlopCounterMode.
# ------------------------------------------------------------------------------------------------

LAPACK_CASES = [
    # potrf n=3: mul 27/6 + 9/2 + 3/3 = 10, add 27/6 - 3/6 = 4; b = 2
    case("cholesky", lambda: Fn(torch.linalg.cholesky), lambda: (spd(2, n=3),),
         2 * 4, 2 * (10 + 4), "cholesky", lapack(potrf(3), batch=2)),
    # potrf n=4: mul 64/6 + 16/2 + 4/3 = 20, add 64/6 - 4/6 = 10; b = 3
    case("cholesky_ex", lambda: Fn(lambda a: torch.linalg.cholesky_ex(a).L), lambda: (spd(3, n=4),),
         3 * 10, 3 * (20 + 10), "cholesky", lapack(potrf(4), batch=3)),
    # getrf n=4: mul 64/2 - 64/6 + 16/2 - 16/2 + 8/3 = 24, add 64/2 - 64/6 - 16/2 + 4/6 = 14; b = 2
    case("lu_factor", lambda: Fn(lambda a: torch.linalg.lu_factor(a).LU), lambda: (spd(2, n=4),),
         2 * 14, 2 * (24 + 14), "lu", lapack(getrf(4, 4), batch=2)),
    # the deprecated torch.lu: aten._lu_with_info under export, linalg_lu_factor_ex under eager and trace
    case("lu_deprecated", lambda: Fn(lambda a: torch.lu(a)[0]), lambda: (spd(2, n=4),),
         2 * 14, 2 * (24 + 14), "lu", lapack(getrf(4, 4), batch=2)),
    # getrf (5,3): M=5, k=3: mul 45/2 - 27/6 + 15/2 - 9/2 + 2 = 23, add 45/2 - 27/6 - 15/2 + 3/6 = 11
    case("lu_tall", lambda: Fn(lambda a: torch.linalg.lu(a).U), lambda: (rand(2, 5, 3),),
         2 * 11, 2 * (23 + 11), "lu", lapack(getrf(5, 3), batch=2)),
    # getrf (3,4): M=4, k=3: mul 36/2 - 27/6 + 12/2 - 9/2 + 2 = 17, add 36/2 - 27/6 - 12/2 + 3/6 = 8
    case("lu_factor_wide", lambda: Fn(lambda a: torch.linalg.lu_factor_ex(a).LU), lambda: (rand(2, 3, 4),),
         2 * 8, 2 * (17 + 8), "lu", lapack(getrf(3, 4), batch=2)),
    # det = getrf n=3: mul 27/2 - 27/6 + 9/2 - 9/2 + 2 = 11, add 27/2 - 27/6 - 9/2 + 3/6 = 5
    case("det", lambda: Fn(torch.linalg.det), lambda: (spd(2, n=3),),
         2 * 5, 2 * (11 + 5), "det", lapack(getrf(3, 3), batch=2)),
    case("det_method", lambda: Fn(lambda a: a.det()), lambda: (spd(2, n=3),),
         2 * 5, 2 * (11 + 5), "det", lapack(getrf(3, 3), batch=2)),
    # slogdet = getrf n=4 (24, 14 as above)
    case("slogdet", lambda: Fn(lambda a: torch.linalg.slogdet(a).logabsdet), lambda: (spd(2, n=4),),
         2 * 14, 2 * (24 + 14), "det", lapack(getrf(4, 4), batch=2)),
    # gesv: getrf n=3 (11, 5) per matrix + getrs with r = 2*2 = 4: mul 4*9 = 36, add 4*3*2 = 24
    case("solve", lambda: Fn(torch.linalg.solve, 2), lambda: (spd(2, n=3), rand(2, 3, 2)),
         2 * 5 + 24, 2 * (11 + 5) + 36 + 24, "solve", lapack(getrf(3, 3), getrs(3, 2), batch=2)),
    case("solve_ex", lambda: Fn(lambda a, b: torch.linalg.solve_ex(a, b).result, 2),
         lambda: (spd(2, n=3), rand(2, 3, 2)),
         2 * 5 + 24, 2 * (11 + 5) + 36 + 24, "solve", lapack(getrf(3, 3), getrs(3, 2), batch=2)),
    # left=False: X A = B, B (2,2,3): one RHS per row, r = 4 again
    case("solve_right", lambda: Fn(lambda a, b: torch.linalg.solve(a, b, left=False), 2),
         lambda: (spd(2, n=3), rand(2, 2, 3)),
         2 * 5 + 24, 2 * (11 + 5) + 36 + 24, "solve", lapack(getrf(3, 3), getrs(3, 2), batch=2)),
    # vector RHS: A (2,4,4), B (2,4) -> r = 2: getrf n=4 (24, 14) twice + mul 2*16, add 2*4*3
    case("solve_vector", lambda: Fn(torch.linalg.solve, 2), lambda: (spd(2, n=4), rand(2, 4)),
         2 * 14 + 2 * 12, 2 * (24 + 14) + 2 * 16 + 2 * 12, "solve",
         lapack(getrf(4, 4), getrs(4, 1), batch=2)),
    # one A (4,4) for a batch of B (3,4,2): A is factored once, r = 6
    case("solve_broadcast", lambda: Fn(torch.linalg.solve, 2), lambda: (spd(n=4), rand(3, 4, 2)),
         14 + 6 * 12, 24 + 14 + 6 * 16 + 6 * 12, "solve", lapack(getrf(4, 4), getrs(4, 6))),
    # inv = getrf + getri. n=3: getri mul 18 + 9/2 + 15/6 = 25, add 18 - 27/2 + 15/6 = 7
    case("inv", lambda: Fn(torch.linalg.inv), lambda: (spd(2, n=3),),
         2 * (5 + 7), 2 * (11 + 5 + 25 + 7), "inv", lapack(getrf(3, 3), getri(3), batch=2)),
    # n=4: getri mul 128/3 + 8 + 20/6 = 54, add 128/3 - 24 + 20/6 = 22
    case("inverse_method", lambda: Fn(lambda a: a.inverse()), lambda: (spd(2, n=4),),
         2 * (14 + 22), 2 * (24 + 14 + 54 + 22), "inv", lapack(getrf(4, 4), getri(4), batch=2)),
    case("inv_ex", lambda: Fn(lambda a: torch.linalg.inv_ex(a).inverse), lambda: (spd(2, n=4),),
         2 * (14 + 22), 2 * (24 + 14 + 54 + 22), "inv", lapack(getrf(4, 4), getri(4), batch=2)),
    # potrs n=3, r = 2*2 = 4: mul 4*3*4 = 48, add 4*3*2 = 24
    case("cholesky_solve", lambda: Fn(torch.cholesky_solve, 2),
         lambda: (rand(2, 3, 2), torch.linalg.cholesky(spd(2, n=3))), 24, 48 + 24, "cholesky_solve",
         lapack(potrs(3, 4))),
    # getrs n=4, r = 2*3 = 6: mul 6*16 = 96, add 6*4*3 = 72
    case("lu_solve", lambda: Fn(torch.linalg.lu_solve, 3),
         lambda: (*torch.linalg.lu_factor(spd(2, n=4)), rand(2, 4, 3)), 72, 96 + 72, "lu_solve",
         lapack(getrs(4, 6))),
    # left=False, B (2,3,4): one RHS per row, r = 6 again
    case("lu_solve_right", lambda: Fn(lambda lu, p, b: torch.linalg.lu_solve(lu, p, b, left=False), 3),
         lambda: (*torch.linalg.lu_factor(spd(2, n=4)), rand(2, 3, 4)), 72, 96 + 72, "lu_solve",
         lapack(getrs(4, 6))),
    case("lu_solve_deprecated", lambda: Fn(torch.lu_solve, 3),
         lambda: (rand(2, 4, 3), *torch.linalg.lu_factor(spd(2, n=4))), 72, 96 + 72, "lu_solve",
         lapack(getrs(4, 6))),
    # potri n=4: mul 64/3 + 16 + 8/3 = 40, add 64/3 - 8 + 4/6 = 14
    case("cholesky_inverse", lambda: Fn(torch.cholesky_inverse), lambda: (torch.linalg.cholesky(spd(2, n=4)),),
         2 * 14, 2 * (40 + 14), "cholesky_inverse", lapack(potri(4), batch=2)),
    # sytrf n=3: mul 27/6 + 9/2 + 10 = 19, add 27/6 - 3/6 = 4
    case("ldl_factor", lambda: Fn(lambda a: torch.linalg.ldl_factor(a).LD), lambda: (spd(2, n=3),),
         2 * 4, 2 * (19 + 4), "ldl_factor", lapack(sytrf(3), batch=2)),
    # sytrs n=4, r = 6: mul 6*4*5 = 120, add 6*4*3 = 72
    case("ldl_solve", lambda: Fn(torch.linalg.ldl_solve, 3),
         lambda: (*torch.linalg.ldl_factor(spd(2, n=4)), rand(2, 4, 3)), 72, 120 + 72, "ldl_solve",
         lapack(potrs(4, 6))),
    # geqrf (5,3), m > n: mul 45 - 9 + 15 + 9/2 + 23/2 = 67, add 45 - 9 + 9/2 + 5/2 = 43;
    # reduced Q = orgqr(5,3,3): mul 90 - 72 + 18 + 18 - 9 - 5 = 40, add 90 - 72 + 18 + 9 - 15 + 1 = 31
    case("qr_tall_reduced", lambda: Fn(lambda a: torch.linalg.qr(a).Q), lambda: (rand(2, 5, 3),),
         2 * (43 + 31), 2 * (67 + 43 + 40 + 31), "qr", lapack(geqrf(5, 3), orgqr(5, 3, 3), batch=2)),
    # complete Q = orgqr(5,5,3): mul 150 - 90 + 18 + 30 - 9 - 5 = 94, add 150 - 90 + 18 + 15 - 15 + 1 = 79
    case("qr_tall_complete", lambda: Fn(lambda a: torch.linalg.qr(a, mode="complete").Q),
         lambda: (rand(2, 5, 3),), 2 * (43 + 79), 2 * (67 + 43 + 94 + 79), "qr",
         lapack(geqrf(5, 3), orgqr(5, 5, 3), batch=2)),
    # mode 'r': geqrf only
    case("qr_r", lambda: Fn(lambda a: torch.linalg.qr(a, mode="r").R), lambda: (rand(2, 5, 3),),
         2 * 43, 2 * (67 + 43), "qr", lapack(geqrf(5, 3), batch=2)),
    # geqrf (3,4), m <= n: mul 36 - 9 + 24 - 9/2 + 23/2 = 58, add 36 - 9 + 12 - 9/2 + 5/2 = 37;
    # Q = orgqr(3,3,3): mul 54 - 54 + 18 + 18 - 9 - 5 = 22, add 54 - 54 + 18 + 9 - 9 + 1 = 19
    case("qr_wide", lambda: Fn(lambda a: torch.linalg.qr(a).R), lambda: (rand(2, 3, 4),),
         2 * (37 + 19), 2 * (58 + 37 + 22 + 19), "qr", lapack(geqrf(3, 4), orgqr(3, 3, 3), batch=2)),
    # geqrf has no meta kernel export can use; fake tensors and a real forward capture it: (5,3) as above
    case("geqrf", lambda: Fn(lambda a: torch.geqrf(a).a), lambda: (rand(2, 5, 3),),
         2 * 43, 2 * (67 + 43), "geqrf", lapack(geqrf(5, 3), batch=2), methods=("eager", "trace")),
    # orgqr(5,3,2): mul 60 - 32 + 16/3 + 12 - 4 - 10/3 = 38, add 60 - 32 + 16/3 + 6 - 10 + 2/3 = 30
    case("householder_product", lambda: Fn(torch.linalg.householder_product, 2),
         lambda: (rand(2, 5, 3), rand(2, 2)), 2 * 30, 2 * (38 + 30), "householder_product",
         lapack(orgqr(5, 3, 2), batch=2)),
    # ormqr left, C (5,2), k = 3: mul 60 - 18 + 12 = 54, add 60 - 18 + 6 = 48
    case("ormqr_left", lambda: Fn(torch.ormqr, 3), lambda: (rand(2, 5, 3), rand(2, 3), rand(2, 5, 2)),
         2 * 48, 2 * (54 + 48), "ormqr", lapack(ormqr(True, 5, 2, 3), batch=2)),
    # ormqr right, C (2,5), k = 3: mul 60 - 18 + 6 + 15 - 9/2 + 3/2 = 60, add 60 - 18 + 6 = 48
    case("ormqr_right", lambda: Fn(lambda a, t, c: torch.ormqr(a, t, c, left=False), 3),
         lambda: (rand(2, 5, 3), rand(2, 3), rand(2, 2, 5)),
         2 * 48, 2 * (60 + 48), "ormqr", lapack(ormqr(False, 2, 5, 3), batch=2)),
    # lstsq (the QR count, gels) of (5,3) with 2 RHS: geqrf (67, 43) + ormqr(L, 5, 2, 3) (54, 48)
    # + trsm n=3, 2 RHS (mul 2*6 = 12, add 2*3 = 6). Its outputs' sizes depend on the driver, so
    # its output sizes depend on the values (rank): only a real forward (trace) captures it
    case("lstsq_tall", lambda: Fn(lambda a, b: torch.linalg.lstsq(a, b).solution, 2),
         lambda: (rand(2, 5, 3), rand(2, 5, 2)), 2 * (43 + 48 + 6), 2 * (67 + 43 + 54 + 48 + 12 + 6), "lstsq",
         lapack(geqrf(5, 3), ormqr(True, 5, 2, 3), trsm(3, 2), batch=2), methods=("trace",)),
    # wide (3,5), minimum norm: gelqf(3,5): mul 45 - 9 + 30 - 9/2 + 29/2 = 76, add 45 - 9 + 9/2 + 5/2
    # = 43; ormlq = ormqr(L, 5, 2, 3) (54, 48); trsm n=3, 2 RHS (12, 6)
    case("lstsq_wide", lambda: Fn(lambda a, b: torch.linalg.lstsq(a, b).solution, 2),
         lambda: (rand(2, 3, 5), rand(2, 3, 2)), 2 * (43 + 48 + 6), 2 * (76 + 43 + 54 + 48 + 12 + 6), "lstsq",
         lapack(gelqf(3, 5), ormqr(True, 5, 2, 3), trsm(3, 2), batch=2), methods=("trace",)),
]

# ------------------------------------------------------------------------------------------------
# Iterative methods: Golub & Van Loan's approximate flop counts, MACs = half (rounded down).
# eigvalsh/svdvals/eigvals are composite ops: under a dispatch mode torch runs them through the
# kernels that also compute vectors, but every method records the composite call, so the values-only
# figure counts.
# ------------------------------------------------------------------------------------------------

ITERATIVE_CASES = [
    # symmetric QR with Q: 9n^3 = 9*27 = 243 per matrix, b = 2: 486 FLOPs
    case("eigh", lambda: Fn(lambda a: torch.linalg.eigh(a).eigenvectors), lambda: (spd(2, n=3),),
         486 // 2, 486, "eigh", gvl(9 * 27, batch=2)),
    # eigenvalues only: 4n^3/3 = 4*64/3 per matrix, b = 2: 512/3 = 170.67 -> MACs 85, FLOPs 170
    case("eigvalsh", lambda: Fn(torch.linalg.eigvalsh), lambda: (spd(2, n=4),),
         85, 170, "eigh", gvl(Fr(4 * 64, 3), batch=2)),
    # (5,3), M=5, k=3, full U, V: min(4*25*3 + 8*5*9 + 9*27, 4*25*3 + 22*27) = min(903, 894) = 894
    case("svd_full", lambda: Fn(lambda a: torch.linalg.svd(a).U), lambda: (rand(2, 5, 3),),
         894, 2 * 894, "svd", gvl(svd_gvl(5, 3, "full"), batch=2)),
    # reduced: min(14*5*9 + 8*27, 6*5*9 + 20*27) = min(846, 810) = 810
    case("svd_reduced", lambda: Fn(lambda a: torch.linalg.svd(a, full_matrices=False).U), lambda: (rand(2, 5, 3),),
         810, 2 * 810, "svd", gvl(svd_gvl(5, 3, "reduced"), batch=2)),
    # square (4,4), full: min(4*16*4 + 8*4*16 + 9*64, 4*16*4 + 22*64) = min(1344, 1664) = 1344
    case("svd_square", lambda: Fn(lambda a: torch.linalg.svd(a).S), lambda: (rand(2, 4, 4),),
         1344, 2 * 1344, "svd", gvl(svd_gvl(4, 4, "full"), batch=2)),
    # deprecated torch.svd, some=True: the reduced SVD (810 as above)
    case("svd_deprecated", lambda: Fn(lambda a: torch.svd(a).U), lambda: (rand(2, 5, 3),),
         810, 2 * 810, "svd", gvl(svd_gvl(5, 3, "reduced"), batch=2)),
    # values only, (3,4): M=4, k=3: min(4*4*9 - 4*27/3, 2*4*9 + 2*27) = min(108, 126) = 108
    case("svdvals", lambda: Fn(torch.linalg.svdvals), lambda: (rand(2, 3, 4),),
         108, 2 * 108, "svd", gvl(svd_gvl(3, 4, "none"), batch=2)),
    # Francis QR with Schur vectors: 25n^3 = 25*27 = 675 per matrix, b = 2
    case("eig", lambda: Fn(lambda a: torch.linalg.eig(a).eigenvalues), lambda: (rand(2, 3, 3),),
         675, 2 * 675, "eig", gvl(25 * 27, batch=2)),
    # eigenvalues only: 10n^3 = 270 per matrix
    case("eigvals", lambda: Fn(torch.linalg.eigvals), lambda: (rand(2, 3, 3),),
         270, 2 * 270, "eig", gvl(10 * 27, batch=2)),
]

ALL_CASES = TRSM_CASES + LAPACK_CASES + ITERATIVE_CASES
CASE_ARGS = ("make_model", "make_inputs", "macs", "flops", "rule", "lawn", "methods")


def _method_cases(cases):
    return [pytest.param(method, *p.values, id=f"{p.id}-{method}")
            for p in cases for method in METHODS if method in p.values[6]]


@pytest.mark.parametrize(CASE_ARGS, ALL_CASES)
def test_hand_arithmetic_matches_the_published_polynomials(make_model, make_inputs, macs, flops, rule, lawn,
                                                           methods):
    assert (macs, flops) == lawn


@pytest.mark.parametrize(("method", *CASE_ARGS), _method_cases(ALL_CASES))
def test_linalg_counts(method, make_model, make_inputs, macs, flops, rule, lawn, methods):
    est = _estimate(make_model(), make_inputs(), method=method)
    assert est.method == method
    assert (est.total_macs, est.total_flops) == (macs, flops)
    # one op node carries the whole cost: composite ops are not counted twice
    assert est.by_rule[rule].count == 1, est.by_rule
    assert (est.by_rule[rule].macs, est.by_rule[rule].flops) == (macs, flops)


class _AllLapack(torch.nn.Module):
    """Every LAPACK case in one forward, so the torch preset is checked with one capture per method."""

    def __init__(self, cases):
        super().__init__()
        self.models = torch.nn.ModuleList(p.values[0]() for p in cases)
        self.inputs = [p.values[1]() for p in cases]

    def forward(self, x):  # x: export wants an input; the cases' inputs are held as constants
        return [model(*inputs) for model, inputs in zip(self.models, self.inputs)], x + 0


@pytest.mark.parametrize("method", METHODS)
def test_torch_preset_counts_lapack_as_flop_counter_mode_does(method):
    # LAPACK factorizations are not matrix products: FlopCounterMode counts 0, and so does the preset
    cases = [p for p in LAPACK_CASES + ITERATIVE_CASES if method in p.values[6]]
    model, inputs = _AllLapack(cases), (rand(3),)
    with FlopCounterMode(display=False) as mode:
        model(*inputs)
    assert mode.get_total_flops() == 0
    est = _estimate(model, inputs, method=method, conventions="torch")
    assert (est.total_macs, est.total_flops) == (0, 0)
    for rule, count in collections.Counter(p.values[4] for p in cases).items():
        assert est.by_rule[rule].count == count, (rule, est.by_rule)  # every op was there, counted as 0


# --- triangular solves in the torch preset, against FlopCounterMode given a trsm formula ----------


@pytest.mark.parametrize(("method", *CASE_ARGS), _method_cases(TRSM_CASES))
def test_triangular_solve_counts_in_both_presets(method, make_model, make_inputs, macs, flops, rule, lawn,
                                                 methods):
    model, inputs = make_model(), make_inputs()
    with FlopCounterMode(display=False) as mode:
        model(*inputs)
    assert mode.get_total_flops() == 0  # FlopCounterMode misses it ...
    with FlopCounterMode(display=False, custom_mapping=TRSM_COUNTS) as mode:
        model(*inputs)
    assert mode.get_total_flops() == flops  # ... and agrees once it has the trsm count
    deepspeed = _estimate(model, inputs, method=method)
    torch_preset = _estimate(model, inputs, method=method, conventions="torch")
    assert deepspeed.total_flops == torch_preset.total_flops == flops
    assert torch_preset.total_macs == macs


def test_matrix_exp_is_reported_unknown():
    # Its Pade degree and number of squarings depend on the matrix norm: no count from shapes alone.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownOpsWarning)
        est = fxflops.estimate(Fn(torch.linalg.matrix_exp), (spd(2, n=3) / 10,), method="export")
    assert [u.op for u in est.unknown] == ["aten.linalg_matrix_exp.default"]
