"""Scripts the tests start as processes of their own (``python tests/jobs/<name>.py`` or
``python -m tests.jobs.<name>``), never collected as tests: what they share with the tests is in
tests/support/jobs.py."""
