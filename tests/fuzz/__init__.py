"""Fuzzing helpers: the random MPMD program generator (:mod:`tests.fuzz.programs`).

Used by ``tests/test_fuzz_mpmd.py`` (fast profile, hypothesis) and
``tools/fuzz.py`` (long profile). See ``docs/testing.md``.
"""
