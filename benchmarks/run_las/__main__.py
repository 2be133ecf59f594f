from benchmarks.run_las.run import main

raise SystemExit(main())
