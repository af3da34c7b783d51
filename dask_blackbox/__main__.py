from dask_blackbox.cli import main

raise SystemExit(main())
