"""`integration/profile_load.py`: other processes' CPU time on the profile's cores while a group of pieces is timed,
from /proc (this process and its children not counted)."""
import subprocess
import sys
import time

from megatron_pipemesh.integration.profile_load import LoadWatch, busy_ticks, process_ticks

STAT = """cpu  100 5 50 1000 7 1 2 3 0 0
cpu0 60 5 30 500 4 1 1 2 0 0
cpu1 40 0 20 500 3 0 1 1 0 0
intr 12345
"""


def test_the_busy_ticks_of_the_watched_cores_leave_out_idle_and_iowait():
    assert busy_ticks([0], STAT) == 60 + 5 + 30 + 1 + 1 + 2
    assert busy_ticks([0, 1], STAT) == 99 + 40 + 20 + 1 + 1
    assert busy_ticks([2], STAT) == 0


def test_a_process_line_is_read_after_its_name_even_with_spaces_and_parentheses():
    line = "4242 (python (busy) x) R 17 4242 1 0 -1 4194304 100 0 0 0 321 45 0 0 20 0 1 0 99 1000 10"
    assert process_ticks(line) == (17, 366)


def test_another_process_computing_is_seen():
    """A grandchild spinning for a second (not a child: the siblings the profile starts are its children, and
    subtracted) is counted, in cores, and its group is affected."""
    watch = LoadWatch()
    spin = "import time\nend = time.perf_counter() + 1.0\nwhile time.perf_counter() < end: pass"
    shell = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "{spin}" & wait'])
    try:
        with watch.piece("beside"):
            time.sleep(1.2)
    finally:
        shell.wait(30)
    record = watch.record()
    assert record.others_cores["beside"] >= 0.5
    assert "beside" in record.affected and record.cores == len(watch.cores)
