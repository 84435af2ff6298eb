"""One job directory per MPI launch, also under wrappers that do not exec (issue 21 item 9).

The job directory is named after the launcher process that started this node's ranks: the
nearest ancestor not started with the rank's launcher variables. A ``sh -c 'python ...'``
or a run.sh that runs python without ``exec`` carries the rank's variables and is passed
over; two launches never share a directory.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from conftest import mpiexec_path

SHOW_JOB = "from chemio_py import scratch; print(scratch.job_id())"


def _output_of(argv: list[str], **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_"))}
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**full, **env})
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_the_launcher_is_the_process_that_set_the_rank_variables():
    """This test process plays the launcher: it starts a "rank" with PMI variables, directly
    or through wrappers that do not exec; a wrapper that gives the rank other values (a
    launcher of its own) is where the job begins."""
    rank = {"PMI_RANK": "0", "PMI_SIZE": "1"}
    me = f"-{os.getpid()}"
    assert _output_of([sys.executable, "-c", SHOW_JOB], **rank).endswith(me)
    wrapped = f"{sys.executable} -c '{SHOW_JOB}'"
    assert _output_of(["sh", "-c", wrapped + "; true"], **rank).endswith(me)
    assert _output_of(["sh", "-c", f"sh -c \"{wrapped}; true\"; true"], **rank).endswith(me)
    inner = _output_of(["sh", "-c", f"PMI_RANK=1 {wrapped}; true"], **rank)
    assert not inner.endswith(me)
    alone = _output_of([sys.executable, "-c", SHOW_JOB])       # not under MPI: itself
    assert not alone.endswith(me)


RANK = """
import os, sys, time, chemio_py as cio
c = cio.comm()
f = cio.ExclusiveFile("ident", "w+")
with open(os.path.join(os.path.dirname(sys.argv[0]), f"dir.{c.rank}"), "w") as out:
    out.write(os.path.dirname(f.path))
while not os.path.exists(sys.argv[1]):      # both launches run side by side
    time.sleep(0.05)
c.barrier()
f.close()
"""


def _launch(tmp_path, how: str, release: str, root: str) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    run = f"{sys.executable} -m mpi4py {script} {release}"
    if how == "sh -c":
        cmd = ["sh", "-c", run]
    else:
        wrapper = tmp_path / "run.sh"
        wrapper.write_text(f"#!/bin/sh\n# no exec: the shell stays between hydra and python\n"
                           f"{run}\necho done\n")
        wrapper.chmod(0o755)
        cmd = [str(wrapper)]
    return subprocess.Popen([mpiexec_path(), "-n", "2", *cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CHEMIO_SCRATCH": root, "SLURM_JOB_ID": "4242"})


def _wait_for(path, proc: subprocess.Popen) -> str:
    """The text a rank wrote to ``path`` (once it is there)."""
    deadline = time.monotonic() + 120
    while not os.path.exists(path) or not open(path).read():
        assert proc.poll() is None and time.monotonic() < deadline, f"no {path}"
        time.sleep(0.05)
    return open(path).read()


def test_ranks_under_a_wrapper_share_a_job_dir_and_launches_do_not(tmp_path):
    root = str(tmp_path / "scratch")
    release = str(tmp_path / "release")
    places = {"sh -c": tmp_path / "sh-c", "run.sh": tmp_path / "run-sh"}
    procs = []
    for how, place in places.items():
        place.mkdir()
        procs.append(_launch(place, how, release, root))
    try:
        dirs = []
        for place, p in zip(places.values(), procs):
            said = [_wait_for(place / f"dir.{r}", p) for r in (0, 1)]
            assert said[0] == said[1], said                  # one directory per launch
            dirs.append(said[0])
        assert dirs[0] != dirs[1]                            # two launches, two directories
        assert all(os.path.basename(d).startswith("chemio-4242-") for d in dirs)
    finally:
        open(release, "w").close()
        for p in procs:
            try:
                p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
    assert [p.returncode for p in procs] == [0, 0]
    assert os.listdir(root) == []


def test_a_launch_id_names_the_job_when_proc_shows_no_launcher():
    code = textwrap.dedent("""
        from chemio_py.scratch import jobs
        print(jobs._launch_id())
    """)
    assert _output_of([sys.executable, "-c", code], PMIX_NAMESPACE="prterun-vm-1@1") \
        == "PMIX_NAMESPACE=prterun-vm-1@1"
    assert _output_of([sys.executable, "-c", code], SLURM_JOB_ID="7", SLURM_STEP_ID="2") \
        == "slurm=7.2"
    assert _output_of([sys.executable, "-c", code], SLURM_JOB_ID="7") == "None"
