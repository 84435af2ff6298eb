"""Where scratch files go and who removes them.

* ``jobs`` — this job's identity, roots and directory, temp names, what it owns and its
  cleanup (at exit and on SIGTERM);
* ``fs`` — file systems: type, free space, removing trees without recursion;
* ``janitor`` — other jobs' directories: leases, verdicts, ``chemio clean``.

Every public name of the three is also found here, as when this was one module.
"""
from chemio_py.scratch.fs import (check_space, clear_dir_at, DIR_FLAGS, existing_ancestor, FsInfo,
                                  fstype, MAX_OPEN_DIRS, printable, remove_entry_at, stat)
from chemio_py.scratch.janitor import (all_roots, JobDirInfo, lease_verdict, marker_problem,
                                       remove_job_dir, scan_job_dirs, this_process)
from chemio_py.scratch.jobs import (ALIVE, arm_sigterm_cleanup, BATCH_JOB_VARS, cleanup, DEAD,
                                    disown, in_job_dir, INIT_PID_NAMESPACE, job_dir, job_id,
                                    JOB_PREFIX, LEASE_PREFIX, MARKER_FORMAT, MARKER_MAGIC,
                                    MARKER_NAME, namespace_tag, NO_LEASE_GRACE, own, parse_scratch,
                                    pid_namespace, private_path, private_root, process_start_time,
                                    read_boot_id, RECORD_LIMIT, register_open, remove_path,
                                    remove_scratch_now, remove_stale_temps, safe_name,
                                    ScratchEntry, shared_root, SIBLING_WAIT, SigtermCleanup,
                                    sweep_temps, TEMP_AGE, temp_path, TempSweep, UNKNOWN,
                                    validate_name)

__all__ = [
    "check_space", "clear_dir_at", "DIR_FLAGS", "existing_ancestor", "FsInfo", "fstype",
    "MAX_OPEN_DIRS", "printable", "remove_entry_at", "stat", "all_roots", "JobDirInfo",
    "lease_verdict", "marker_problem", "remove_job_dir", "scan_job_dirs", "this_process",
    "ALIVE", "arm_sigterm_cleanup", "BATCH_JOB_VARS", "cleanup", "DEAD", "disown",
    "in_job_dir", "INIT_PID_NAMESPACE", "job_dir", "job_id", "JOB_PREFIX", "LEASE_PREFIX",
    "MARKER_FORMAT", "MARKER_MAGIC", "MARKER_NAME", "namespace_tag", "NO_LEASE_GRACE", "own",
    "parse_scratch", "pid_namespace", "private_path", "private_root", "process_start_time",
    "read_boot_id", "RECORD_LIMIT", "register_open", "remove_path", "remove_scratch_now",
    "remove_stale_temps", "safe_name", "ScratchEntry", "shared_root", "SIBLING_WAIT",
    "SigtermCleanup", "sweep_temps", "TEMP_AGE", "temp_path", "TempSweep", "UNKNOWN",
    "validate_name",
]
