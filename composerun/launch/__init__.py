"""Launching: one job of the command line (job.py: checks, the run directory, then the
ranks), starting ranks through torch's elastic agent (agent.py), what a rank does first
(rank.py), torchrun's environment (torchrun.py), SLURM (slurm.py), signals (signals.py),
the run directory's lock (lock.py), the checks before any rank starts (preflight.py), and
the fork server's start (forkserver.py)."""
