"""PipeDream's hierarchical dynamic program (SOSP 2019, section 3.1), pipeplan cost model.

Modules: ``context`` (settings, results, band arrays, device tables), ``tables`` (the
exact level/stage/top tables), ``bounds`` (what prunes them), ``solve`` (the passes),
``reconstruct`` (the chosen stage tree).

Over a DAG the positions 0..N below are the cut states of ``planner.cuts`` (downsets
sorted by size; the prefixes of the topological order for a chain) and a "range [i, j)"
is the stage state j minus state i, valid only when state i is a proper subset of state
j (``nested_states``; invalid entries stay inf, so every recurrence below only chains
nested states). Lengths are counted in states.

Level 0 is one device; level k groups ``u_k`` units of level k-1 (``D_{k-1}`` devices
each) joined by bandwidth ``B_k``. For a layer range ``[i, j)`` on ``m`` units of level k::

    T_k(i, j, m)  = max( U_{k-1}(i, j) / m,  2(m-1)/m * P(i, j) / B_k )
    A_k(i, j, m)  = min( T_k(i, j, m),
                         min_{s, m'} max( T_k(i, s, m'), 2 a_s / B_k, A_k(s, j, m - m') ) )

where ``U_{k-1}`` is the best time of the range on one whole unit of level k-1
(``U_0`` = its compute on one device) and ``a_s`` the bytes crossing the cut before
layer s. The first stage is split off (a suffix recursion), so a stage always knows how
many devices come after it: that is what its 1F1B-RR memory depends on.

Memory (exact for 1F1B-RR). A stage with n replicas and ``after`` devices from it to the
end of the pipeline keeps ``ceil(after / n)`` minibatches in flight. Inside a unit that
is itself one of m' replicas of an outer stage with ``tail`` devices behind it, this is
``ceil((tau + after_local) / n_local)`` with ``tau = ceil(tail / m')`` (an integer:
ceil(ceil(x) / r) = ceil(x / r)), so the tables of level k are computed per ``tau``.
``tau`` is exact when the topology has at most ``EXACT_TAU_WORLD`` devices; beyond that
it is rounded up to a power of two (conservative: a plan that fits under the rounded
count fits). Tables are monotone in ``tau``: when the device tables at tau = 0 and at
the largest tau agree, one table serves all. Otherwise level 1 of a two-level topology
fills just the taus the top reads, and every other level shares one table when its
tables at tau = 0 and at the largest tau agree. 1F1B-flush is charged one whole minibatch of activations
(an upper bound); the final plan's memory is recomputed exactly (``partition``).

Pruning (exact). Every formula is a min of maxes, so given a limit ``V`` >= the optimum
an entry matters only up to the largest value a plan of time <= V can use there: ``V``
at the top, ``limit_k = limit_{k+1} * F`` below, F the most units of level k+1 whose
all-reduce of the range fits in ``limit_{k+1}`` (``_unit_limits``). Entries whose lower
bound (``compute / devices``, with the all-reduce for one stage) exceeds their limit are
left at inf: entries <= their limit stay exact and the others can only grow, so the
optimum and every tie the reconstruction compares are unchanged. This bounds the range
length per unit count: ``Lt(f)`` for one stage on f units, ``Lr(m)`` for a pipeline on
m units, ``width[k]`` for a whole table. Two more bounds of the same kind skip work:

- *Complement* (``_live``): a range on d devices (R copies) leaves the rest of the
  compute C to the other W - dR devices, so it needs C - c <= V (W - dR) as well as
  c <= V d R. Near a balanced plan (V close to C / W) few ranges pass both, and a
  (units, first-stage units) pair with few live choices is combined sparsely
  (``_combine_live``) instead of densely.
- *Regions* (``_top_regions``): the level below the top is read at tau > 0 only by
  first top stages after a suffix start that a plan <= V allows, so those tables are
  filled only over the states such stages span.

``solve`` runs a pass at a lower bound of the answer (cheap: balanced plans leave few
live choices; the bound is the top level's own DP over relaxed units, ``_relaxed_top_ms``),
and if that does not prove its answer, a pass at 1.25 times that bound, then one at the
best plan known (its answer, or pure data parallelism's time,
``data_parallel_bound_ms``), which is exact (a finite answer of a pruned pass is the
time of a real plan). The top band
(longest top-level stage) follows from that bound (``band_bound``).

The reconstruction follows the tau each table was filled with (rounded, or 0 for a
table shared across tau), so it retraces exactly the choices the tables hold.

Running time O(sum_k T_k sum_{f < m <= u_k} N Lt(f) Lr(m - f) Q^2), T_k the number of
tau tables of level k, numpy over (length, start) with the start innermost, in blocks
of ``COLUMN_BLOCK`` starts; memory
O(N width_k u_k Q) per table; Q = max stages (1 when unbounded). ``solve`` estimates the
tables' bytes before a pass allocates them (``table_bytes``) and refuses in one line
above ``PIPEPLAN_PLANNER_MEMORY`` (default 8 GiB): a 20,000-layer chain on 4,096
devices would need about 20 GiB. Without pruning
Lt = Lr = width = band. On the 1,000-layer chain x 4,096 devices of
``bench/bench_planner.py`` about 0.4-1.3 s (16 s to 10 min before pruning).
"""

from pipeplan.planner.dp.bounds import planner_memory_limit, table_bytes
from pipeplan.planner.dp.context import (
    DEFAULT_PLANNER_MEMORY,
    EXACT_TAU_WORLD,
    DPSettings,
    DPSolution,
    StageNode,
    nested_states,
)
from pipeplan.planner.dp.reconstruct import reconstruct
from pipeplan.planner.dp.solve import solve

__all__ = [
    "DPSettings",
    "StageNode",
    "DPSolution",
    "solve",
    "reconstruct",
    "EXACT_TAU_WORLD",
    "nested_states",
    "table_bytes",
    "planner_memory_limit",
    "DEFAULT_PLANNER_MEMORY",
]
