"""The fix people are told, in one place: the warn policy's warning and log line in the
training process (ckptwatch/policy.py, from the agent's notices or job scope), `ckptwatch
report` and its HTML timeline (monitor/cli/report.py), `ckptwatch lint` (monitor/lint).

Loaded into training processes, imported by the agent's commands: no imports at all.
"""

# One writer: global rank 0 only. A `LOCAL_RANK == 0` guard is one writer per node, which
# still collides on shared storage (LOCAL_RANK_NOTE).
GUARD_FIX = "guard this call site with a global-rank-0 check (dist.get_rank() == 0)"
# The same, for a collision whose writes came from several call sites.
GUARD_FIX_SITES = GUARD_FIX.replace("this call site", "each of these call sites")
OWN_PATH_FIX = "give each rank its own path"
FIX = f"{GUARD_FIX}; or {OWN_PATH_FIX}"
LOCAL_RANK_NOTE = ("note LOCAL_RANK == 0 is one writer per node, still colliding on shared "
                   "storage")
# Writers that are not ranks of one job run.
JOBS_FIX = ("different jobs (or restarts) write this path: give each job its own output "
            "directory")
PROCESS_FIX = "make only one process write this path, or give each process its own path"

# `ckptwatch diagnose`: what to do about a checkpoint that failed to load.
RESUME_FIX = ("do not resume from this file: resume from the previous checkpoint, and check "
              "the others with `ckptwatch scan --deep DIR`")
NO_RECORD_FIX = ("no collision on record for this file: run the job under an agent "
                 "(`ckptwatch run -- ...`, or `ckptwatch check -- ...` in CI) to see who writes "
                 "it; a save that died or a full disk also cuts a file short")
STAGING_FIX = ("save each checkpoint from one process: with transformers' Trainer on shared "
               "storage keep save_on_each_node=False, and do not call save_model from every "
               "rank")
OWNER_FIX = ("another user or job wrote this file: give each job its own output directory")
