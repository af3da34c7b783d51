"""One line per figure, the same for every benchmark, so ``bench/run_all.py`` can
collect them into one summary table.

    BENCH {"metric": "scheduler overhead (median ratio)", "value": 1.01, "unit": "x",
           "target": 1.05, "aim": 1.02, "better": "lower"}
"""

from __future__ import annotations

import json

PREFIX = "BENCH "


def report(metric: str, value: float, unit: str, target: float | None, aim: float | None = None,
           better: str = "lower") -> None:
    """Print one figure against its target (``better`` is "lower" or "higher"); a
    ``target`` of None shows the figure for context only."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better must be 'lower' or 'higher', not {better!r}")
    print(PREFIX + json.dumps({"metric": metric, "value": value, "unit": unit,
                               "target": target, "aim": aim, "better": better}), flush=True)


def meets(figure: dict, bound: float | None) -> bool | None:
    if bound is None:
        return None
    return figure["value"] <= bound if figure["better"] == "lower" else figure["value"] >= bound
