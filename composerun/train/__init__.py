"""Training: the run every rank makes (run.py), its optimizer and LR schedule (optim.py), its
metrics (metrics.py), and the check against a one-rank reference (verify.py)."""
