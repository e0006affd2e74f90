"""Run by tests/test_ci.py as `pytest tests/helpers/sigterm_probe.py` (not collected otherwise): a test that starts a
session of its own as the vLLM server fixture does (rpg_trl.testing.sessions.popen: a shell and its sleeping child) and
a plain child (as `subprocess.run` starts a torchrun), writes their process ids to $RPG_PROBE_PIDS and sleeps until the
outer test sends pytest a SIGTERM."""

import os
import subprocess
import sys
import time
from pathlib import Path

from rpg_trl.testing import sessions


def test_sleeps_until_terminated():
    out = Path(os.environ["RPG_PROBE_PIDS"])
    # Written under another name, then renamed: the redirect creates the file before echo writes, and the loop below
    # could read it empty under load.
    server = sessions.popen(
        ["bash", "-c", f"sleep 300 & echo $$ $! > {out}.tmp-session; mv {out}.tmp-session {out}.session; wait"]
    )
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    while not Path(f"{out}.session").exists():
        time.sleep(0.05)
    pids = Path(f"{out}.session").read_text().split() + [str(server.pid), str(plain.pid)]
    Path(f"{out}.tmp").write_text(" ".join(pids))
    Path(f"{out}.tmp").rename(out)
    time.sleep(300)
