from benchmarks.governance.budget_accuracy import main

raise SystemExit(main())
