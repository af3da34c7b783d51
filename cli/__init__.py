"""The roof: the ``dask-blackbox`` command line, the demo and the local supervisor.

Everything here runs the parts below it (producers, stream processors, sink, read
side) and may import any of them; nothing below imports this package.
"""
