"""What the tests and the benchmarks share: real components driven from outside
(faust worker processes, the raw topic read back and published again, a webhook
receiver, a processor fed by hand), never mocks.

Nothing of the product imports this package; it needs the test extra's packages
(``pip install 'dask-blackbox[test]'``) and a broker for most of it. Support only the
test suite needs stays in ``tests/``.
"""
