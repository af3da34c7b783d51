from dask_blackbox.cli.main import main

raise SystemExit(main())
