"""Training: the run every rank makes (run.py), in three parts: its setup (setup.py: model,
policy, optimizer, data, resume), the trainer (trainer.py: the step and the loop) and its end
(summary.py: publish, export, verify, summary.json); the optimizer and LR schedule (optim.py),
the metrics (metrics.py), and the check against a one-rank reference (verify.py)."""
