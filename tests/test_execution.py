"""pipeline/inference/execution.py: the sandboxed test runner, on planted answers (right, wrong,
hanging, crashing in several ways, reaching for the network, writing files), and the batch
runner's bound on processes and pass@1."""
import os
import threading
import time

import pytest

from pipeline.inference import execution as ex

SIG = "def f(xs):\n"
TESTS = ["assert f([1, 2, 3]) == 6", "assert f([]) == 0", "assert f([-4, 4, 5]) == 5"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie not yet reaped by its parent (init) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_right_answer_passes():
    r = ex.run_tests(SIG + "    return sum(xs)\n", TESTS)
    assert r.status == "passed" and r.passed and r.failed_test is None


def test_wrong_answer_fails_naming_the_assert():
    # right on the first two tests, wrong on the third
    r = ex.run_tests(SIG + "    return sum(x for x in xs if x > 0)\n", TESTS)
    assert r.status == "failed" and not r.passed
    assert r.failed_test == 2 and r.detail == TESTS[2]


def test_hanging_answer_times_out_and_its_processes_are_killed(tmp_path):
    pids = tmp_path / "pids"
    code = (SIG + "    import os\n"
            "    if os.fork() == 0:\n"           # a grandchild that hangs too (root may fork)
            f"        open({str(pids)!r} + '.child', 'w').write(str(os.getpid()))\n"
            "        while True: pass\n"
            f"    open({str(pids)!r}, 'w').write(str(os.getpid()))\n"
            "    while True: pass\n")
    t0 = time.monotonic()
    r = ex.run_tests(code, TESTS, timeout_s=1.0)
    assert r.status == "timeout" and not r.passed
    assert time.monotonic() - t0 < 30          # returned, not hung with its answer
    assert _gone(int(pids.read_text()))
    child = tmp_path / "pids.child"
    if child.exists():                         # fork allowed (root): its group was killed too
        deadline = time.monotonic() + 10
        while not _gone(int(child.read_text())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(int(child.read_text()))


@pytest.mark.parametrize("body,detail", [
    ("    return 1 // 0\n", "ZeroDivisionError"),
    ("    raise ValueError('bad')\n", "ValueError: bad"),
    ("    import sys\n    sys.exit(0)\n", "SystemExit"),
    ("    return len(bytearray(10 ** 10))\n", "MemoryError"),
    ("    ys = [0] * (10 ** 9)\n    return 6\n", "MemoryError"),
])
def test_raising_answers_crash_with_their_error(body, detail):
    r = ex.run_tests(SIG + body, TESTS, memory_bytes=256 * 2 ** 20)
    assert r.status == "crashed" and not r.passed
    assert r.failed_test == 0 and detail in r.detail


def test_exit_without_result_is_a_crash_not_a_pass():
    r = ex.run_tests(SIG + "    import os\n    os._exit(0)\n", TESTS)
    assert r.status == "crashed" and "without a result" in r.detail
    r = ex.run_tests(SIG + "    import os, signal\n    os.kill(os.getpid(), signal.SIGSEGV)\n",
                     TESTS)
    assert r.status == "crashed" and "SIGSEGV" in r.detail


def test_cpu_limit_signal_counts_as_timeout():
    # what RLIMIT_CPU sends (the wall clock, at most the CPU limit, normally ends a loop first)
    r = ex.run_tests(SIG + "    import os, signal\n    os.kill(os.getpid(), signal.SIGXCPU)\n",
                     TESTS)
    assert r.status == "timeout" and "SIGXCPU" in r.detail


def test_syntax_error_crashes_at_definition():
    r = ex.run_tests(SIG + "    return sum(xs\n", TESTS)
    assert r.status == "crashed" and r.failed_test == -1 and "SyntaxError" in r.detail


def test_network_is_cut():
    for call in ("socket.create_connection(('127.0.0.1', 9))",
                 "socket.socket(socket.AF_INET, socket.SOCK_STREAM)",
                 "_socket.socket()",
                 "socket.getaddrinfo('example.com', 80)"):
        code = SIG + f"    import socket, _socket\n    {call}\n    return sum(xs)\n"
        r = ex.run_tests(code, TESTS)
        assert r.status == "crashed" and "network access is disabled" in r.detail, call
    # and the environment carries no proxy settings
    code = SIG + "    import os\n    return sum(xs) + sum('proxy' in k.lower() for k in os.environ)\n"
    assert ex.run_tests(code, TESTS).passed


def test_files_are_written_in_a_scratch_dir_that_is_removed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    where = tmp_path / "where"
    code = (SIG + "    import os\n    open('leak.txt', 'w').write('x')\n"
            f"    open({str(where)!r}, 'w').write(os.getcwd())\n    return sum(xs)\n")
    assert ex.run_tests(code, TESTS).passed
    scratch = where.read_text()
    assert not (tmp_path / "leak.txt").exists()
    assert os.path.realpath(scratch) != os.path.realpath(tmp_path)
    assert not os.path.exists(scratch)


def test_large_output_is_capped():
    r = ex.run_tests(SIG + "    print('x' * 10 ** 7)\n    return sum(xs)\n", TESTS)
    assert r.status == "crashed"


def test_batch_scores_planted_answers_with_bounded_processes(monkeypatch):
    live, peak, lock = [0], [0], threading.Lock()
    real = ex.run_tests

    def counted(*a, **k):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        try:
            return real(*a, **k)
        finally:
            with lock:
                live[0] -= 1
    monkeypatch.setattr(ex, "run_tests", counted)
    bodies = ["    return sum(xs)\n", "    return 0\n", "    while True: pass\n",
              "    return xs[10]\n", "    s = 0\n    for x in xs:\n        s += x\n    return s\n"]
    t0 = time.monotonic()
    res = ex.run_batch([(SIG + b, TESTS) for b in bodies], timeout_s=1.0, workers=2)
    assert time.monotonic() - t0 < 60
    assert [r.status for r in res] == ["passed", "failed", "timeout", "crashed", "passed"]
    assert peak[0] <= 2
    assert ex.pass_at_1(res) == pytest.approx(2 / 5)
    assert ex.status_counts(res) == {"passed": 2, "failed": 1, "timeout": 1, "crashed": 1}
    assert ex.pass_at_1([]) is None and ex.run_batch([]) == []


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="timeout_s"):
        ex.run_tests(SIG + "    return 0\n", TESTS, timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        ex.run_batch([(SIG, TESTS)], workers=0)
