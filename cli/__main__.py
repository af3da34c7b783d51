from dask_blackbox.cli.main import run

run()
