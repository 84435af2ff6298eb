"""``python benchmarks/bench_stress [options]``: the stress run as a script (``main``); with
``--worker CONFIG`` one stress process, as the launcher starts it."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))       # the package's modules are not
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]   # top-level ones
sys.path.insert(0, os.path.dirname(HERE))

from bench_stress.launcher import main  # noqa: E402  (needs the benchmarks directory)
from bench_stress.worker import worker  # noqa: E402

if len(sys.argv) == 3 and sys.argv[1] == "--worker":
    sys.exit(worker(json.loads(sys.argv[2])))
sys.exit(main())
