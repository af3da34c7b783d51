"""The roof: the ``dask-blackbox`` command line and the demo.

Everything here runs the parts below it (the local deployment of
:mod:`dask_blackbox.deploy`, producers, stream processors, sink, read side) and may
import any of them; nothing below imports this package.
"""
