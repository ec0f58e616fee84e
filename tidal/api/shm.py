"""Names of a job's shared memory (``/dev/shm``), known to the workers that create it and to the
master that removes what dead workers left once the job has ended.

A worker's flash checkpoint (``tidal.worker.flash``) is named ``<job>-w<worker id>`` and its slots
are the files ``tidal-<name>-<index>``.
"""

from __future__ import annotations

import re

SHM_DIR = "/dev/shm"


def worker_checkpoint_name(job_id: str, worker_id: int) -> str:
    return f"{job_id}-w{worker_id}"


def job_slot_pattern(job_id: str) -> re.Pattern[str]:
    """Matches the file name of every slot of every worker of ``job_id``."""
    return re.compile(re.escape(f"tidal-{job_id}-w") + r"\d+-\d+")
