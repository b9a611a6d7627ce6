"""Canary rollouts: per-arm window statistics and the decision function (pure), and the
runner that feeds them from router outcomes and applies decisions in Postgres (I/O)."""
