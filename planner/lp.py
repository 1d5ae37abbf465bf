"""A small linear-model builder for the layout MILP, handed to HiGHS as one matrix.

PuLP builds every `a + b` as a new dictionary subclass with checks and copies; on a layout
MILP that was about 80% of a solve's time (64 blocks on 512 GPUs: 10 s of model building
around 1.7 s in HiGHS). Here an affine expression is a plain dict from column index to
coefficient plus a constant, and `solve_highs` passes HiGHS the whole model at once. The model
HiGHS sees is the one PuLP gave it: columns sorted by name, rows in the order they were
added, zero coefficients dropped, so the same problem gets the same answer. CBC, the
fallback solver, still goes through PuLP (`to_pulp`).
"""

from __future__ import annotations

import math

INF = math.inf


class Var:
    """One column: a name, bounds and whether it is integral."""

    __slots__ = ("index", "name", "lo", "hi", "integer", "model")

    def __init__(self, model: "Model", index: int, name: str, lo, hi, integer: bool):
        self.model, self.index, self.name = model, index, name
        self.lo, self.hi, self.integer = lo, hi, integer

    def lin(self) -> "Lin":
        return Lin({self.index: 1.0}, 0.0)

    def value(self) -> float:
        return self.model.values[self.index]

    __hash__ = object.__hash__

    # Arithmetic goes through Lin.
    def __add__(self, o): return self.lin() + o
    def __radd__(self, o): return self.lin() + o
    def __sub__(self, o): return self.lin() - o
    def __rsub__(self, o): return as_lin(o) - self.lin()
    def __mul__(self, k): return self.lin() * k
    __rmul__ = __mul__
    def __neg__(self): return self.lin() * -1
    def __le__(self, o): return self.lin() <= o
    def __ge__(self, o): return self.lin() >= o
    def __eq__(self, o): return self.lin() == o          # noqa: E704 - a row, as in PuLP


class Lin:
    """sum(coef * column) + const."""

    __slots__ = ("terms", "const")

    def __init__(self, terms: dict[int, float] | None = None, const: float = 0.0):
        self.terms = terms if terms is not None else {}
        self.const = const

    def copy(self) -> "Lin":
        return Lin(dict(self.terms), self.const)

    def add_in_place(self, o, sign: float = 1.0) -> "Lin":
        if isinstance(o, Lin):
            t = self.terms
            for i, c in o.terms.items():
                t[i] = t.get(i, 0.0) + sign * c
            self.const += sign * o.const
        elif isinstance(o, Var):
            self.terms[o.index] = self.terms.get(o.index, 0.0) + sign
        elif isinstance(o, (int, float)):
            self.const += sign * o
        else:
            raise TypeError(f"cannot add {type(o).__name__} to a linear expression")
        return self

    def __add__(self, o): return self.copy().add_in_place(o)
    __radd__ = __add__
    def __sub__(self, o): return self.copy().add_in_place(o, -1.0)
    def __rsub__(self, o): return as_lin(o).add_in_place(self, -1.0)
    def __neg__(self): return self * -1

    def __mul__(self, k):
        if not isinstance(k, (int, float)):
            raise TypeError("a linear expression multiplies by numbers only")
        return Lin({i: c * k for i, c in self.terms.items()}, self.const * k)
    __rmul__ = __mul__

    def __le__(self, o): return Row(self - o, "<=")
    def __ge__(self, o): return Row(self - o, ">=")
    def __eq__(self, o): return Row(self - o, "==")         # noqa: E704
    __hash__ = None

    def value(self, values: list[float]) -> float:
        return self.const + sum(c * values[i] for i, c in self.terms.items())


class Row:
    """lin (sense) 0."""

    __slots__ = ("lin", "sense")

    def __init__(self, lin: Lin, sense: str):
        self.lin, self.sense = lin, sense

    def bounds(self) -> tuple[float, float]:
        rhs = -self.lin.const
        return {"<=": (-INF, rhs), ">=": (rhs, INF), "==": (rhs, rhs)}[self.sense]


def as_lin(x) -> Lin:
    if isinstance(x, Lin):
        return x.copy()
    if isinstance(x, Var):
        return x.lin()
    return Lin({}, float(x))


def lin_sum(items) -> Lin:
    """sum() of expressions, variables and numbers, built in place."""
    out = Lin()
    for x in items:
        out.add_in_place(x)
    return out


