"""Pipeline bubble per schedule, on paper: `shardwise.pipeline.simulate` runs each schedule's stages
against each other (forward 1, backward 2, split backward 1 + 1, free communication) and the simulated
bubble fraction is printed beside the closed form, with each schedule's activation peak.

Pure Python, no processes, no timing: it measures the schedules, not a machine, and runs in a second.

    .venv/bin/python benchmarks/pipeline_bubble.py

Writes benchmarks/results/pipeline_bubble.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, environment, write_report

from shardwise.pipeline import (
    Schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    theoretical_bubble_fraction,
    zb_h1,
)

STAGES = (2, 4)
MICRO_BATCHES = (4, 8, 16)
CHUNKS = 2


def _schedules(p: int, m: int) -> list[Schedule]:
    built = [gpipe(p, m), one_f_one_b(p, m), zb_h1(p, m)]
    if m % p == 0:
        built.append(interleaved_1f1b(p, m, CHUNKS))
    return built


def _row(schedule: Schedule) -> dict[str, Any]:
    result = simulate(schedule)
    theory = theoretical_bubble_fraction(schedule.name, schedule.stages, schedule.micro_batches, schedule.chunks)
    return {"schedule": schedule.name, "p": schedule.stages, "m": schedule.micro_batches, "chunks": schedule.chunks,
            "bubble_fraction_simulated": round(result.bubble_fraction, 6), "bubble_fraction_theory": round(theory, 6),
            "makespan": result.makespan, "peak_in_flight_per_stage": list(result.peak_in_flight),
            "peak_activations_per_stage": [round(a, 3) for a in result.peak_activations]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "pipeline_bubble.json"))
    args = parser.parse_args()
    rows = [_row(s) for p in STAGES for m in MICRO_BATCHES for s in _schedules(p, m)]
    report = {"benchmark": "pipeline_bubble",
              "time_model": {"forward": 1, "backward": 2, "backward_input": 1, "backward_weight": 1, "comm": 0,
                             "chunk": "1/chunks of a stage's times"},
              "theory": {"gpipe, 1f1b": "(p-1)/(m+p-1)", "interleaved_1f1b": "(p-1)/(v*m+p-1)",
                         "zb_h1": "1 - 3m / max(3m + p - 1, 2(m+p-1) + 1)"},
              "environment": environment(), "results": rows}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
