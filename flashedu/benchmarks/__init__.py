"""The subcommands of ``flashedu bench`` (one module each) over one shared core
(:mod:`flashedu.benchmarks.core`: environment record, timing, shapes, JSON, tables).
``flashedu bench --help`` lists them; :mod:`flashedu.bench` is the command itself and
:mod:`.peers` the providers it and its subcommands time."""
