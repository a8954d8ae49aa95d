"""The project's own fuzz suite: seeded random cases for every public function, module
and raw op, each judged against the float64 reference (valid inputs) or required to
raise ValueError, TypeError or IndexError naming the bad argument (bad inputs).

One module per job:

- ``case.py``       what a case is: a call, and what must come of it (Agrees / Raises)
- ``draw.py``       the seeded random source: sizes biased to edges, dtypes, tensors, layouts
- ``judges.py``     comparisons: SPEC section 4 against float64, and exact equality
- ``mutations.py``  generic ways to break one argument of a valid call
- ``conv.py``, ``selector.py``, ``serving.py``: one case generator per target
- ``selftest.py``   targets that crash and hang on purpose (the harness's own test)
- ``targets.py``    the registry: target name -> generator
- ``runner.py``     the child process: ``python -m tests.fuzz.runner TARGET SEED START COUNT``
- ``harness.py``    the parent side: runs plans in children, reports crashes, hangs, failures

Every case is reproducible from (target, seed, index) alone:
``python -m tests.fuzz.runner TARGET SEED INDEX 1 --traceback`` (from the repository
root, with the project's Python) replays one case and prints its traceback.

``tests/test_fuzz.py`` is the pytest entry, one test per target. Environment:
``DFLASH2_FUZZ_CASES`` (cases per target, default 300; e.g. 5000 for a long run),
``DFLASH2_FUZZ_SEED`` (default 0), ``DFLASH2_FUZZ_JOBS`` (children at a time, default
the CPU count), ``DFLASH2_FUZZ_CASE_TIMEOUT`` (seconds before a case counts as hung,
default 120).
"""
