"""PigeonMQ's Jepsen-style suite: a workload, a seeded nemesis, and a history checker.

``test_nemesis.py`` runs it per metadata x replication pair; ``test_checker.py`` tests
the checker and the schedule on synthetic histories.  See ``docs/reliability.md``.
"""
