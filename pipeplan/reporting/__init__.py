"""Human-readable views: profile tables, predicted-vs-measured reports, timelines.

Modules: ``profile_table`` (a ``Profile`` as a rich table and summary lines, ``pipeplan
profile``), ``run_vs_plan`` (a run's measured ``Metrics`` against the plan's prediction,
``pipeplan report``), ``timeline`` (a simulated or measured schedule as a Chrome trace,
SVG or PNG, ``pipeplan simulate --timeline``). They read the contracts only; nothing
below the CLI imports them. Import the module you need (this package re-exports nothing,
so that ``pipeplan --help`` stays free of rich and matplotlib).
"""

__all__: list[str] = []
