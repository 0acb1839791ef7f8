"""A bounded chaos run against turnguard's promises: two guarded mitmdumps on one SQLite
ledger in front of the mock upstream, turns and their duplicates sent through either
process, and faults injected meanwhile (see ``scripts/chaos --help``)."""
