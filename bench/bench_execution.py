"""Throughput of the pass@1 harness (`pipeline.inference.execution.run_batch`) on the mbpp task's
answers: what scoring one decode of a held-out set costs.

Generates the `test` split of `data_prep/code_problems.py` (seed 0), then runs `--problems`
of its canonical bodies (all pass) and as many wrong bodies (another problem's body: they fail
or crash) through `run_batch` at each `--workers`, and prints seconds, programs per second and
pass@1 of each half (1.0 and 0.0 when the harness is right).

    python bench/bench_execution.py [--problems 200] [--workers 1,2]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep import code_problems as cp  # noqa: E402
from pipeline.inference.execution import pass_at_1, run_batch, status_counts  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--problems", type=int, default=200)
    p.add_argument("--workers", default="1,2")
    args = p.parse_args(argv)
    probs = cp.generate({"train": 0, "test": args.problems, "dev": 0, "test_unseen": 0})["test"]
    recs = [q.record() for q in probs]
    right = [(r["signature"] + "\n" + r["response"], r["tests"]) for r in recs]
    wrong = [(r["signature"] + "\n" + recs[(i + 1) % len(recs)]["response"], r["tests"])
             for i, r in enumerate(recs)]
    print(f"{len(recs)} problems, {sum(len(r['tests']) for r in recs) / len(recs):.2f} tests each")
    for w in (int(x) for x in args.workers.split(",")):
        t0 = time.perf_counter()
        ok = run_batch(right, workers=w)
        bad = run_batch(wrong, workers=w)
        dt = time.perf_counter() - t0
        print(f"workers {w}: {2 * len(recs)} programs in {dt:.1f} s ({2 * len(recs) / dt:.1f} "
              f"programs/s); pass@1 canonical {pass_at_1(ok):.3f}, other bodies "
              f"{pass_at_1(bad):.3f} {status_counts(bad)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
