"""These are AWS's scripts run under mpirun by tests/mpi/test_aws_*.py, never collected by pytest
(``tf2_checkpoint_test.py`` matches ``*_test.py`` and would run at import)."""

collect_ignore_glob = ["*.py"]
