"""turnguard's incident reproduction toolkit: client models, a scenario runner, timelines and
capture-to-scenario conversion. Entry point: ``scripts/reproduce`` (``python -m
turnguard_repro`` with ``scripts/`` on ``sys.path``). Needs only mitmproxy (and the standard
library)."""