class Model:
    """Columns, rows (named, in order) and an objective to minimise."""

    def __init__(self, name: str):
        self.name = name
        self.columns: list[Var] = []
        self.rows: list[tuple[str, Row]] = []
        self.objective = Lin()
        self.values: list[float] = []
        self.row_duals: list[float] = []          # solve_highs(relax=True): each row's dual

    def add_variable(self, name: str, lo: float | None = None, hi: float | None = None, cat: str = "Continuous") -> Var:
        integer = cat in ("Integer", "Binary")
        if cat == "Binary":
            lo, hi = 0, 1
        v = Var(self, len(self.columns), name, lo if lo is not None else -INF, hi if hi is not None else INF, integer)
        self.columns.append(v)
        return v

    def __iadd__(self, item):
        what, name = item
        if isinstance(what, Row):
            self.rows.append((name, what))
        else:
            self.objective = as_lin(what)
        return self

    def upper_bound(self, expr) -> float:
        """The largest value an affine expression can take within its variables' bounds."""
        expr = as_lin(expr)
        ub = expr.const
        for i, c in expr.terms.items():
            v = self.columns[i]
            ub += c * (v.hi if c > 0 else v.lo)
        return ub

    def objective_value(self) -> float:
        return self.objective.value(self.values)

    # -- solving ---------------------------------------------------------------------------
    def _order(self) -> list[Var]:
        """Columns as PuLP hands them to a solver: sorted by name."""
        return sorted(self.columns, key=lambda v: v.name)

    def solve_highs(self, time_limit: float | None, gap_rel: float, relax: bool = False) -> str:
        """"optimal", "infeasible", "time limit" (a layout, not proven best) or HiGHS's status.
        `relax`: the linear relaxation (every column continuous), its rows' duals kept in
        `row_duals` (in row order)."""
        import numpy as np
        import highspy

        order = self._order()
        pos = {v.index: k for k, v in enumerate(order)}
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = len(order), len(self.rows)
        inf = highspy.kHighsInf
        lp.col_cost_ = np.array([self.objective.terms.get(v.index, 0.0) for v in order], dtype=np.float64)
        lp.col_lower_ = np.array([max(v.lo, -inf) for v in order], dtype=np.float64)
        lp.col_upper_ = np.array([min(v.hi, inf) for v in order], dtype=np.float64)
        lower, upper, starts, index, value = [], [], [0], [], []
        for _, row in self.rows:
            for i, c in row.lin.terms.items():
                if c != 0:
                    index.append(pos[i])
                    value.append(c)
            starts.append(len(index))
            lo, hi = row.bounds()
            lower.append(max(lo, -inf))
            upper.append(min(hi, inf))
        lp.row_lower_ = np.array(lower, dtype=np.float64)
        lp.row_upper_ = np.array(upper, dtype=np.float64)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(value, dtype=np.float64)
        lp.integrality_ = [highspy.HighsVarType.kInteger if v.integer and not relax else highspy.HighsVarType.kContinuous
                           for v in order]
        h = highspy.Highs()
        for key, val in (("output_flag", False), ("mip_rel_gap", gap_rel), ("mip_abs_gap", 0.0),
                         ("threads", 1), ("random_seed", 1)):
            h.setOptionValue(key, val)
        if time_limit is not None:
            h.setOptionValue("time_limit", float(time_limit))
        h.passModel(lp)
        h.run()
        status = h.getModelStatus()
        S = highspy.HighsModelStatus
        col = list(h.getSolution().col_value)
        self.row_duals = list(h.getSolution().row_dual) if relax else []
        self.values = [0.0] * len(self.columns)
        if len(col) == len(order):
            for k, v in enumerate(order):
                self.values[v.index] = col[k]
        if status == S.kOptimal:
            return "optimal"
        if status in (S.kInfeasible, S.kUnboundedOrInfeasible):
            return "infeasible"
        if status in (S.kTimeLimit, S.kIterationLimit, S.kInterrupt) and h.getInfo().primal_solution_status == 2:
            return "time limit"
        return h.modelStatusToString(status).lower()

    def to_pulp(self):
        """The same problem as a PuLP one (for CBC), and its variables by column index."""
        import pulp
        prob = pulp.LpProblem(self.name, pulp.LpMinimize)
        vs = {v.index: prob.add_variable(v.name, None if v.lo == -INF else v.lo, None if v.hi == INF else v.hi,
                                         cat="Integer" if v.integer else "Continuous") for v in self.columns}
        def expr(lin: Lin):
            return pulp.LpAffineExpression([(vs[i], c) for i, c in lin.terms.items()], constant=lin.const)
        prob += expr(self.objective), "objective"
        sense = {"<=": pulp.LpConstraintLE, ">=": pulp.LpConstraintGE, "==": pulp.LpConstraintEQ}
        for name, row in self.rows:
            prob += pulp.LpConstraint(expr(row.lin), sense[row.sense], name=name, rhs=0)
        return prob, vs
