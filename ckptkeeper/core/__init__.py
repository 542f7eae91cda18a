"""The functional core: model, retention rules, reaper verdicts, placement and ``plan()``.

Pure functions of (catalog snapshot, policy, usage, now): no I/O, no clock, no globals. Everything
above it hands it values and carries out the Plan it returns.
"""
