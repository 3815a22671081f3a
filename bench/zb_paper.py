"""The Zero Bubble paper's GPT bubble table (Qi et al., ICLR 2024), as data, and the profile
that puts its measured times into pipeplan's simulator.

Source of every figure here (``SOURCE``): the authors' repository
sail-sg/zero-bubble-pipeline-parallelism, branch ``arxiv`` (commit f68d387, 2023-11-29, "for
arxiv paper"), ``megatron/core/pipeline_parallel/efficiency.py``. Its ``iclr_bubble_rates()``
lists the four GPT models' settings (p, m, T_F, T_B, T_W, T_comm in microseconds; hidden size,
heads, layers) and computes 1F1B, ZB-H1, ZB-H2, ZB-1p and ZB-2p bubble rates; the docstring
closing the file holds the LaTeX rows it printed (p, m, T_F, T_B, T_W, T_comm in ms, then the
five rates), which ``ROWS`` copies. The bubble rate is the script's:
(cost - m (T_F + T_B + T_W)) / cost, cost being one iteration's makespan.
The model sizes (1.5B: hidden 2304, 24 layers; 6.2B: 4096, 32; 14.6B: 5120, 48; 28.3B: 6144,
64) are the paper's names for those settings. The same file's ``arxiv_bubble_rates()`` (the
ZB-V comparison of the arXiv version) has settings but no printed rates, so no ZB-V figure of
the paper is compared here; the V-Half/V-Min paper's table was not found either.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.profile import DeviceInfo, LayerProfile, Profile

SOURCE = (
    "sail-sg/zero-bubble-pipeline-parallelism@f68d38794764d7d937f4942dca3a1e9a07544898 (branch arxiv), "
    "megatron/core/pipeline_parallel/efficiency.py: iclr_bubble_rates() and its printed rows"
)


@dataclass(frozen=True)
class PaperRow:
    """One row of the paper's table: a GPT setting, its profiled per-stage times (ms, one
    micro-batch) and the bubble rates the authors computed for it."""

    model: str
    p: int
    m: int
    forward_ms: float  # T_F
    input_grad_ms: float  # T_B
    weight_grad_ms: float  # T_W
    comm_ms: float  # T_comm, one point-to-point message
    rate_1f1b: float
    rate_zb_h1: float
    rate_zb_h2: float
    rate_zb_1p: float
    rate_zb_2p: float

    @property
    def ideal_ms(self) -> float:
        """m (T_F + T_B + T_W): one stage's compute per iteration, the bubble rate's floor."""
        return self.m * (self.forward_ms + self.input_grad_ms + self.weight_grad_ms)


ROWS = (
    PaperRow("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601, 0.2431, 0.1585, 0.1083, 0.1585, 0.0433),
    PaperRow("1.5B", 8, 32, 18.513, 18.086, 9.331, 0.626, 0.1985, 0.1242, 0.0837, 0.1242, 0.0039),
    PaperRow("1.5B", 8, 64, 18.546, 18.097, 9.321, 0.762, 0.1240, 0.0674, 0.0444, 0.0674, 0.0026),
    PaperRow("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527, 0.2347, 0.1323, 0.0698, 0.1323, 0.0029),
    PaperRow("6.2B", 8, 32, 29.802, 29.428, 19.530, 0.577, 0.1898, 0.1045, 0.0559, 0.1045, 0.0022),
    PaperRow("6.2B", 8, 64, 29.935, 29.621, 19.388, 0.535, 0.1091, 0.0554, 0.0294, 0.0554, 0.0010),
    PaperRow("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377, 0.2552, 0.1397, 0.0672, 0.1397, 0.0066),
    PaperRow("14.6B", 16, 64, 11.307, 11.254, 8.101, 0.379, 0.2082, 0.1088, 0.0516, 0.1088, 0.0054),
    PaperRow("14.6B", 16, 128, 11.325, 11.308, 8.109, 0.378, 0.1251, 0.0576, 0.0266, 0.0576, 0.0028),
    PaperRow("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408, 0.2646, 0.1421, 0.0641, 0.1421, 0.0038),
    PaperRow("28.3B", 32, 128, 10.408, 10.204, 7.703, 0.408, 0.2168, 0.1106, 0.0490, 0.1106, 0.0029),
    PaperRow("28.3B", 32, 256, 10.402, 10.248, 7.698, 0.460, 0.1352, 0.0594, 0.0257, 0.0594, 0.0018),
)


def paper_profile(row: PaperRow, link_bytes_per_s: float | None) -> Profile:
    """2p equal layers whose p straight stages of two (or 2p V chunks of one) take the row's
    T_F, T_B, T_W per micro-batch; each layer's output crosses a link of ``link_bytes_per_s``
    in T_comm (no bytes with None). Times are the minibatch's (m micro-batches), as in a
    profile."""
    count, m = 2 * row.p, row.m
    size = int(round(row.comm_ms * 1e-3 * link_bytes_per_s)) * m if link_bytes_per_s else 0
    layers = tuple(
        LayerProfile(
            i,
            f"block{i}",
            "Block",
            (i - 1,) if i else (),
            m * row.forward_ms / 2,
            m * (row.input_grad_ms + row.weight_grad_ms) / 2,
            size,
            0,
            0,
            backward_input_ms=m * row.input_grad_ms / 2,
        )
        for i in range(count)
    )
    return Profile(
        f"zero-bubble {row.model}", f"zb-{row.model}-{row.p}", DeviceInfo("cpu", "none"), m, "float32", layers
    )


def bubble_rate(row: PaperRow, period_ms: float) -> float:
    """The paper's bubble rate of an iteration lasting ``period_ms``."""
    return (period_ms - row.ideal_ms) / period_ms
